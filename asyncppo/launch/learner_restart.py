"""A learner that died comes back by itself: restarted from the latest checkpoint while the rollout workers stay up.

What happens when learner rank 0's process dies (``trainer.auto_resume``, up to ``trainer.max_learner_restarts``):

1. every learner rank is killed (the others cannot train without rank 0) and started again in its own placement
   bundle with ``trainer.resume_from`` set to the run directory: the new learner loads the latest checkpoint
   (learner/checkpoint.py, or learner/embodied_checkpoint.py) and its data position, and binds new sockets, a new
   admission controller counting tickets from the checkpoint's version, and a new weight-sync store;
2. every live worker is handed the new addresses and the data position of its prompt sequence in the checkpoint
   (``reconnect``): it aborts its groups in flight, forgets its tickets, joins a new two-rank weight-sync group and
   draws again from the lowest draw the checkpoint has not trained, skipping the ones it has. A group the dead
   learner accepted, or even trained after the checkpoint, is drawn again; one the checkpoint trained never is;
3. the new learner pushes the checkpoint's weights before serving any ticket (the engines may hold newer ones that
   it never trained from), then trains on from the checkpoint's version + 1 to ``trainer.total_steps``.

The steps the dead learner trained after its last checkpoint are lost: ``learner/steps_lost`` counts them (over the
run), ``learner/restarts`` the restarts; both are in every metrics record of the new learner. Without a checkpoint
yet, the new learner starts over from version 0 and every worker from its first draw. Why new addresses instead of
the old ports: a port the dead process held may be taken in between, and old messages on a reused address would
reach the new learner; the launcher already knows every worker, so handing them the new endpoints is simple.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from typing import Any

import ray

from asyncppo.launch.start import RunActors
from asyncppo.report.runs import surviving_steps


def last_logged_step(output_dir: str) -> int:
    """The newest step the dead learner reached: the last training record in ``metrics.jsonl`` once the records an
    earlier dead learner logged past its own checkpoint are dropped (``report.runs.surviving_steps``), so that a
    second death is not credited with the first one's higher steps."""
    records = []
    try:
        with open(os.path.join(output_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:  # a line cut short by the death
                    continue
                if isinstance(record.get("step"), int) and "staleness/max" in record:  # a training step's record
                    records.append(record)
    except FileNotFoundError:
        pass
    kept = surviving_steps(records)
    return kept[-1]["step"] if kept else 0


def has_checkpoint(output_dir: str) -> bool:
    root = os.path.join(output_dir, "checkpoints")
    return os.path.isdir(root) and any(e.startswith("step_") for e in os.listdir(root))


class LearnerRestarter:
    """Owns the learner restart count; :meth:`restart` does steps 1-3 of the module docstring."""

    def __init__(self, run: RunActors):
        self.run = run
        self.limit = getattr(run.plan, "max_learner_restarts", 0)  # a plan without it restarts nothing
        self.restarts = 0
        self.steps_lost = 0

    def may_restart(self, exc: BaseException) -> bool:
        """The learner's process died (not an error it raised, which a restart would only repeat)."""
        return isinstance(exc, ray.exceptions.RayActorError) and self.restarts < self.limit

    def restart(self, exc: BaseException, incarnations: dict[int, int]) -> tuple[Any, list]:
        """Restart the learner ranks and reconnect the live workers (each in its current incarnation, which names
        its weight-sync group); returns rank 0's run() ref and every rank's."""
        run, plan = self.run, self.run.plan
        self.restarts += 1
        done = last_logged_step(plan.output_dir)
        cfg_dict = copy.deepcopy(run.cfg_dict)
        resumable = has_checkpoint(plan.output_dir)
        if resumable:
            cfg_dict["trainer"]["resume_from"] = plan.output_dir
        first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        print(f"[asyncppo] learner died after step {done} ({first}); restarting it from "
              + ("the latest checkpoint" if resumable else "the start (no checkpoint yet)")
              + f" (restart {self.restarts} of at most {self.limit})", file=sys.stderr, flush=True)
        run.kill_learners()
        run.start_learners(cfg_dict)
        version, self.steps_lost = ray.get(run.learner.note_restart.remote(
            self.restarts, done, self.steps_lost, incarnations), timeout=plan.timeout_s)
        for i, worker in list(run.workers.items()):
            if i not in run.worker_refs.values():
                continue  # dead and awaiting its replacement (launch/supervise.py starts it)
            position = ray.get(run.learner.data_position.remote(i), timeout=plan.timeout_s)
            ray.get(worker.reconnect.remote(run.endpoints, position), timeout=plan.timeout_s)
        master = ray.get(run.learner.group_address.remote()) if plan.num_learners > 1 else (None, None)
        learner_ref = run.learner.run.remote(*master)
        refs = [learner_ref] + [f.run.remote(*master) for f in run.learners[1:]]
        print(f"[asyncppo] learner restarted at step {version} ({done - version} step(s) since the checkpoint "
              f"lost, {self.steps_lost} in the run); {len(run.worker_refs)} worker(s) reconnecting",
              file=sys.stderr, flush=True)
        return learner_ref, refs

    def refuse(self, exc: BaseException) -> None:
        """Say why a dead learner is not restarted (the error itself follows from the supervisor)."""
        if isinstance(exc, ray.exceptions.RayActorError) and self.limit:
            print(f"[asyncppo] the learner died again after {self.restarts} restart(s), the limit "
                  f"(trainer.max_learner_restarts={self.limit})", file=sys.stderr, flush=True)


__all__ = ["LearnerRestarter", "last_logged_step", "has_checkpoint"]
