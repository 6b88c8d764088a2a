"""What a user sees in the terminal during and after a run: one clean progress line per step, the warnings and errors
of every actor, and a summary table at the end.

Why the driver prints, not the actors
-------------------------------------
Ray forwards an actor's output to the driver with a ``(LearnerActor pid=...)`` prefix and colour codes, interleaved
in arrival order. Instead, every actor writes its whole output (Python and C level: vLLM, torch, gloo) to its own file
under ``<run_dir>/logs/`` (:func:`redirect_output`), Ray's forwarding is off, and the driver (:class:`RunConsole`)
follows two things in the run directory:

* ``metrics.jsonl``, which the learner flushes once per step: every new record becomes one progress line, formatted
  by the same function the learner's own console uses, so the two can never disagree;
* the actor logs: lines the project prints for people (``[asyncppo] ...``), log records at WARNING or above, and
  Python tracebacks are echoed with the actor's name; everything else (engine chatter, INFO logs) stays in the file.

The run directory is the interface, so nothing here needs Ray, and a test can drive it with files it writes itself.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from typing import IO, Optional

from asyncppo.metrics.eta import StepRate
from asyncppo.metrics.logger import format_progress

LOG_DIR = "logs"
_WARNING = re.compile(r"\b(WARNING|WARN|ERROR|CRITICAL|FATAL)\b|\bWarning:|\bError:|^\S*Error\b")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
# Warnings every CPU run prints and no user can act on; they stay in the actor's log file.
_KNOWN_NOISE = re.compile(
    r"Triton is installed, but doesn't include CPU backend"  # vLLM on a CPU build
    r"|NUMA binding: Using MEMBIND policy"  # torch CPU memory binding notice
)


def _parse(line: str) -> Optional[dict]:
    """One metrics record, or None for a blank or unreadable line."""
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def log_path(run_dir: str, role: str) -> str:
    return os.path.join(run_dir, LOG_DIR, f"{role}.log")


def redirect_output(run_dir: str, role: str) -> str:
    """Send this process's stdout and stderr (file descriptors 1 and 2, so C libraries too) to
    ``<run_dir>/logs/<role>.log``, line-buffered and appended (a restarted actor continues its file)."""
    path = log_path(run_dir, role)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = open(1, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    sys.stderr = open(2, "w", buffering=1, encoding="utf-8", errors="replace", closefd=False)
    return path


class _Tail:
    """New complete lines of a growing file (a partial last line waits for its newline)."""

    def __init__(self, path: str, offset: int = 0):
        self.path = path
        self._offset = offset
        self._partial = b""

    def lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in complete]


class RunConsole:
    """Follows a run directory and prints progress, actor warnings/errors, and (at the end) a summary table."""

    def __init__(self, run_dir: str, total_steps: Optional[int] = None, log_every: int = 1,
                 progress: bool = True, stream: Optional[IO[str]] = None, clock=None):
        self.run_dir = run_dir
        self.total_steps = total_steps
        self.log_every = max(1, int(log_every))
        self.progress = progress
        self.stream = stream or sys.stdout
        self._clock = clock or time.time
        self._t0 = self._clock()
        self._metrics = _Tail(os.path.join(run_dir, "metrics.jsonl"))
        self._logs: dict[str, _Tail] = {}
        self._in_traceback: dict[str, bool] = {}
        self.records: list[dict] = []
        self.echoed = 0
        self._rate = StepRate()
        self._skip_earlier_output()

    def _skip_earlier_output(self) -> None:
        """A run resumed in its own directory (``trainer.resume_from``) finds the earlier launch's records and logs
        there: its records still count for the summary table, but neither they nor the old log lines are printed
        again; the console shows what this launch adds."""
        for line in self._metrics.lines():
            record = _parse(line)
            if record is not None:
                self.records.append(record)
                self._rate.add(int(record.get("step", 0)), record.get("time/wall_s"))
        log_dir = os.path.join(self.run_dir, LOG_DIR)
        if os.path.isdir(log_dir):
            for name in sorted(os.listdir(log_dir)):
                if name.endswith(".log"):
                    self._logs[name] = _Tail(os.path.join(log_dir, name), os.path.getsize(os.path.join(log_dir, name)))

    def poll(self) -> None:
        """Print whatever appeared since the last call (cheap: a few file reads)."""
        for line in self._metrics.lines():
            record = _parse(line)
            if record is None:
                continue
            self.records.append(record)
            step = int(record.get("step", 0))
            self._rate.add(step, record.get("time/wall_s"))
            last = self.total_steps is not None and step == self.total_steps
            if self.progress and (step % self.log_every == 0 or last):
                self._write(format_progress(step, self.total_steps, self._clock() - self._t0, record,
                                            self._rate.eta_s(self.total_steps)))
        log_dir = os.path.join(self.run_dir, LOG_DIR)
        if os.path.isdir(log_dir):
            for name in sorted(os.listdir(log_dir)):
                if name.endswith(".log") and name not in self._logs:
                    self._logs[name] = _Tail(os.path.join(log_dir, name))
        for name, tail in self._logs.items():
            role = name[: -len(".log")]
            for line in tail.lines():
                line = _ANSI.sub("", line)
                if self._shown(role, line):
                    self._write(f"[{role}] {line}")
                    self.echoed += 1

    def _shown(self, role: str, line: str) -> bool:
        """People-facing lines, warnings/errors, and tracebacks (until the exception line that ends them)."""
        if self._in_traceback.get(role):
            if line.startswith((" ", "\t")) or not line.strip():
                return True
            self._in_traceback[role] = False
            return True  # "SomeError: message" closes the traceback
        if line.startswith("Traceback (most recent call last)"):
            self._in_traceback[role] = True
            return True
        if line.startswith("[asyncppo]"):
            return not line.startswith("[asyncppo] done:")  # the summary table says it better
        if line.startswith("step ") and " | " in line:
            return False  # the learner's own progress line: the driver prints its own from metrics.jsonl
        return bool(_WARNING.search(line)) and not _KNOWN_NOISE.search(line)

    def _write(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()

    def summary(self, wall_s: float) -> str:
        """The end-of-run table (from the records seen and ``summary.json``)."""
        summary = {}
        path = os.path.join(self.run_dir, "summary.json")
        if os.path.exists(path):
            try:
                with open(path, encoding="utf-8") as f:
                    summary = json.load(f)
            except ValueError:
                summary = {}
        return summary_table(self.records, summary, wall_s, run_dir=self.run_dir)


def _mean(values: list) -> Optional[float]:
    values = [v for v in values if isinstance(v, (int, float))]
    return sum(values) / len(values) if values else None


def _fmt(value, spec: str = "{:.3f}") -> str:
    return "-" if value is None else spec.format(value)


def summary_table(records: list[dict], summary: dict, wall_s: float, run_dir: str = "RUN_DIR") -> str:
    """Rows of ``what | value``: steps, samples, wall time, reward and eval before/after, lag, busy, engine occupancy,
    drops, rejections; then a hint when the engines ran short of tickets while the learner waited
    (:func:`lookahead_hint`).

    "Before"/"after" of the training reward average the first and last tenth of the steps (at least one step), since
    one step's reward is noisy; eval values are the first and last evaluation of each metric."""
    train = [r for r in records if "reward/mean" in r]
    rows: list[tuple[str, str]] = []
    rows.append(("steps", str(summary.get("steps", train[-1]["step"] if train else 0))))
    samples = summary.get("samples_trained", train[-1].get("samples_trained") if train else None)
    rows.append(("samples trained", _fmt(samples, "{:,}")))
    rows.append(("wall time", f"{wall_s:.0f}s"))
    if train:
        w = max(1, len(train) // 10)
        rows.append(("training reward", f"{_fmt(_mean([r['reward/mean'] for r in train[:w]]))} (first {w} steps) -> "
                                        f"{_fmt(_mean([r['reward/mean'] for r in train[-w:]]))} (last {w})"))
    eval_keys = sorted({k for r in records for k in r if k.startswith("eval/") and isinstance(r[k], (int, float))})
    for key in eval_keys:
        if key in ("eval/version_min", "eval/version_max", "eval/workers") or key.endswith("/num_prompts"):
            continue  # bookkeeping of engine evaluation, not a score
        values = [r[key] for r in records if isinstance(r.get(key), (int, float))]
        rows.append((key, f"{_fmt(values[0])} -> {_fmt(values[-1])}"))
    if train:
        rows.append(("lag (mean / max)", f"{_fmt(_mean([r.get('staleness/mean') for r in train]), '{:.2f}')} / "
                                         f"{_fmt(max((r.get('staleness/max', 0) for r in train), default=None), '{:.0f}')}"))
        rows.append(("busy (rollout / train)",
                     f"{_fmt(_mean([r.get('util/rollout_busy') for r in train]), '{:.2f}')} / "
                     f"{_fmt(_mean([r.get('util/train_busy') for r in train]), '{:.2f}')}"))
    window = window_row(train)
    if window:
        rows.append(window)
    rollout = summary.get("rollout") if isinstance(summary.get("rollout"), dict) else {}
    if isinstance(rollout.get("occupancy_steady"), (int, float)):
        rows.append(("engine occupancy (without the last step / all)",
                     f"{rollout['occupancy_steady']:.2f} / {_fmt(rollout.get('occupancy'), '{:.2f}')}"))
    buffer = summary.get("buffer") or {}
    rows.append(("groups dropped (stale)", str(buffer.get("dropped_stale", train[-1].get("buffer/dropped_stale", 0)
                                                           if train else 0))))
    rejected = summary.get("rejected") or {}
    rejected_total = sum(v for v in rejected.values() if isinstance(v, (int, float)))
    detail = ", ".join(f"{k} {v}" for k, v in sorted(rejected.items()) if v)
    rows.append(("messages rejected", f"{rejected_total}" + (f" ({detail})" if detail else "")))
    if summary.get("checkpoint_failures"):
        rows.append(("checkpoints not written", f"{summary['checkpoint_failures']} (the warnings above say why)"))
    width = max(len(k) for k, _ in rows)
    lines = ["run summary", "-" * (width + 30)]
    lines += [f"{k.ljust(width)} | {v}" for k, v in rows]
    hint = lookahead_hint(train, rollout, run_dir)
    return "\n".join(lines + ([hint] if hint else []))


def window_row(train: list[dict]) -> Optional[tuple[str, str]]:
    """Under ``rollout.max_staleness=auto``: the range the window took (``tune/k``, ``tune/j`` of every step) and
    how many times it moved, so a reader sees at once whether the tuner settled or wandered."""
    ks = [r["tune/k"] for r in train if isinstance(r.get("tune/k"), int)]
    js = [r["tune/j"] for r in train if isinstance(r.get("tune/j"), int)]
    if not ks:
        return None
    moves = sum(1 for r in train if r.get("tune/reason"))
    return ("window k / j (auto: first -> last, range)",
            f"k {ks[0]} -> {ks[-1]} ({min(ks)}..{max(ks)}), j {js[0]} -> {js[-1]} ({min(js)}..{max(js)}); "
            f"{moves} change{'s' if moves != 1 else ''}")


def lookahead_hint(train: list[dict], rollout: dict, run_dir: str) -> Optional[str]:
    """A pointer to the advisor when the run lost engine time for want of tickets while its learner waited.

    On long-tailed groups a group keeps its ticket until its last sample ends, so the admission window runs the
    engines part-empty (docs/staleness.md, "Choosing j"); if the learner also waited, the engines were the slower
    side and more of the window would have sped the run up. Thresholds: engines below 0.85 full outside the run's
    drain, more than a tenth of their stepping time as free slots without a ticket, learner busy below 0.85.

    In a multi-turn run whose episodes spent more of the steady steps at their environment than in the engines, the
    tickets are held by episodes waiting on a tool, not by stragglers: see :func:`window_hint`."""
    busy = _mean([r.get("util/train_busy") for r in train])
    steady = train[len(train) // 4:]
    at_env = _mean([r.get("episodes/at_env_mean") for r in steady])
    in_engine = _mean([r.get("episodes/in_engine_mean") for r in steady])
    if at_env is not None and in_engine is not None and at_env > in_engine:
        return window_hint(steady, busy, at_env, in_engine, run_dir)
    occupancy, unfilled = rollout.get("occupancy_steady"), rollout.get("unfilled_ticket_s")
    stepping = rollout.get("engine_step_s")
    if not all(isinstance(x, (int, float)) for x in (occupancy, unfilled, stepping, busy)) or stepping <= 0:
        return None
    if occupancy >= 0.85 or unfilled < 0.1 * stepping or busy >= 0.85:
        return None
    lead = (f"hint: the engines ran {occupancy:.2f} full for want of tickets ({unfilled:.0f} engine-s of free slots) "
            f"while the learner waited {1 - busy:.0%} of its time")
    return lead + (_auto_advice(train) or (
        f": `asyncppo advise {run_dir} --gpus N --lookahead 1,2,3,4 --staleness K,...` predicts what a wider "
        "rollout.admission_lookahead (and the max_staleness its stragglers need) would buy (docs/advisor.md)"))


def _auto_advice(train: list[dict]) -> Optional[str]:
    """The advice of a hint for a run whose window was auto (its records carry ``tune/k``): the tuner set the
    window, so the knobs to look at are its limits, not a number to pick; None for a fixed window."""
    ks = [r["tune/k"] for r in train if isinstance(r.get("tune/k"), int)]
    js = [r["tune/j"] for r in train if isinstance(r.get("tune/j"), int)]
    if not ks or not js:
        return None
    return (f", under an auto window that ended at k = {ks[-1]}, j = {js[-1]} (widest k {max(ks)}): it goes no wider "
            "than rollout.max_staleness_cap (or a pinned rollout.max_staleness) and algorithm.offpolicy_budget "
            "allow, and moves only where its model predicts a gain (`tune/gain_up` in metrics.jsonl; "
            "docs/staleness.md, \"A window that moves\")")


def window_hint(steady: list[dict], busy: Optional[float], at_env: float, in_engine: float,
                run_dir: str) -> Optional[str]:
    """The hint for a multi-turn run whose engines sat empty with every episode at its environment (the window,
    ``(j + 1) x B`` groups, held too few episodes to cover the tool's time) while the learner waited: a tenth of
    the steady steps' time or more, learner busy below 0.85. Not the engines' occupancy: a sequence leaves the
    engine at every turn, so a window wide enough to keep the engines busy still reads ~0.8 full behind a 200 ms
    tool (docs/benchmarks.md, "Behind a slow tool: multi-turn episodes"), while a too narrow one leaves them empty
    14-19% of the time."""
    wall = sum(r["time/step_s"] for r in steady if isinstance(r.get("time/step_s"), (int, float)))
    empty = sum(r["episodes/env_wait_s"] for r in steady if isinstance(r.get("episodes/env_wait_s"), (int, float)))
    if busy is None or wall <= 0 or empty < 0.1 * wall or busy >= 0.85:
        return None
    lead = (f"hint: the engines sat empty {empty / wall:.0%} of the time with every episode at its environment "
            f"while the learner waited {1 - busy:.0%} of its time (~{at_env:.0f} episodes at their environment "
            f"against ~{in_engine:.0f} in the engines)")
    return lead + (_auto_advice(steady) or (
            ": the staleness window ((j + 1) x B groups) must hold the "
            "episodes waiting on their tools as well as those decoding, so a wider rollout.max_staleness (the "
            "lookahead follows it unless set) keeps the engines fuller, at the cost of more lag; `asyncppo advise "
            f"{run_dir} --gpus N --staleness K,...` predicts what each would buy (docs/environments.md, "
            "\"Behind a slow tool: the window\")"))
