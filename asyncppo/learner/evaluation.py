"""The learner's end of the run's held-out evaluation: the built-in task's probe and ``data.eval_files`` (the
workers run both on their engines: rollout/evaluation.py). The learner generates nothing itself.

The learner never waits for an evaluation during training: each step it takes whatever reports arrived, adds the
workers' shards of each evaluation point, and logs a point as one metrics record at ``step = point`` once every
worker has reported it. Only the final point is waited for, after the last step, with ``cluster.timeout_s`` as the
deadline; a point some worker never reported is logged from the workers that did (``eval/workers`` says how many).
"""

from __future__ import annotations

import logging
import time
from typing import Iterable, Optional

from asyncppo.stream.evals import EvalAggregator, EvalReceiver

log = logging.getLogger("asyncppo.learner")

# the probe's numbers in summary.json's eval_before/after (success_*: a multi-turn task's episodes only)
TASK_SCORES = ("accuracy_sampled", "accuracy_greedy", "success_sampled", "success_greedy")


class EngineEvaluation:
    """``points``: the run's evaluation schedule (the workers' ``eval_points``, handed in by the launcher, which
    knows both sides); a report of any other point is refused. None takes any point up to the learner's version."""

    def __init__(self, bind_address: str, num_workers: int, curve=None, points: Optional[Iterable[int]] = None):
        self.receiver = EvalReceiver(bind_address, num_workers, curve=curve)
        self.aggregator = EvalAggregator(num_workers)
        self.address = self.receiver.address
        self.points = None if points is None else frozenset(points)
        self.logged: dict[int, dict] = {}

    def poll(self, logger, timeout_s: float = 0.0, version: Optional[int] = None) -> None:
        """Log every point that is complete now. ``version``: the learner's; a report of a point or weights past
        it, of a point already logged, or of a point not in the schedule cannot be a worker's and is refused
        (counted with the receiver's refusals): unchecked, a peer's report of point 2**40 opened a round that was
        never closed, one of a logged point logged it again, and one of point 7 with ``eval_every=100`` was logged
        (with several workers, its round stayed open until the run ended)."""
        for report in self.receiver.poll(timeout_s):
            past = version is not None and max(report.point, report.version_max) > version
            unscheduled = self.points is not None and report.point not in self.points
            if report.point in self.logged or past or unscheduled:
                self.receiver.rejected += 1
                self.receiver.last_error = (f"report of point {report.point} (weights {report.version_max}) from "
                                            f"worker {report.worker_id}: logged already, past version {version} "
                                            f"or not an evaluation point")
                continue
            done = self.aggregator.add(report)
            if done is not None:
                self._log(logger, *done)

    def _log(self, logger, point: int, metrics: dict) -> None:
        self.logged[point] = metrics
        logger.log(point, metrics)

    def finish(self, logger, final_point: int, timeout_s: float) -> Optional[dict]:
        """Wait for the final point's reports (the workers evaluate the final weights), then log every point still
        open from what arrived. Returns the final point's metrics."""
        deadline = time.monotonic() + timeout_s
        while final_point not in self.logged and time.monotonic() < deadline:
            self.poll(logger, timeout_s=min(1.0, max(0.0, deadline - time.monotonic())), version=final_point)
        for point in self.aggregator.pending():
            metrics = self.aggregator.finish(point)
            log.warning("evaluation point %d: only %d of %d worker(s) reported before the deadline", point,
                        int(metrics.get("eval/workers", 0)), self.aggregator.num_workers)
            self._log(logger, point, metrics)
        if final_point not in self.logged:
            log.warning("evaluation of the final weights (point %d) did not arrive within %.0fs", final_point,
                        timeout_s)
        return self.logged.get(final_point)

    def task_before_after(self, with_before: bool = True) -> dict:
        """``eval_before`` / ``eval_after`` of summary.json: the task probe's scores at the first and the last
        logged point (``{"accuracy_sampled", "accuracy_greedy"}`` each, as the learner's evaluation gave them).
        ``with_before=False`` (a run without the point-0 round, ``trainer.eval_at_start=false``): the last only, so
        an evaluation of trained weights is never reported as the "before"."""
        scores = [{k: m[f"eval/{k}"] for k in TASK_SCORES if f"eval/{k}" in m}
                  for _, m in sorted(self.logged.items())]
        scores = [s for s in scores if s]
        if not scores:
            return {}
        return {"eval_before": scores[0], "eval_after": scores[-1]} if with_before else {"eval_after": scores[-1]}

    def summary(self) -> dict:
        points = sorted(self.logged)
        out = {"points": points, "rejected": self.receiver.rejected, "duplicates": self.aggregator.duplicates}
        if points:
            out["first"] = self.logged[points[0]]
            out["last"] = self.logged[points[-1]]
        return out

    def close(self) -> None:
        self.receiver.close()
