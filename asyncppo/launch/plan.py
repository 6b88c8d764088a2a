"""The placement plan: which role runs where, decided from the config alone (no Ray, no devices touched).

Kept pure so that ``asyncppo launch --dry-run`` can show it in milliseconds, tests can assert it exactly, and the
launch plan (launch/resolve.py) can turn it into placement-group bundles. Whether the cluster actually has these
resources is checked there (``check_cluster``), not in this module.

Rules:

* ``cluster.rollout_gpus = N > 0``: N / (TP x PP) rollout engines of TP x PP GPUs each (``rollout.tensor_parallel_size``,
  ``rollout.pipeline_parallel_size``; validate.py refuses splits that leave GPUs idle). One engine is one rollout
  actor and one Ray bundle holding all its GPUs, so an engine's ranks never straddle two nodes (they talk over the
  node's links on every layer). ``N = 0``: ``cluster.rollout_workers`` CPU rollout actors; with TP > 1 each one's
  engine runs TP worker processes, so the actor reserves TP x ``cluster.cpus_per_worker`` CPUs.
* ``cluster.train_gpus = M > 0``: M learner ranks, one GPU each; ``M = 0``: one CPU learner.
* ``cluster.shared_gpus = N > 0`` (``--gpus N``): N learner ranks and N engines, learner rank i and engine i on
  device i; on CUDA each asks for half a GPU of one shared one-GPU bundle (launch/shared_device.py).
* Every role asks for ``cluster.cpus_per_worker`` CPUs.
* Learner rank 0 also hosts the trajectory sink, the admission controller, the control publisher and rank 0 of
  the weight-sync group, whose world is learner rank 0 plus every rollout engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncppo.config.schema import AsyncPPOConfig

_PORT_NAMES = ("trajectory_port", "control_port", "admission_port", "sync_port")


@dataclass(frozen=True)
class RolePlacement:
    """One process to start."""

    name: str  # "learner-0", "rollout-3"
    kind: str  # "learner" | "rollout"
    rank: int  # index among roles of the same kind
    device: str  # "gpu" | "cpu"
    gpus: float  # GPUs this role reserves (0, 1, TP x PP for a rollout engine, 0.5 on a shared device)
    cpus: float  # CPUs this role reserves
    gpu_ids: tuple[int, ...] = ()  # positions in its pool (learner or rollout GPUs); Ray picks the physical devices
    tp: int = 1  # tensor-parallel ranks of a rollout engine (processes on CPU)
    shared: bool = False  # --gpus N: this role shares device gpu_ids[0] with the other kind's role of its rank


@dataclass
class PlacementPlan:
    roles: list[RolePlacement]
    engine: str  # rollout.engine
    bind_address: str
    advertise_address: str
    ports: dict[str, int] = field(default_factory=dict)  # cluster.*_port; 0 = a free port picked at launch
    ray_address: str | None = None  # None: start a local Ray instance
    generation: str = "continuous"  # rollout.generation
    max_num_seqs: int = 256  # rollout.max_num_seqs
    inflight_update: str = "keep"  # rollout.inflight_update

    @property
    def learners(self) -> list[RolePlacement]:
        return [r for r in self.roles if r.kind == "learner"]

    @property
    def rollouts(self) -> list[RolePlacement]:
        return [r for r in self.roles if r.kind == "rollout"]

    @property
    def total_gpus(self) -> float:
        return sum(r.gpus for r in self.roles)

    @property
    def total_cpus(self) -> float:
        return sum(r.cpus for r in self.roles)

    @property
    def weight_sync_world_size(self) -> int:
        """Learner rank 0 plus one rank per rollout engine."""
        return 1 + len(self.rollouts)


def engine_width(cfg: AsyncPPOConfig) -> int:
    """Devices one rollout engine spans: TP x PP."""
    return max(1, int(cfg.rollout.tensor_parallel_size)) * max(1, int(cfg.rollout.pipeline_parallel_size))


def num_rollout_engines(cfg: AsyncPPOConfig) -> int:
    """Rollout actors to start: one per engine."""
    cl = cfg.cluster
    if cl.shared_gpus > 0:
        return cl.shared_gpus
    return cl.rollout_gpus // engine_width(cfg) if cl.rollout_gpus > 0 else cl.rollout_workers


def rollout_bundle(cfg: AsyncPPOConfig) -> dict[str, float]:
    """The Ray resources of one rollout engine's bundle: all its GPUs together (Ray keeps a bundle on one node)."""
    cl, width = cfg.cluster, engine_width(cfg)
    if cl.rollout_gpus > 0:
        return {"CPU": float(cl.cpus_per_worker), "GPU": float(width)}
    return {"CPU": float(cl.cpus_per_worker) * width}


def check_engine_fits(cfg: AsyncPPOConfig, node_gpus: list[float]) -> None:
    """Refuse, before anything starts, an engine wider than the largest node's GPU count (``node_gpus``: the GPUs
    of each alive Ray node). Without this Ray would wait forever for a bundle no node can hold."""
    width = engine_width(cfg)
    if cfg.cluster.rollout_gpus > 0 and node_gpus and width > max(node_gpus):
        raise ValueError(
            f"rollout.tensor_parallel_size x pipeline_parallel_size = {width} GPUs per engine, but the largest Ray "
            f"node has {max(node_gpus):g} GPU(s): an engine's ranks must share a node; lower "
            "rollout.tensor_parallel_size")


def _shared_roles(cfg: AsyncPPOConfig) -> list[RolePlacement]:
    """``--gpus N``: learner rank i and engine i on device i, each with half of it on CUDA."""
    cl = cfg.cluster
    on_gpu, cpus = cl.shared_device == "cuda", float(cl.cpus_per_worker)
    device, share = ("gpu", 0.5) if on_gpu else ("cpu", 0.0)
    return [RolePlacement(f"{kind}-{i}", kind, i, device, share, cpus, (i,), 1, True)
            for kind in ("learner", "rollout") for i in range(cl.shared_gpus)]


def make_placement_plan(cfg: AsyncPPOConfig) -> PlacementPlan:
    cl = cfg.cluster
    cpus = float(cl.cpus_per_worker)
    roles: list[RolePlacement] = []
    if cl.shared_gpus > 0:
        roles = _shared_roles(cfg)
    elif cl.train_gpus > 0:
        roles += [RolePlacement(f"learner-{i}", "learner", i, "gpu", 1, cpus, (i,)) for i in range(cl.train_gpus)]
    else:
        roles.append(RolePlacement("learner-0", "learner", 0, "cpu", 0, cpus))
    width, tp = engine_width(cfg), max(1, int(cfg.rollout.tensor_parallel_size))
    for i in range(num_rollout_engines(cfg) if not cl.shared_gpus else 0):
        if cl.rollout_gpus > 0:
            ids = tuple(range(i * width, (i + 1) * width))
            roles.append(RolePlacement(f"rollout-{i}", "rollout", i, "gpu", width, cpus, ids, tp))
        else:
            roles.append(RolePlacement(f"rollout-{i}", "rollout", i, "cpu", 0, cpus * width, (), tp))
    return PlacementPlan(
        roles=roles,
        engine=cfg.rollout.engine if not cfg.env.id else f"env:{cfg.env.id}",
        bind_address=cl.bind_address,
        advertise_address=cl.advertise_address or cl.bind_address,
        ports={name: int(getattr(cl, name)) for name in _PORT_NAMES},
        ray_address=cl.address,
        generation=cfg.rollout.generation,
        max_num_seqs=cfg.rollout.max_num_seqs,
        inflight_update=cfg.rollout.inflight_update,
    )


def format_plan(plan: PlacementPlan) -> str:
    """A human-readable table of the plan (what ``--dry-run`` prints)."""
    lines = [
        f"placement plan: {len(plan.learners)} learner rank(s), {len(plan.rollouts)} rollout worker(s) "
        f"[engine={plan.engine}], {plan.total_gpus:g} GPU(s), {plan.total_cpus:g} CPU(s) in total",
        f"  {'role':<12} {'kind':<8} {'device':<7} {'gpus':>4} {'cpus':>5}  notes",
    ]
    for r in plan.roles:
        if r.kind == "learner":
            notes = "trajectory sink, admission, control, weight-sync rank 0" if r.rank == 0 else "data-parallel rank"
        else:
            notes = (f"{plan.engine} engine ({plan.generation}, up to {plan.max_num_seqs} sequences, in-flight "
                     f"update {plan.inflight_update}), own weight-sync group")
            if plan.engine.startswith("env:"):
                notes = f"{plan.engine[4:]} env worker (gymnasium vector env), own weight-sync group"
            if r.device == "gpu":
                notes = (f"engine {r.rank}: GPU{'s' if len(r.gpu_ids) > 1 else ''} "
                         f"{','.join(map(str, r.gpu_ids))}" + (f" (TP={r.tp}, one bundle, one node)" if r.tp > 1
                                                               else "") + "; " + notes)
            elif r.tp > 1:
                notes = f"engine {r.rank}: TP={r.tp} engine processes on CPU; " + notes
        if r.shared:
            notes = f"shares device {r.gpu_ids[0]} with {'rollout' if r.kind == 'learner' else 'learner'}-{r.rank}; " \
                    + notes
        lines.append(f"  {r.name:<12} {r.kind:<8} {r.device:<7} {r.gpus:>4g} {r.cpus:>5g}  {notes}")
    ports = ", ".join(f"{k.removesuffix('_port')}={v or 'auto'}" for k, v in plan.ports.items())
    lines.append(f"  ports: {ports} (bind {plan.bind_address}, advertise {plan.advertise_address})")
    # sync/fanout.py: one group per worker (LLM engines and env workers alike), so one worker's death breaks nobody
    shm = " over host shared memory (shared devices: no NCCL)" if any(r.shared for r in plan.roles) else ""
    lines.append(f"  weight sync: {len(plan.rollouts)} two-rank group(s), learner rank 0 + one worker each{shm}")
    lines.append(f"  ray: {plan.ray_address or 'local instance started by the launcher'}")
    return "\n".join(lines)
