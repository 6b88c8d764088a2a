"""Launch a run: config -> resolved plan -> actors started -> supervision, top to bottom.

* :func:`asyncppo.launch.resolve.resolve_plan` makes every check that needs no cluster and fixes every fact the
  launch acts on (a refusal exits 2 before anything starts);
* the run directory gets the config; Ray starts, and :func:`~asyncppo.launch.resolve.check_cluster` checks what it
  offers against the plan;
* :class:`~asyncppo.launch.start.RunActors` places and starts the learner and the rollout workers;
* :class:`~asyncppo.launch.supervise.Supervisor` waits for the learner to finish, replacing dead rollout workers.

Ctrl-C, ``kill`` (SIGTERM), an error or a normal end all go through ``ray.shutdown()`` (which also stops a local Ray
cluster's processes), so nothing is left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from asyncppo.config import config_to_yaml
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.addresses import UnreachableLearner
from asyncppo.launch.console import RunConsole
from asyncppo.launch.resolve import LaunchError, LaunchPlan, check_cluster, resolve_plan
from asyncppo.learner.run_files import step_of


def _refuse(exc: BaseException) -> int:
    print(f"[asyncppo] error: {exc}", file=sys.stderr)
    return 2


def _open_run_dir(plan: LaunchPlan, cfg: AsyncPPOConfig) -> None:
    """The run directory with the config it runs, announced (and the checkpoint it resumes from)."""
    os.makedirs(plan.output_dir, exist_ok=True)
    with open(os.path.join(plan.output_dir, "config.yaml"), "w", encoding="utf-8") as f:
        f.write(config_to_yaml(cfg))
    print(f"[asyncppo] run directory: {plan.output_dir}", flush=True)
    if plan.resume_note:
        print(f"[asyncppo] {plan.resume_note}", flush=True)
    if plan.disk_warning:
        print(f"[asyncppo] {plan.disk_warning}", flush=True)


def _terminate_as_interrupt() -> None:
    """SIGTERM (``kill``, a batch scheduler's cancel) stops the run like Ctrl-C: actors killed, Ray shut down. Left to
    its default (or Ray's, which aborts), SIGTERM ends the driver at once and leaves a local Ray cluster's processes
    running."""
    def _raise(signum, frame):
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():  # signal handlers can only be set there
        signal.signal(signal.SIGTERM, _raise)


def _stop_gracefully(supervisor, cfg: AsyncPPOConfig, output_dir: str) -> bool:
    """A run interrupted while training keeps its steps: the learner checkpoints before the actors stop
    (``cluster.stop_grace_s``; none under ``trainer.save_every=0``), and the console says how to continue.
    True when the learner had finished the run meanwhile (its last step was trained before the interrupt)."""
    if supervisor is None or not cfg.trainer.save_every:
        return False
    try:
        summary = supervisor.stop_gracefully(cfg.cluster.stop_grace_s)
    except KeyboardInterrupt:  # a second interrupt between two of its own checks
        return False
    if summary is None:
        return False
    if "stopped_at" not in summary:
        print("[asyncppo] the run had trained its last step: it finished (final evaluation and model written)",
              file=sys.stderr, flush=True)
        return True
    step, latest = summary["stopped_at"], summary.get("checkpoint")
    if latest:
        saved = step_of(latest)
        behind = step - saved if saved is not None else 0
        lost = f" (its checkpoint failed: the {behind} step(s) after {latest} will be trained again)" if behind else ""
        print(f"[asyncppo] stopped at step {step} with checkpoint {latest}{lost}; continue with the same command and "
              f"trainer.resume_from={output_dir}", file=sys.stderr, flush=True)
    return False


def run(cfg: AsyncPPOConfig) -> int:
    """Run a training job; returns the process exit code (0 done, 1 an actor failed, 2 refused, 130 interrupted)."""
    try:
        plan = resolve_plan(cfg)
    except LaunchError as exc:
        return _refuse(exc)
    _open_run_dir(plan, cfg)
    if plan.ray_on_loopback:  # Ray's name (historical) for "single-node: use the loopback address"; read at import
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    # Ray is imported only now, so that the setting above is in place (the processes Ray starts inherit it);
    # start.py and supervise.py import ray at their top, so they wait too.
    import ray  # heavy: ray

    from asyncppo.launch.start import RunActors, alive_node_gpus  # heavy: ray
    from asyncppo.launch.supervise import Supervisor, WorkerFailed, report_failure  # heavy: ray

    actors = RunActors(plan, cfg)
    console = RunConsole(plan.output_dir, cfg.trainer.total_steps, cfg.trainer.logger.log_every,
                         progress=cfg.trainer.logger.console)
    started_at = time.time()
    supervisor = None
    try:
        ray.init(**plan.ray_init)
        _terminate_as_interrupt()  # after ray.init, whose core worker installs a SIGTERM handler that aborts
        check_cluster(cfg, ray.cluster_resources(), alive_node_gpus())
        learner_ref, pending = actors.start()
        supervisor = Supervisor(actors, console, started_at)
        return supervisor.watch(learner_ref, pending)
    except KeyboardInterrupt:
        finished = _stop_gracefully(supervisor, cfg, plan.output_dir)
        print("[asyncppo] interrupted: stopping every actor", file=sys.stderr, flush=True)
        return 0 if finished else 130
    except (LaunchError, UnreachableLearner) as exc:
        return _refuse(exc)
    except (WorkerFailed, ray.exceptions.RayError) as exc:
        return report_failure(exc, console, plan.output_dir)
    finally:
        actors.stop_all()
        ray.shutdown()
        if supervisor is not None:
            supervisor.wait_report()
