"""Evaluation reports: a rollout worker's scores on its shard of the run's held-out sets, sent to the learner.

A set is named by its eval file (metrics ``eval/<file>/<metric>``) or is the run's own held-out split,
:data:`TASK_SET`, whose metrics keep the names they always had (``eval/<metric>``).

Why a channel of its own
------------------------
Evaluation results are a few hundred bytes per worker and round, and nothing about them is a trajectory: they carry
no tokens, no ticket and no staleness. A separate PUSH/PULL pair keeps the trajectory stream's record type single
and lets this one have a tight size limit (64 KiB) and a strict schema. Like every message on a socket, a report is
msgpack (never pickle) and is validated in full before the learner uses it; a bad one is counted and dropped.

A report holds *sums*, not means, so the learner can add the shards of several workers exactly: the accuracy of a
file is ``sum(correct) / sum(prompts)`` over workers, whatever the shard sizes.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import zmq

from asyncppo.stream.endpoints import bind_socket
from asyncppo.stream.errors import WireError
from asyncppo.stream.framing import pack, unpack
from asyncppo.stream.security import CurveKeys, ServerSecurity, apply_client

KIND = "asyncppo-eval"
MAX_REPORT_BYTES = 64 << 10
MAX_FILES = 64
MAX_NAME = 200
_STAT_KEYS = {  # name -> type of every per-file sum
    "prompts": int,  # prompts evaluated (one greedy answer each)
    "greedy_reward": float,  # sum of the greedy answers' rewards
    "sampled": int,  # sampled answers (eval_samples per prompt)
    "sampled_reward": float,  # sum of their rewards
    "tokens": int,  # response tokens over greedy and sampled answers
    "answers": int,  # answers counted in tokens (prompts + sampled)
    "episodes": int,  # answers that were whole episodes (a multi-turn set: 0 or answers)
    "greedy_success": int,  # greedy episodes whose reward is positive (the task solved)
    "sampled_success": int,  # sampled episodes whose reward is positive
}
_MAX_VERSION = 1 << 40
TASK_SET = "<task>"  # the built-in task's held-out split: logged without a file name (eval/accuracy_greedy, ...)


class EvalReportError(ValueError):
    """A message on the evaluation channel that is not a valid report."""


@dataclass
class FileScores:
    prompts: int = 0
    greedy_reward: float = 0.0
    sampled: int = 0
    sampled_reward: float = 0.0
    tokens: int = 0
    answers: int = 0
    episodes: int = 0
    greedy_success: int = 0
    sampled_success: int = 0

    def add(self, other: "FileScores") -> None:
        for key in _STAT_KEYS:
            setattr(self, key, getattr(self, key) + getattr(other, key))

    def metrics(self) -> dict[str, float]:
        out = {"num_prompts": float(self.prompts)}
        if self.prompts:
            out["accuracy_greedy"] = self.greedy_reward / self.prompts
        if self.sampled:
            out["accuracy_sampled"] = self.sampled_reward / self.sampled
        if self.answers:
            out["length_mean"] = self.tokens / self.answers
        if self.episodes:  # a multi-turn set: the share of episodes that solved their task (reward > 0)
            if self.prompts:
                out["success_greedy"] = self.greedy_success / self.prompts
            if self.sampled:
                out["success_sampled"] = self.sampled_success / self.sampled
        return out


@dataclass
class EvalReport:
    """One worker's scores for one evaluation round.

    ``point`` is the evaluation point the round stands for (0, ``eval_every``, 2 x ``eval_every``, ...,
    ``total_steps``); ``version_min``/``version_max`` are the weight versions that actually produced the answers
    (a worker evaluates with the first weights it holds at or after the point; a push during the round can make
    ``version_max`` larger)."""

    point: int
    worker_id: int
    version_min: int
    version_max: int
    files: dict[str, FileScores] = field(default_factory=dict)


def encode_report(report: EvalReport) -> bytes:
    return pack({
        "kind": KIND, "point": report.point, "worker_id": report.worker_id, "version_min": report.version_min,
        "version_max": report.version_max,
        "files": {name: {k: getattr(s, k) for k in _STAT_KEYS} for name, s in report.files.items()},
    })


def _int(value, what: str, hi: int = _MAX_VERSION) -> int:
    if type(value) is not int or not 0 <= value <= hi:
        raise EvalReportError(f"{what} must be an int in [0, {hi}], got {value!r}")
    return value


def decode_report(frame: bytes, max_bytes: int = MAX_REPORT_BYTES, num_workers: Optional[int] = None) -> EvalReport:
    """Parse and check a report: exact keys and types, non-negative finite sums, rewards consistent with counts."""
    if len(frame) > max_bytes:
        raise EvalReportError(f"{len(frame)} bytes, over the {max_bytes}-byte limit")
    try:
        msg = unpack(frame, "evaluation report")
    except WireError as exc:
        raise EvalReportError(f"not msgpack: {type(exc.__cause__).__name__}") from None
    if type(msg) is not dict or msg.get("kind") != KIND:
        raise EvalReportError("not an evaluation report")
    if set(msg) != {"kind", "point", "worker_id", "version_min", "version_max", "files"}:
        raise EvalReportError(f"unexpected keys {sorted(map(str, msg))}")
    worker_hi = (num_workers - 1) if num_workers else 1 << 16
    report = EvalReport(point=_int(msg["point"], "point"), worker_id=_int(msg["worker_id"], "worker_id", worker_hi),
                        version_min=_int(msg["version_min"], "version_min"),
                        version_max=_int(msg["version_max"], "version_max"))
    if report.version_min > report.version_max:
        raise EvalReportError("version_min > version_max")
    files = msg["files"]
    if type(files) is not dict or len(files) > MAX_FILES:
        raise EvalReportError(f"files must be a map of at most {MAX_FILES} entries")
    for name, stats in files.items():
        if type(name) is not str or not 0 < len(name) <= MAX_NAME or type(stats) is not dict \
                or set(stats) != set(_STAT_KEYS):
            raise EvalReportError(f"file entry {str(name)[:40]!r} malformed")
        values = {}
        for key, tp in _STAT_KEYS.items():
            v = stats[key]
            if tp is float and type(v) is int:
                v = float(v)
            if type(v) is not tp or (tp is float and not math.isfinite(v)) or v < 0 or v > 1e15:
                raise EvalReportError(f"{name}.{key}={v!r} is not a non-negative finite {tp.__name__}")
            values[key] = v
        scores = FileScores(**values)
        if scores.answers != scores.prompts + scores.sampled:
            raise EvalReportError(f"{name}: answers != prompts + sampled")
        if scores.episodes > scores.answers or scores.greedy_success > scores.prompts \
                or scores.sampled_success > scores.sampled:
            raise EvalReportError(f"{name}: more episodes or successes than answers")
        report.files[name] = scores
    return report


class EvalSender:
    """Worker side (PUSH, connects)."""

    def __init__(self, address: str, context: Optional[zmq.Context] = None, curve: Optional[CurveKeys] = None):
        self._sock = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.SNDHWM, 16)
        apply_client(self._sock, curve)
        self._sock.connect(address)

    def send(self, report: EvalReport, timeout_s: float = 5.0) -> bool:
        frame = encode_report(report)
        if len(frame) > MAX_REPORT_BYTES:
            raise EvalReportError(f"report of {len(frame)} bytes is over {MAX_REPORT_BYTES}: too many eval files?")
        self._sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        try:
            self._sock.send(frame)
        except zmq.Again:
            return False
        return True

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close()


class EvalReceiver:
    """Learner side (PULL, binds). :meth:`poll` returns the valid reports waiting; bad ones are counted."""

    def __init__(self, bind_address: str, num_workers: int, context: Optional[zmq.Context] = None,
                 curve: Optional[CurveKeys] = None):
        self.num_workers = num_workers
        self._sock = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._security = ServerSecurity(curve)  # the run's CURVE keys when the learner authenticates peers
        self._security.apply(self._sock)
        # libzmq drops the *connection* of a peer over MAXMSGSIZE without telling us: keep it well above the counted
        # limit, so an oversized report is seen, counted and refused, while a flood still cannot exhaust memory
        self._sock.setsockopt(zmq.MAXMSGSIZE, 16 * MAX_REPORT_BYTES)
        self.address = bind_socket(self._sock, bind_address)
        self.rejected = 0
        self.last_error: Optional[str] = None

    def poll(self, timeout_s: float = 0.0) -> list[EvalReport]:
        out: list[EvalReport] = []
        deadline = time.monotonic() + timeout_s
        while True:
            wait_ms = 0 if out else max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sock.poll(wait_ms, zmq.POLLIN):
                return out
            frame = self._sock.recv()
            try:
                out.append(decode_report(frame, num_workers=self.num_workers))
            except EvalReportError as exc:
                self.rejected += 1
                self.last_error = str(exc)

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close()
            self._security.release()


class EvalAggregator:
    """Adds the workers' reports for each evaluation point; a point is complete when every worker has reported
    (one report per worker and point: a repeat is ignored)."""

    def __init__(self, num_workers: int):
        self.num_workers = num_workers
        self._rounds: dict[int, dict[int, EvalReport]] = {}
        self.duplicates = 0

    def add(self, report: EvalReport) -> Optional[tuple[int, dict[str, float]]]:
        """Returns ``(point, metrics)`` when this report completes its point, else None."""
        reports = self._rounds.setdefault(report.point, {})
        if report.worker_id in reports:
            self.duplicates += 1
            return None
        reports[report.worker_id] = report
        if len(reports) < self.num_workers:
            return None
        return report.point, self.finish(report.point)

    def finish(self, point: int) -> dict[str, float]:
        """Metrics from whatever arrived for ``point`` (all workers, or fewer when the run ends waiting)."""
        reports = self._rounds.pop(point, {})
        totals: dict[str, FileScores] = {}
        for rep in reports.values():
            for name, scores in rep.files.items():
                totals.setdefault(name, FileScores()).add(scores)
        metrics: dict[str, float] = {}
        for name, scores in totals.items():
            prefix = "eval/" if name == TASK_SET else f"eval/{name}/"
            metrics.update({prefix + k: v for k, v in scores.metrics().items()})
        if reports:
            metrics["eval/version_min"] = float(min(r.version_min for r in reports.values()))
            metrics["eval/version_max"] = float(max(r.version_max for r in reports.values()))
            metrics["eval/workers"] = float(len(reports))
        return metrics

    def pending(self) -> list[int]:
        return sorted(self._rounds)
