#!/usr/bin/env python
"""The fault drill: one short real launch, five faults injected one after another, and a table of what each cost.

    python scripts/fault_drill.py                      # 2 rollout workers (vLLM, CPU), 150 steps, k=1, save_every=5
    python scripts/fault_drill.py --steps 200 --out runs/drill
    python scripts/fault_drill.py --hosts 2            # faults between two hosts (scripts/fault_drill_hosts.py)

Faults, in order, each once the run has recovered from the previous one and trained a few more steps:

1. ``SIGKILL worker``: a rollout worker's process is killed;
2. ``SIGSTOP worker``: a rollout worker stops (a hung engine);
3. ``SIGSTOP worker mid-push``: a worker is stopped the moment the learner logs a step, i.e. while the weights of
   the new version are being pushed (``rollout.sync_every=1``: a push follows every step);
4. ``SIGKILL learner``: learner rank 0's process is killed (it restarts from the latest checkpoint);
5. ``dropped connection``: every TCP connection between a worker and the learner (trajectories, control, tickets,
   weight sync) is aborted with ``ss -K``, as a network fault would.

While a fault recovers, the workers score 0.3 s a sample (``paced_exact``), so the run does not finish before the
recovery is seen; otherwise it runs at full speed. For each: *detected after* = seconds from the injection to the launcher's or learner's line naming the fault;
*recovered after* = seconds until the affected side trained again (a group of the replaced or reconnected worker,
or a step of the restarted learner); *steps lost* = ``learner/steps_lost`` added; *samples re-drawn* = groups whose
prompts are drawn again (the tickets taken back from a dead worker, or the groups the lost steps had trained) x the
group size. A fault that does not recover within ``--recover-s`` is reported as ``NOT RECOVERED``.

At the end it checks that the run trained every step (exit 0), the staleness bound held in every record, no prompt
was trained twice among the surviving steps, none was skipped beyond those in flight, and no process of the run is
left. Exit code 0 when all of that holds and every fault recovered.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from asyncppo.report.runs import surviving_steps  # noqa: E402  (the repository's package, run from anywhere)

REPO = Path(__file__).resolve().parents[1]
GROUP = 8  # rollout.num_return_sequences_in_group of the built-in task
PACE_S = 0.3  # seconds per scored sample while a fault recovers, so the run does not end first
SLOW = "DRILL_SLOW"  # the marker file in the run directory that asks for that pace


def paced_exact(response_text: str, answer: str, **kw) -> float:
    """The built-in task's exact match (the drill's ``rollout.reward_fn``, run by the rollout workers), slowed to
    ``PACE_S`` a sample while ``<run dir>/DRILL_SLOW`` exists: the drill keeps the run from finishing while a fault
    recovers (an engine starts in ~30-60 s; the run trains a step in ~0.2 s), and runs it at full speed otherwise.
    The worker finds its run directory from its stdout, which the launcher points at ``<run dir>/logs/``."""
    from asyncppo.data.rewards import exact_match

    marker = _marker.setdefault("path", os.path.join(os.path.dirname(os.path.dirname(
        os.readlink("/proc/self/fd/1"))), SLOW))
    if os.path.exists(marker):
        time.sleep(PACE_S)
    return exact_match(response_text, answer, **kw)


_marker: dict = {}


class Run:
    """One ``asyncppo launch`` in the background, followed through its run directory and its stderr."""

    def __init__(self, out: Path, overrides: list[str], prefix: tuple = (), env: dict | None = None):
        """``prefix``: what runs the launch somewhere else (``ip netns exec <host A>``), ``env`` its environment."""
        self.out = out
        out.parent.mkdir(parents=True, exist_ok=True)
        self.err_path = out.parent / f"{out.name}.err"
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "asyncppo", "launch", f"trainer.output_dir={out}", *overrides], cwd=REPO,
            env=dict(env or os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO)),
            stdout=open(out.parent / f"{out.name}.out", "w"), stderr=open(self.err_path, "w"))

    def stderr(self) -> str:
        return self.err_path.read_text() if self.err_path.exists() else ""

    def records(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.strip().endswith("}") and '"staleness/max"' in x]

    def trained_lines(self) -> list[dict]:
        path = self.out / "trained_groups.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        return [json.loads(x) for x in lines if x.strip().endswith("}")]

    def worker_pids(self) -> dict[int, int]:
        pids = {}
        for log in sorted((self.out / "logs").glob("worker-*.log")):
            for m in re.finditer(r"rollout worker (\d+)(?: \(incarnation \d+[^)]*\))?: pid (\d+)", log.read_text()):
                pids[int(m.group(1))] = int(m.group(2))
        return pids

    def actor_pids(self, marker: str) -> list[int]:
        """This run's Ray actor processes whose title contains ``marker`` (their stdout is a log in the run dir)."""
        found = []
        for line in subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout.splitlines():
            pid, _, args = line.strip().partition(" ")
            if args.startswith("ray::") and marker in args:
                try:
                    if os.readlink(f"/proc/{pid}/fd/1").startswith(str(self.out)):
                        found.append(int(pid))
                except OSError:
                    pass
        return found

    def wait(self, what, timeout_s: float, poll_s: float = 0.2):
        """Poll ``what()`` until it returns something truthy; None on timeout or when the run ended."""
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            got = what()
            if got:
                return got
            if self.proc.poll() is not None:
                return what() or None
            time.sleep(poll_s)
        return None


def draw(group_id: str) -> tuple[int, int, int]:
    """(worker, incarnation, draw) of a group id ``w-s`` or ``w.i-s``."""
    head, _, seq = group_id.rpartition("-")
    worker, _, inc = head.partition(".")
    return int(worker), int(inc or 0), int(seq)


class Drill:
    def __init__(self, run: Run, recover_s: float):
        self.run, self.recover_s = run, recover_s
        self.rows: list[dict] = []
        self.stopped: list[int] = []  # SIGSTOPped pids: continued at the end, should one have been left behind

    # -------------------------------------------------------------------------------------------- measuring
    def _line_after(self, offset: int, pattern: str):
        return lambda: re.search(pattern, self.run.stderr()[offset:])

    def _metric(self, key: str) -> float:
        recs = self.run.records()
        return float(recs[-1].get(key, 0)) if recs else 0.0

    def _incarnation(self, worker: int) -> int:
        log = self.run.out / "logs" / f"worker-{worker}.log"
        found = re.findall(rf"rollout worker {worker} \(incarnation (\d+)", log.read_text() if log.exists() else "")
        return max((int(x) for x in found), default=0)

    def _max_draw(self, worker: int) -> int:
        draws = [draw(g[0])[2] for ln in self.run.trained_lines() for g in ln["groups"] if draw(g[0])[0] == worker]
        return max(draws, default=0)

    def _trained_by(self, worker: int, after_lines: int, same_process: bool = False):
        """Recovered: a group of ``worker`` trained after the first ``after_lines`` lines of trained_groups.jsonl,
        from a newer incarnation (its replacement) or, when ``same_process`` may recover by itself, drawn 7 or more
        draws past its newest trained one: a worker holds at most 6 tickets (``2 x max_num_seqs / n + 2``), so
        such a draw took a ticket granted after the fault."""
        inc0, draw0 = self._incarnation(worker), self._max_draw(worker) + 7 if same_process else 1 << 62

        def check():
            for line in self.run.trained_lines()[after_lines:]:
                for g in line["groups"]:
                    w, inc, seq = draw(g[0])
                    if w == worker and (inc > inc0 or seq >= draw0):
                        return True
            return False
        return check

    def settle(self, steps: int = 3) -> None:
        """Let the run train ``steps`` more steps before the next fault."""
        start = len(self.run.records())
        self.run.wait(lambda: len(self.run.records()) >= start + steps, self.recover_s)

    def inject(self, name: str, worker: int, action, detect: str | None, recovered=None, same_process=False,
               after_detect=None) -> None:
        """Inject a fault and measure it. ``detect``: the pattern of the line that names it (None: a transient
        fault nothing needs to notice); ``after_detect``: what the operator does once it is named (plug the cable
        back, restart a node), so recovery is measured from the injection as the run sees it."""
        offset, lines = len(self.run.stderr()), len(self.run.trained_lines())
        returned0, lost0 = self._metric("workers/tickets_returned"), self._metric("learner/steps_lost")
        restarts0 = self._metric("learner/restarts")
        check = recovered or self._trained_by(worker, lines, same_process)
        (self.run.out / SLOW).touch()
        t0 = time.time()
        action()
        seen = self.run.wait(self._line_after(offset, detect), self.recover_s) if detect else None
        detected = time.time() - t0 if seen else None
        if after_detect is not None:
            after_detect()
        back = self.run.wait(check, self.recover_s)
        recovered_s = time.time() - t0 if back else None
        (self.run.out / SLOW).unlink(missing_ok=True)
        redrawn = self._metric("workers/tickets_returned") - returned0
        if self._metric("learner/restarts") > restarts0:  # the new learner's counters started again from 0
            redrawn = self._metric("workers/tickets_returned")
        lost = self._metric("learner/steps_lost") - lost0
        self.rows.append({"fault": name, "detected_s": detected, "recovered_s": recovered_s, "steps_lost": lost,
                          "redrawn_groups": redrawn, "line": seen.group(0)[:120] if seen else ""})
        print(f"[drill] {name}: detected {detected}, recovered {recovered_s}", flush=True)

    # -------------------------------------------------------------------------------------------- the faults
    def kill_worker(self, i: int) -> None:
        pid = self.run.worker_pids()[i]
        self.inject("SIGKILL worker", i, lambda: os.kill(pid, signal.SIGKILL), rf"rollout worker {i}\b.*died")

    def stop_worker(self, i: int, name: str = "SIGSTOP worker", mid_push: bool = False) -> None:
        pid = self.run.worker_pids()[i]
        if mid_push:  # the learner pushes right after it logs a step (sync_every=1): stop the worker then
            n = len(self.run.records())
            self.run.wait(lambda: len(self.run.records()) > n, self.recover_s, poll_s=0.01)
        self.stopped.append(pid)
        self.inject(name, i, lambda: os.kill(pid, signal.SIGSTOP),
                    rf"rollout worker\(?s?\)? \[?{i}\b.*(hung|late|did not take|died|no progress)")

    def kill_learner(self) -> None:
        (pid,) = self.run.actor_pids("LearnerActor")
        n = len(self.run.records())
        redraw_from = len(self.run.trained_lines())
        self.inject("SIGKILL learner", -1, lambda: os.kill(pid, signal.SIGKILL), r"learner died after step \d+",
                    recovered=lambda: any(r.get("learner/restarts", 0) >= 1 for r in self.run.records()[n:]))
        lines = self.run.trained_lines()
        restart_step = next((lines[j]["step"] for j in range(max(1, redraw_from), len(lines))
                             if lines[j]["step"] <= lines[j - 1]["step"]), None)
        if restart_step is not None:  # groups the lost steps had trained are drawn again
            self.rows[-1]["redrawn_groups"] = sum(len(ln["groups"]) for ln in lines[:redraw_from]
                                                  if ln["step"] >= restart_step)

    def drop_connections(self, i: int) -> None:
        """Abort every TCP connection between worker ``i`` and the learner (both directions)."""
        worker, (learner,) = self.run.worker_pids()[i], self.run.actor_pids("LearnerActor")

        def sockets(pid: int) -> set[str]:
            rows = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True).stdout.splitlines()
            return {r.split()[3] for r in rows if f"pid={pid}," in r}

        def drop() -> None:
            mine = sockets(learner)
            rows = subprocess.run(["ss", "-tnpH"], capture_output=True, text=True).stdout.splitlines()
            for r in rows:
                cols = r.split()
                if f"pid={worker}," in r and cols[4] in mine:
                    (src, sport), (dst, dport) = cols[3].rsplit(":", 1), cols[4].rsplit(":", 1)
                    subprocess.run(["ss", "-K", "src", src.strip("[]"), "sport", "=", f":{sport}", "dst",
                                    dst.strip("[]"), "dport", "=", f":{dport}"], capture_output=True)
        self.inject("dropped connection", i, drop,
                    rf"(rollout worker\(?s?\)? \[?{i}\b.*(hung|late|did not take|died|no progress|failed)|"
                    rf"weight-sync|worker {i} \(incarnation)", same_process=True)


def check_end(run: Run, steps: int, k: int) -> list[str]:
    """What the drill promises at the end; each broken promise is one line."""
    problems = []
    if run.proc.returncode != 0:
        problems.append(f"the run exited {run.proc.returncode}")
    recs = surviving_steps(run.records())
    if [r["step"] for r in recs] != list(range(1, steps + 1)):
        problems.append(f"steps trained: {[r['step'] for r in recs][:5]}... not 1..{steps}")
    worst = max((r["staleness/max"] for r in run.records()), default=0)
    if worst > k:
        problems.append(f"staleness/max reached {worst} > {k}")
    groups = [g for line in surviving_steps(run.trained_lines()) for g in line["groups"]]
    draws = [(draw(g[0])[0], draw(g[0])[2]) for g in groups]
    if len(set(draws)) != len(draws):
        problems.append(f"{len(draws) - len(set(draws))} prompt(s) trained twice")
    for w in {d[0] for d in draws}:
        mine = sorted(s for x, s in draws if x == w)
        skipped = len(set(range(mine[-1] + 1)) - set(mine))
        if skipped > 4 * 4:  # beyond what can be in flight at the end (a few groups per worker)
            problems.append(f"worker {w}: {skipped} draws below its last trained draw never trained")
    time.sleep(5)
    left = run.actor_pids("")
    if left:
        problems.append(f"processes left running: {left}")
    return problems


def table(rows: list[dict]) -> str:
    fmt = lambda v: "NOT RECOVERED" if v is None else f"{v:.1f}"
    out = ["| fault | detected after (s) | recovered after (s) | steps lost | samples re-drawn |", "|---|---|---|---|---|"]
    for r in rows:
        detected = "not detected" if r["detected_s"] is None else f"{r['detected_s']:.1f}"
        if r["detected_s"] is None and r.get("transient"):
            detected = "nothing to detect"
        out.append(f"| {r['fault']} | {detected} | {fmt(r['recovered_s'])} | {r['steps_lost']:.0f} | "
                   f"{r['redrawn_groups'] * GROUP:.0f} ({r['redrawn_groups']:.0f} groups) |")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--staleness", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--recover-s", type=float, default=300.0, help="seconds a fault may take to recover")
    ap.add_argument("--hosts", type=int, default=1, choices=(1, 2),
                    help="2: the learner and the worker on two hosts (network namespaces, root), faults between "
                         "them (scripts/fault_drill_hosts.py)")
    ap.add_argument("overrides", nargs="*", help="extra launch overrides")
    args = ap.parse_args()
    if args.hosts == 2:
        import fault_drill_hosts  # noqa: PLC0415 - a sibling script, only for this mode

        return fault_drill_hosts.main(args)
    out = Path(args.out or tempfile.mkdtemp(prefix="fault-drill-")) / "run"
    run = Run(out, drill_overrides(args, ["cluster.rollout_workers=2"]))
    drill = Drill(run, args.recover_s)

    def release_stopped() -> None:
        for pid in drill.stopped:  # a stopped worker that was never replaced must not stay stopped
            try:
                os.kill(pid, signal.SIGCONT)
            except (ProcessLookupError, PermissionError):
                pass

    t_start = time.time()
    drive(run, drill, (lambda: drill.kill_worker(1), lambda: drill.stop_worker(0),
                       lambda: drill.stop_worker(1, "SIGSTOP worker mid-push", mid_push=True),
                       drill.kill_learner, lambda: drill.drop_connections(0)), t_start, cleanup=release_stopped)
    return report(run, drill, args, out, t_start)


def drill_overrides(args, extra: list[str]) -> list[str]:
    """The drill's launch: a short real run with checkpoints every 5 steps and the paced reward (module docstring)."""
    return ["trainer.logger.wandb=false", "rollout.engine=vllm", "rollout.rollout_batch_size=4",
            "data.num_eval_prompts=16", "trainer.eval_every=0", "rollout.max_num_seqs=16",
            f"rollout.max_staleness={args.staleness}", f"trainer.total_steps={args.steps}", "trainer.save_every=5",
            "cluster.max_worker_restarts=8", "rollout.reward_fn=scripts.fault_drill:paced_exact", *extra,
            *args.overrides]


def drive(run: Run, drill: Drill, faults, t_start: float, cleanup=None, started=None) -> None:
    """Inject ``faults`` one after another once the run trained 4 steps (each after the previous recovered and 3
    more steps), then let the run finish; whatever happens, ``cleanup`` and the run's end."""
    try:
        run.wait(lambda: len(run.records()) >= 4, 900)
        if started is not None:
            started()
        for fault in faults:
            if run.proc.poll() is not None:
                break
            fault()
            drill.settle()
        run.proc.wait(timeout=max(60.0, 1800 - (time.time() - t_start)))
    finally:
        if cleanup is not None:
            cleanup()
        if run.proc.poll() is None:
            run.proc.terminate()
            run.proc.wait(timeout=120)


def report(run: Run, drill: Drill, args, out: Path, t_start: float, where: str = "") -> int:
    """The end checks, the table and the verdict: 0 when every check held and every fault recovered."""
    problems = check_end(run, args.steps, args.staleness)
    print(table(drill.rows))
    for r in drill.rows:
        print(f"  {r['fault']}: {r['line']!r}")
    print(f"run directory: {out}; wall {time.time() - t_start:.0f}s{where}")
    print("checks: " + ("all held (every step trained, staleness <= k, no prompt trained twice, none skipped, "
                        "nothing left running)" if not problems else "; ".join(problems)))
    ok = not problems and all(r["recovered_s"] is not None for r in drill.rows)
    return 0 if ok else 1

if __name__ == "__main__":
    sys.exit(main())
