"""Launch a run with Ray: place the learner and the rollout workers, wire their addresses, watch them, clean up.

Order of start-up: the driver resolves the model (building the built-in one once, so the actors do not race to build
it), starts Ray, checks the requested GPUs against what Ray sees, reserves a placement group with one bundle per role,
starts the learner actor (which decides where to listen from the node Ray placed it on, binds the stream, control
and admission sockets and returns their addresses: launch/addresses.py), checks that every other bundle's node can
reach them (else fails at once), records it all in ``<run_dir>/placement.json``, then starts the rollout workers with
those addresses. The driver then waits: the learner finishing ends the run. A rollout
worker that dies is replaced, up to ``cluster.max_worker_restarts`` times in the run: the learner first takes back
its tickets and awaits the replacement in the weight sync (``LearnerService.replace_worker``), then a new actor of
the next incarnation starts in the same placement bundle, resuming the worker's prompt sequence. Any other actor
dying, or one worker death too many, ends the run with the actor's error. Ctrl-C, an error or a normal end all go
through ``ray.shutdown()`` (which also stops a local Ray cluster's processes), so nothing is left behind.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
from typing import Any

from asyncppo.config.schema import AsyncPPOConfig


class LaunchError(RuntimeError):
    """A launch problem the user can fix (resources, paths); printed without a traceback."""


class WorkerFailed(RuntimeError):
    """A rollout worker died and may not be replaced (restarts used up, or an embodied run)."""


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(exc).__name__


def _actor_env(cfg: AsyncPPOConfig) -> dict[str, str]:
    # One OpenMP/MKL thread per actor: several processes share the cores, and oversubscription is slower than none.
    env = {
        "OMP_NUM_THREADS": os.environ.get("ASYNCPPO_THREADS", "1"),
        "MKL_NUM_THREADS": os.environ.get("ASYNCPPO_THREADS", "1"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),  # threads sleep, not spin (cli.py)
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "WANDB_SILENT": "true",
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    if cfg.cluster.rollout_gpus == 0:
        env["VLLM_TARGET_DEVICE"] = "cpu"
    for key in ("ASYNCPPO_LEARNER_THREADS", "ASYNCPPO_LEARNER_CPUS", "ASYNCPPO_ROLLOUT_CPUS", "ASYNCPPO_CACHE",
                "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE"):
        if key in os.environ:
            env[key] = os.environ[key]
    return env


def _check_output_dir(cfg: AsyncPPOConfig, output_dir: str) -> None:
    """Refuse a directory that already holds a run's records: a second run there would append its metrics to the
    first one's ``metrics.jsonl`` (and the console, which follows that file, would print both runs' lines), and its
    checkpoints would prune the first one's. Resuming in place (``trainer.resume_from`` inside it) continues it."""
    if not os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
        return
    resume = cfg.trainer.resume_from and os.path.abspath(cfg.trainer.resume_from)
    if resume and (resume == output_dir or resume.startswith(output_dir + os.sep)):
        return
    raise LaunchError(
        f"trainer.output_dir={output_dir!r} already holds a run (metrics.jsonl): choose a new directory, or continue "
        f"that run with trainer.resume_from={output_dir}")


def _resolve_model(cfg: AsyncPPOConfig) -> str:
    from asyncppo.data.tiny import resolve_model_path

    path = resolve_model_path(cfg.model.path, sft_steps=cfg.trainer.sft_warmup_steps, seed=cfg.trainer.seed)
    if not os.path.isdir(path):
        raise LaunchError(f"model.path={cfg.model.path!r}: no such model directory")
    return path


def _check_data(cfg: AsyncPPOConfig) -> None:
    for path in list(cfg.data.train_files) + list(cfg.data.eval_files):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise LaunchError(f"data file {path!r} does not exist or is not readable (data.train_files/eval_files)")


def _check_env(cfg: AsyncPPOConfig) -> str:
    """Embodied runs: the env id exists and its spaces are supported, checked before Ray starts. No model path."""
    from asyncppo.envs.spaces import EnvError, describe_env

    try:
        describe_env(cfg.env)
    except EnvError as exc:
        raise LaunchError(str(exc)) from None
    if cfg.trainer.resume_from:
        raise LaunchError("trainer.resume_from is not supported for embodied runs yet")
    return ""


def _check_resources(cfg: AsyncPPOConfig, resources: dict[str, float]) -> None:
    want_gpus = cfg.cluster.rollout_gpus + cfg.cluster.train_gpus
    have_gpus = int(resources.get("GPU", 0))
    if want_gpus > have_gpus:
        raise LaunchError(
            f"asked for {cfg.cluster.rollout_gpus} rollout + {cfg.cluster.train_gpus} train GPUs = {want_gpus}, "
            f"but the Ray cluster has {have_gpus} GPU(s). Lower --rollout-gpus/--train-gpus "
            "(0 and 0 run everything on CPU) or join a bigger cluster with cluster.address=HOST:PORT."
        )
    from asyncppo.launch.plan import num_rollout_engines

    # every learner rank and every rollout engine is one bundle asking for the role's custom resources
    bundles = {"learner_resources": max(1, cfg.cluster.train_gpus), "rollout_resources": num_rollout_engines(cfg)}
    for key, count in bundles.items():
        for name, amount in getattr(cfg.cluster, key).items():
            if resources.get(name, 0) < amount * count:
                raise LaunchError(
                    f"cluster.{key} asks for {amount:g} of the Ray resource {name!r} per bundle, {amount * count:g} "
                    f"for its {count} bundle(s), but the Ray cluster has {resources.get(name, 0):g}; start the nodes "
                    f"with --resources='{{\"{name}\": ...}}' or remove the key")


def _resolve_resume(cfg: AsyncPPOConfig, model_path: str) -> str:
    """The weights the rollout engines start from: the checkpoint's actor when resuming (checked against the
    configured model first, so a mismatch fails before any actor starts), else ``model_path``."""
    if not cfg.trainer.resume_from:
        return model_path
    from asyncppo.learner.checkpoint import CheckpointError, check_compatible, resolve_checkpoint
    from asyncppo.learner.ppo import needs_critic

    try:
        ckpt = resolve_checkpoint(cfg.trainer.resume_from)
        check_compatible(ckpt, model_path, needs_critic=needs_critic(cfg))
    except CheckpointError as exc:
        raise LaunchError(str(exc)) from None
    if ckpt.version >= cfg.trainer.total_steps:
        raise LaunchError(
            f"trainer.resume_from: the checkpoint {ckpt.path!r} is at step {ckpt.version}, but trainer.total_steps="
            f"{cfg.trainer.total_steps} is the total number of steps, so there is nothing left to train"
        )
    print(f"[asyncppo] resuming from {ckpt.path} (step {ckpt.version})", flush=True)
    return ckpt.actor_dir


def _local_ray_on_loopback(cfg: AsyncPPOConfig) -> None:
    """A local Ray cluster (no ``cluster.address``) talks over loopback only.

    Ray otherwise advertises this machine's outward-facing address for its control plane (GCS, raylet, workers) and
    connects to it even on one machine. Ray reads ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` as "single-node: use the
    loopback address" (the name is historical); it must be set before ``ray`` is imported, and the processes Ray
    starts inherit it. Joining a cluster whose address is on loopback (``cluster.address=127.0.0.1:PORT``, e.g. Ray's
    ``cluster_utils`` simulator) means every node is this machine, so the same holds; any other address leaves Ray's
    own choice alone."""
    from asyncppo.stream.security import is_loopback

    address = cfg.cluster.address
    if not address or (address != "auto" and is_loopback(address.rsplit(":", 1)[0])):
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")


def _write_report(output_dir: str) -> None:
    """The run report (report.png and one PNG per panel); a plotting problem never fails a finished run."""
    try:
        from asyncppo.report import write_report

        paths = write_report(output_dir)
        shown = paths.get("report") if isinstance(paths, dict) else None
        print(f"[asyncppo] run report: {shown or os.path.join(output_dir, 'report.png')}", flush=True)
    except Exception as exc:
        print(f"[asyncppo] warning: the run report could not be written: {exc!r}", file=sys.stderr, flush=True)


def run(cfg: AsyncPPOConfig) -> int:
    """Run a training job; returns the process exit code."""
    _local_ray_on_loopback(cfg)
    import ray

    from asyncppo.config import config_to_yaml
    from asyncppo.launch.actors import LearnerActor, RolloutActor
    from asyncppo.launch.addresses import (
        LearnerAddresses, PlacementRecord, UnreachableLearner, bundle_nodes, check_reachable,
    )
    if cfg.env.id:  # embodied run: env workers and the embodied learner (docs/embodied.md)
        from asyncppo.launch.env_actors import EnvLearnerActor as LearnerActor, EnvRolloutActor as RolloutActor
    from asyncppo.launch.console import RunConsole

    output_dir = os.path.abspath(cfg.trainer.output_dir)
    try:
        _check_output_dir(cfg, output_dir)
    except LaunchError as exc:
        print(f"[asyncppo] error: {exc}", file=sys.stderr)
        return 2
    os.makedirs(output_dir, exist_ok=True)
    with open(os.path.join(output_dir, "config.yaml"), "w", encoding="utf-8") as f:
        f.write(config_to_yaml(cfg))
    print(f"[asyncppo] run directory: {output_dir}", flush=True)
    try:
        if cfg.env.id:
            model_path = worker_model_path = _check_env(cfg)
        else:
            _check_data(cfg)
            model_path = _resolve_model(cfg)
            worker_model_path = _resolve_resume(cfg, model_path)
    except LaunchError as exc:
        print(f"[asyncppo] error: {exc}", file=sys.stderr)
        return 2

    cl = cfg.cluster
    from asyncppo.launch.plan import check_engine_fits, num_rollout_engines, rollout_bundle

    num_workers = num_rollout_engines(cfg)  # one actor per engine: rollout_gpus / (TP x PP) on GPUs (launch/plan.py)
    # Actors write their output to <run_dir>/logs/ (launch/console.py); the driver prints clean lines from there.
    init_kwargs: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    if cl.address:
        init_kwargs["address"] = cl.address
    else:
        needed = max(1, cl.train_gpus) + rollout_bundle(cfg)["CPU"] * num_workers  # the placement group's CPU bundles
        init_kwargs["num_cpus"] = max(os.cpu_count() or 1, int(math.ceil(needed)))
    init_kwargs["runtime_env"] = {"env_vars": _actor_env(cfg)}
    t0 = time.time()
    actors: list = []
    code = 1
    console = RunConsole(output_dir, cfg.trainer.total_steps, cfg.trainer.logger.log_every,
                         progress=cfg.trainer.logger.console)
    try:
        ray.init(**init_kwargs)
        _check_resources(cfg, ray.cluster_resources())
        try:  # an engine's TP x PP GPUs are one bundle, which Ray keeps on one node
            check_engine_fits(cfg, [n["Resources"].get("GPU", 0) for n in ray.nodes() if n.get("Alive")])
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        num_learners = max(1, cl.train_gpus)
        learner_bundle = {"CPU": 1.0, "GPU": 1.0} if cl.train_gpus > 0 else {"CPU": 1.0}
        worker_bundle = rollout_bundle(cfg)  # one bundle per engine with all its GPUs (TP x PP)
        # custom Ray resources pin roles to nodes (cluster.learner_resources / rollout_resources)
        learner_bundle = {**learner_bundle, **{k: float(v) for k, v in cl.learner_resources.items()}}
        worker_bundle = {**worker_bundle, **{k: float(v) for k, v in cl.rollout_resources.items()}}
        bundles = [learner_bundle] * num_learners + [worker_bundle] * num_workers
        pg = placement_group(bundles, strategy="PACK")
        if not pg.wait(timeout_seconds=60):
            raise LaunchError(f"Ray could not reserve {bundles} within 60 s: not enough free resources")
        cfg_dict = dataclasses.asdict(cfg)
        cfg_dict["trainer"]["output_dir"] = output_dir  # absolute: actors need not share the driver's cwd

        def placed(cls, index: int, bundle: dict):
            return cls.options(
                num_cpus=0.001 if not cl.address else bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=index
                ),
            )

        learners = [
            placed(LearnerActor, r, learner_bundle).remote(cfg_dict, model_path, num_workers, output_dir, r, num_learners)
            for r in range(num_learners)
        ]
        actors += learners
        learner = learners[0]
        endpoints = ray.get(learner.setup.remote(), timeout=cl.timeout_s)
        addresses = LearnerAddresses(**ray.get(learner.addresses.remote(), timeout=cl.timeout_s))
        print(f"[asyncppo] learner sockets: bind {addresses.bind}, advertise {addresses.advertise} "
              f"({addresses.reason})", flush=True)
        nodes = bundle_nodes(pg)
        roles = {f"learner-{r}": r for r in range(num_learners)}
        roles.update({f"rollout-{i}": num_learners + i for i in range(num_workers)})
        PlacementRecord(
            learner=addresses.as_dict(),
            roles={role: dataclasses.asdict(nodes[index]) for role, index in roles.items()},
            endpoints={"trajectory": endpoints.trajectory, "control": endpoints.control,
                       "admission": endpoints.admission, "eval": endpoints.eval, "sync_host": endpoints.sync_host,
                       "sync_port": endpoints.sync_port, "auth": endpoints.curve is not None},
        ).write(output_dir)
        for role, index in roles.items():  # fail now, not after cluster.timeout_s, if a role cannot reach them
            if role != "learner-0":
                check_reachable(addresses, role, nodes[index], cl.timeout_s)
        master = ray.get(learner.group_address.remote()) if num_learners > 1 else (None, None)
        # LLM runs replace a dead rollout worker (cluster.max_worker_restarts); embodied runs end on any death
        supervise = not cfg.env.id and cl.max_worker_restarts > 0
        positions = ray.get([learner.data_position.remote(i) for i in range(num_workers)], timeout=cl.timeout_s) \
            if not cfg.env.id else [None] * num_workers
        workers: dict[int, Any] = {}
        worker_refs: dict = {}

        def start_worker(i: int, generation: int, position) -> Any:
            if generation:  # a bundle whose node died may have been re-placed elsewhere
                check_reachable(addresses, f"rollout-{i}", bundle_nodes(pg)[num_learners + i], cl.timeout_s)
            extra = (generation, position) if not cfg.env.id else ()
            actor = placed(RolloutActor, num_learners + i, worker_bundle).remote(
                cfg_dict, i, num_workers, endpoints, worker_model_path, *extra)
            actors.append(actor)
            workers[i] = actor
            ref = actor.run.remote()
            worker_refs[ref] = i
            return ref

        for i in range(num_workers):
            start_worker(i, 0, positions[i])
        learner_ref = learner.run.remote(*master)
        follower_refs = [f.run.remote(*master) for f in learners[1:]]
        pending = [learner_ref, *follower_refs, *worker_refs]
        generations = {i: 0 for i in range(num_workers)}
        restarts = 0
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            console.poll()
            for ref in done:
                if ref in worker_refs:
                    i = worker_refs.pop(ref)
                    try:
                        ray.get(ref)  # a worker returns normally only when the learner told it to stop
                        continue
                    except ray.exceptions.RayError as exc:
                        if not supervise or restarts >= cl.max_worker_restarts:
                            raise WorkerFailed(
                                f"rollout worker {i} died"
                                + (f" after {restarts} restart(s), the limit (cluster.max_worker_restarts="
                                   f"{cl.max_worker_restarts})" if supervise else "") + f": an actor failed:\n{exc}"
                            ) from None
                        restarts += 1
                        generations[i] += 1
                        print(f"[asyncppo] rollout worker {i} died ({_first_line(exc)}); starting a replacement "
                              f"(restart {restarts} of at most {cl.max_worker_restarts})", file=sys.stderr, flush=True)
                        try:
                            ray.kill(workers[i])
                        except Exception:
                            pass
                        # its tickets return to the pool and the weight sync awaits the replacement, which resumes
                        # the worker's prompt sequence where the learner's record of trained draws says
                        position = ray.get(learner.replace_worker.remote(i, generations[i]), timeout=cl.timeout_s)
                        pending.append(start_worker(i, generations[i], position))
                        continue
                ray.get(ref)  # raises the actor's error (an actor that died, or an exception in it)
                if ref == learner_ref:
                    print(f"[asyncppo] learner finished in {time.time() - t0:.0f}s", flush=True)
                    # The learner published stop: give the others a moment to exit on their own.
                    if pending:
                        ray.wait(pending, num_returns=len(pending), timeout=15.0)
                    pending = []
                    code = 0
                    console.poll()
                    print(console.summary(time.time() - t0), flush=True)
                    _write_report(output_dir)
                # A worker returns normally only when the learner told it to stop: keep waiting for the learner.
        return code
    except KeyboardInterrupt:
        print("[asyncppo] interrupted: stopping every actor", file=sys.stderr, flush=True)
        return 130
    except (LaunchError, UnreachableLearner) as exc:
        print(f"[asyncppo] error: {exc}", file=sys.stderr)
        return 2
    except WorkerFailed as exc:
        console.poll()
        print(f"[asyncppo] error: {exc}\n(actor logs: {os.path.join(output_dir, 'logs')})", file=sys.stderr)
        return 1
    except ray.exceptions.RayError as exc:
        console.poll()
        print(f"[asyncppo] error: an actor failed:\n{exc}\n(actor logs: {os.path.join(output_dir, 'logs')})",
              file=sys.stderr)
        return 1
    finally:
        for actor in actors:
            try:
                ray.kill(actor)
            except Exception:
                pass
        ray.shutdown()
