"""Watch a started run until the learner finishes: progress on the console, dead rollout workers replaced, the end.

The learner finishing ends the run (the summary table and the run report follow). A rollout worker that dies, or
that hangs (launch/hang.py: no progress and no answer for ``cluster.hang_timeout_s``; killed through Ray first), is
replaced, up to ``cluster.max_worker_restarts`` times within ``cluster.worker_restart_window_s`` (an hour by default;
launch/restart_budget.py says why a window): the learner first takes back its tickets and
awaits the replacement in the weight sync (``LearnerWiring.replace_worker``), then a new actor of the next
incarnation starts in the same placement bundle, resuming the worker's prompt sequence. Any other actor dying, or
one worker death too many, ends the run with the actor's error (:func:`report_failure` words it).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any, Optional

import ray

from asyncppo.launch.console import RunConsole
from asyncppo.launch.learner_restart import LearnerRestarter
from asyncppo.config.deadlines import SILENT_S
from asyncppo.launch.hang import HangWatch, Verdict
from asyncppo.launch.restart_budget import RestartBudget
from asyncppo.launch.start import RunActors
from asyncppo.learner.run_files import latest_name

# Seconds the other actors get to exit on their own once the learner has published stop.
STOP_GRACE_S = 15.0


class WorkerFailed(RuntimeError):
    """A rollout worker died (or hung) and may not be replaced (restarts used up, or replacement switched off)."""


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return lines[0][:200] if lines else type(exc).__name__


class Supervisor:
    """Waits on every actor's run() of a started run; owns the restart count and each worker's incarnation."""

    def __init__(self, run: RunActors, console: RunConsole, started_at: float):
        self.run, self.console, self.started_at = run, console, started_at
        # cluster.max_worker_restarts within any cluster.worker_restart_window_s (launch/restart_budget.py)
        self.budget = RestartBudget(run.plan.max_worker_restarts, run.plan.worker_restart_window_s)
        self.incarnations = {i: 0 for i in range(run.plan.num_workers)}
        self.learner_restarts = LearnerRestarter(run)  # a dead learner comes back (launch/learner_restart.py)
        self.orphans: list[int] = []  # workers that died while the learner was dead: replaced once it is back
        self.report: Optional[threading.Thread] = None  # drawn while the actors and Ray shut down (wait_report)
        self.learner_ref: Any = None  # rank 0's run() of the learner now running (a restart replaces it)
        self.hang_verdicts = 0  # every worker found hung, each a line of hangs.jsonl (_record_hang)
        cl = run.cfg_dict["cluster"]
        self.hangs = HangWatch(  # LLM rollout workers and embodied env workers alike answer its pings
            lambda: dict(run.workers), self.incarnations, run.learner, cl.get("hang_timeout_s"), run.plan.timeout_s,
            silent_timeout_s=cl.get("silent_timeout_s", SILENT_S))

    def watch(self, learner_ref: Any, pending: list) -> int:
        """Until the learner's run() returns (exit code 0) or an actor's error is raised."""
        learner_refs = [r for r in pending if r not in self.run.worker_refs]
        self.learner_ref = learner_ref
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            self.console.poll()
            pending = self._replace_hung(pending)
            for ref in done:
                if ref in self.run.worker_refs:
                    replacement = self._worker_ended(ref)
                    if replacement is not None:
                        pending.append(replacement)
                    continue
                if ref not in learner_refs:
                    continue  # a rank of a learner that was restarted
                try:
                    ray.get(ref)  # raises the actor's error (an actor that died, or an exception in it)
                except ray.exceptions.RayError as exc:
                    if not self.learner_restarts.may_restart(exc):
                        self.learner_restarts.refuse(exc)
                        raise
                    learner_ref, learner_refs = self.learner_restarts.restart(exc, self.incarnations)
                    self.learner_ref = learner_ref
                    pending = [r for r in pending if r in self.run.worker_refs] + learner_refs
                    self._after_learner_restart()
                    pending += [self._replace_orphan(i) for i in self.orphans]
                    self.orphans = []
                    break
                if ref == learner_ref:
                    self._finish(pending)
                    return 0
                # A follower learner rank returned: keep waiting for rank 0.
        return 1

    def stop_gracefully(self, grace_s: float) -> Optional[dict]:
        """Ctrl-C or SIGTERM: ask the learner to finish its step and write a checkpoint (learner/loop.py
        ``request_stop``), and wait for its run() to return, up to ``grace_s`` (``cluster.stop_grace_s``), printing
        its progress meanwhile. Another interrupt stops the wait at once. Returns the learner's summary, or None
        when it did not stop in time (the caller stops every actor either way)."""
        if self.learner_ref is None or grace_s <= 0:
            return None
        deadline = time.time() + grace_s
        try:
            print(f"[asyncppo] interrupted: the learner finishes its step and writes a checkpoint, then the run "
                  f"stops (up to {grace_s:g}s, cluster.stop_grace_s; interrupt again to stop at once)",
                  file=sys.stderr, flush=True)
            self.run.learner.request_stop.remote()
            while time.time() < deadline:
                done, _ = ray.wait([self.learner_ref], timeout=min(1.0, max(0.01, deadline - time.time())))
                self.console.poll()
                if done:
                    return ray.get(self.learner_ref)
            print(f"[asyncppo] the learner did not stop within {grace_s:g}s (cluster.stop_grace_s): stopping now; "
                  f"the latest checkpoint is {latest_name(self.run.plan.output_dir) or 'none'}", file=sys.stderr,
                  flush=True)
        except KeyboardInterrupt:
            print("[asyncppo] interrupted again: stopping at once", file=sys.stderr, flush=True)
        except ray.exceptions.RayError as exc:
            print(f"[asyncppo] the learner failed while stopping: {_first_line(exc)}", file=sys.stderr, flush=True)
        return None

    def _after_learner_restart(self) -> None:
        """The hang watch reads the new learner, and every worker's clock starts again: the restart kept the
        supervisor from pinging them, and their reconnection is a wait on the learner, not a hang."""
        self.hangs.new_learner(self.run.learner)
        for i in self.run.workers:
            self.hangs.started(i)

    def _worker_ended(self, ref: Any) -> Optional[Any]:
        """A worker's run() ended: normally (the learner told it to stop) -> None; by dying -> the ref of its
        replacement, or :class:`WorkerFailed` when it may not be replaced."""
        i = self.run.worker_refs.pop(ref)
        try:
            ray.get(ref)
            return None
        except ray.exceptions.RayError as exc:
            return self._replace(i, exc)

    def _replace_hung(self, pending: list) -> list:
        """Kill and replace every worker the hang watch found hung; ``pending`` without their runs' refs (their
        ends are not deaths to replace again), with their replacements'."""
        for i, verdict in self.hangs.poll():
            ref = next((r for r, w in self.run.worker_refs.items() if w == i), None)
            if ref is None:
                continue  # its run() already ended (the learner stopped it): nothing to replace, nothing to count
            self._record_hang(i, verdict)
            del self.run.worker_refs[ref]
            pending = [r for r in pending if r != ref]
            replacement = self._replace(i, verdict.why, hung=True)
            if replacement is not None:
                pending.append(replacement)
        return pending

    def _record_hang(self, i: int, verdict: Verdict) -> None:
        """Every hang verdict, as one line of ``<run dir>/hangs.jsonl`` (worker, incarnation, rule, why, wall time,
        and how long each worker's answers have been apart at most): what a test or the fault drill reads to count
        the verdicts and to find a false one. Never fails the run."""
        self.hang_verdicts += 1
        seen = self.hangs.seen.get(i)
        record = {"time": round(time.time(), 3), "run_s": round(time.time() - self.started_at, 1), "worker": i,
                  "incarnation": self.incarnations.get(i, 0), "rule": verdict.rule, "why": verdict.why,
                  "phase": seen.phase if seen else None,
                  "longest_gaps": self.hangs.longest_gaps()}
        try:
            with open(os.path.join(self.run.plan.output_dir, "hangs.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as exc:
            print(f"[asyncppo] warning: hangs.jsonl not written: {exc}", file=sys.stderr, flush=True)

    def _write_hang_watch(self) -> None:
        """``<run dir>/hang_watch.json`` at the end: the deadlines in force, the verdicts, and per worker (current
        incarnations) and for the learner the longest time between two answers: how near a live worker came to the
        silent deadline, the margin against a false verdict on this machine."""
        h = self.hangs
        summary = {"hang_timeout_s": round(h.hang_s(), 1), "silent_timeout_s": h.silent_s(),
                   "verdicts": self.hang_verdicts, "longest_gaps": h.longest_gaps(),
                   "learner_longest_gap": round(h.learner_seen.longest_gap, 2)}
        try:
            with open(os.path.join(self.run.plan.output_dir, "hang_watch.json"), "w", encoding="utf-8") as f:
                json.dump(summary, f, indent=1)
        except OSError:
            pass  # a summary of the watch never fails a finished run

    def _replace(self, i: int, exc: BaseException | str, hung: bool = False) -> Any:
        plan, budget = self.run.plan, self.budget
        host = self.run.worker_hosts.get(i)
        what = (f"on host {host} " if host else "") + (f"hung ({exc})" if hung else "died")
        if not plan.replace_dead_workers or not budget.take():
            window = (f" per cluster.worker_restart_window_s={budget.window_s:g}"
                      if budget.limit and budget.window_s is not None else "")
            raise WorkerFailed(
                f"rollout worker {i} {what}"
                + (f" after {budget.recent()} restart(s){budget.span() if budget.limit else ''}, the limit "
                   f"(cluster.max_worker_restarts={budget.limit}{window})"
                   if plan.replace_dead_workers or hung else "") + ("" if hung else f": an actor failed:\n{exc}")
            ) from None
        self.incarnations[i] += 1
        print(f"[asyncppo] rollout worker {i} " + (f"{what}; killing it and starting" if hung else
                                                   f"{what} ({_first_line(exc)}); starting")
              + f" a replacement (restart {budget.recent()} of at most {budget.limit}{budget.span()})",
              file=sys.stderr, flush=True)
        try:
            ray.kill(self.run.workers[i])
        except Exception:
            pass
        # its tickets return to the pool and the weight sync awaits the replacement, which resumes the worker's
        # prompt sequence where the learner's record of trained draws says
        try:
            return self._start_replacement(i, hung)
        except ray.exceptions.RayActorError:  # the learner died too: its restart replaces this worker
            self.orphans.append(i)
            return None

    def _replace_orphan(self, i: int) -> Any:
        """A worker that died while the learner was dead, replaced by the restarted learner."""
        return self._start_replacement(i)

    def _start_replacement(self, i: int, hung: bool = False) -> Any:
        """The learner takes worker ``i``'s tickets and sync member back and says where its prompt sequence resumes;
        the next incarnation starts there."""
        position = ray.get(self.run.learner.replace_worker.remote(i, self.incarnations[i], hung),
                           timeout=self.run.plan.timeout_s)
        self.hangs.started(i)
        return self.run.start_worker(i, self.incarnations[i], position)

    def _finish(self, pending: list) -> None:
        """The learner finished and published stop: give the others a moment to exit, then summary and report."""
        print(f"[asyncppo] learner finished in {time.time() - self.started_at:.0f}s", flush=True)
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=STOP_GRACE_S)
        self.console.poll()
        self._write_hang_watch()
        print(self.console.summary(time.time() - self.started_at), flush=True)
        # the report reads only the run directory: it is drawn on a thread while the actors and Ray stop (1-2 s
        # each on two CPU cores), and the command waits for it (wait_report) before it exits
        self.report = threading.Thread(target=write_run_report, args=(self.run.plan.output_dir,), name="run-report")
        self.report.start()

    def wait_report(self) -> None:
        """Wait for the run report drawn since the learner finished (nothing to wait for after an error)."""
        if self.report is not None:
            self.report.join()


def write_run_report(output_dir: str) -> None:
    """The run report (report.png and one PNG per panel); a plotting problem never fails a finished run."""
    try:
        from asyncppo.report import write_report  # heavy: matplotlib

        paths = write_report(output_dir)
        shown = paths.get("report") if isinstance(paths, dict) else None
        print(f"[asyncppo] run report: {shown or os.path.join(output_dir, 'report.png')}", flush=True)
    except Exception as exc:
        print(f"[asyncppo] warning: the run report could not be written: {exc!r}", file=sys.stderr, flush=True)


def report_failure(exc: BaseException, console: RunConsole, output_dir: str) -> int:
    """An actor's error ended the run: the last progress, the error and where the actor logs are; exit code 1."""
    console.poll()
    logs = os.path.join(output_dir, "logs")
    if isinstance(exc, WorkerFailed):
        print(f"[asyncppo] error: {exc}\n(actor logs: {logs})", file=sys.stderr)
    else:
        print(f"[asyncppo] error: an actor failed:\n{exc}\n(actor logs: {logs})", file=sys.stderr)
    return 1
