"""End to end: runs that survive a rollout worker killed mid-run, or stopped (SIGSTOP) mid-run, and a learner killed.

Real Ray, vLLM (CPU), ZeroMQ and gloo, as in tests/e2e/test_e2e_launch.py. The faults are injected from outside, with
signals, into the run's own worker processes (found by the pid each worker logs); docs/reliability.md lists the
outcomes measured here.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from asyncppo.report.runs import surviving_steps
from test_e2e_launch import ASYNCPPO, REPO, _train_records

pytestmark = pytest.mark.slow

SMALL = ("trainer.logger.wandb=false", "rollout.engine=vllm", "rollout.rollout_batch_size=4", "data.num_eval_prompts=16",
         "trainer.eval_every=0", "cluster.rollout_workers=2")


class Run:
    """One ``asyncppo launch`` in the background. Output goes to files (no pipe to fill up); every process under the
    launcher seen while it runs is remembered, so the test can check that exactly those are gone afterwards (other
    Ray clusters on the machine are none of its business)."""

    def __init__(self, out_dir: Path, *overrides: str):
        env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
        out_dir.mkdir(parents=True, exist_ok=True)
        self.out_dir = out_dir
        self._stdout, self._stderr = open(out_dir.parent / f"{out_dir.name}.out", "w+"), \
            open(out_dir.parent / f"{out_dir.name}.err", "w+")
        self.proc = subprocess.Popen([*ASYNCPPO, "launch", f"trainer.output_dir={out_dir}", *SMALL, *overrides],
                                     cwd=REPO, env=env, stdout=self._stdout, stderr=self._stderr, text=True)
        self.seen: set[int] = set()

    def poll(self):
        self.seen.update(_descendant_pids(self.proc.pid, ""))
        return self.proc.poll()

    def output(self) -> tuple[str, str]:
        self._stdout.seek(0)
        self._stderr.seek(0)
        return self._stdout.read(), self._stderr.read()

    def finish(self, timeout_s: float) -> tuple[int, str, str]:
        deadline = time.time() + timeout_s
        while self.poll() is None and time.time() < deadline:
            time.sleep(0.5)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode, *self.output()

    def assert_no_leftovers(self) -> None:
        def running(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0] != "Z"
            except OSError:
                return False

        alive = lambda: [p for p in self.seen if running(p)]
        deadline = time.time() + 30
        while alive() and time.time() < deadline:
            time.sleep(1)
        assert not alive(), f"processes of the run left behind: {alive()}"


def _start(out_dir: Path, *overrides: str) -> Run:
    return Run(out_dir, *overrides)


def _records(out_dir: Path) -> list[dict]:
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _worker_pids(out_dir: Path) -> dict[int, int]:
    """worker id -> pid of its newest incarnation, from the line each worker logs when it starts."""
    pids = {}
    for log in sorted((out_dir / "logs").glob("worker-*.log")):
        for m in re.finditer(r"rollout worker (\d+)(?: \(incarnation \d+[^)]*\))?: pid (\d+)", log.read_text()):
            pids[int(m.group(1))] = int(m.group(2))
    return pids


def _wait_for_step(run: Run, out_dir: Path, step: int, timeout_s: float = 900) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if run.poll() is not None:
            out, err = run.output()
            raise AssertionError(f"run ended early ({run.proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        if len(_train_records(_records(out_dir))) >= step:
            return
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout_s}s")


def _trained(out_dir: Path) -> list[list]:
    """The trained groups of the surviving steps (a restarted learner trains the steps after its checkpoint again;
    what the dead one trained of them was lost with it)."""
    lines = [json.loads(line) for line in (out_dir / "trained_groups.jsonl").read_text().splitlines()]
    return [g for line in surviving_steps(lines) for g in line["groups"]]


def _replace(run: Run, out: Path, worker: int, signum: int) -> int:
    """Send ``signum`` to ``worker``'s process and wait until its replacement has logged its pid. The survivor slows
    down (tests/reliability_helpers.py) until then, so the replacement has steps left to take part in. Returns the
    pid signalled."""
    pids = _worker_pids(out)
    assert sorted(pids) == [0, 1], pids
    (out / "SLOW").touch()
    os.kill(pids[worker], signum)
    deadline = time.time() + 600
    while _worker_pids(out).get(worker) == pids[worker] and time.time() < deadline and run.poll() is None:
        time.sleep(0.5)
    (out / "SLOW").unlink()
    return pids[worker]


def _draws(groups: list, prefix: str) -> set[int]:
    """The draw numbers of the trained groups whose id starts with ``prefix`` ("<worker>[.<incarnation>]-")."""
    return {int(g[0].split("-")[1]) for g in groups if g[0].startswith(prefix)}


K, STEPS, SAVE_EVERY, HANG_S = 1, 44, 4, 15


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory) -> dict:
    """One launch for the two checks below (one configuration: two workers, k=1, 16 sequences per engine, slow
    scoring while ``SLOW`` exists), 44 steps with checkpoints every 4, three faults one after the other:

    1. at step 6 the learner is SIGKILLed (scoring is slow until then, ~1.6 s a step, so the kill lands between two
       checkpoints): the launcher restarts it from step 4, and both workers stay up and reconnect;
    2. at step 12 worker 1 is SIGKILLed: the launcher sees it die and replaces it;
    3. at step 22 worker 0 is SIGSTOPped: with ``cluster.hang_timeout_s=15`` it answers no control ping for 15 s, is
       killed through Ray and replaced.

    (Two launches before, of the same configuration: 82 s and 53 s on the 2-core box.)"""
    out = tmp_path_factory.mktemp("faults") / "run"
    run = _start(out, f"trainer.total_steps={STEPS}", f"rollout.max_staleness={K}", "rollout.max_num_seqs=16",
                 f"trainer.save_every={SAVE_EVERY}", f"cluster.hang_timeout_s={HANG_S}",
                 "rollout.reward_fn=tests.reliability_helpers:exact_slow_while_marked")
    seen: dict = {"out": out, "run": run, "stopped": None}
    (out / "SLOW").touch()
    try:
        _wait_for_step(run, out, 6)
        seen["workers_before"] = _worker_pids(out)
        (learner,) = _descendant_pids(run.proc.pid, "LearnerActor")
        os.kill(learner, signal.SIGKILL)
        (out / "SLOW").unlink()
        _wait_until(run, lambda: any(r.get("learner/restarts") for r in _records(out)[-1:]))
        seen["workers_after_restart"] = _worker_pids(out)
        _wait_for_step(run, out, 12)
        _replace(run, out, 1, signal.SIGKILL)
        _wait_for_step(run, out, 22)
        t_stop = time.time()
        seen["stopped"] = _replace(run, out, 0, signal.SIGSTOP)
        seen["replaced_after"] = time.time() - t_stop
    finally:
        seen["code"], seen["stdout"], seen["stderr"] = run.finish(900)
        if seen["stopped"] is not None:
            try:
                os.kill(seen["stopped"], signal.SIGCONT)
            except ProcessLookupError:
                pass
    return seen


def _wait_until(run: Run, done, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while not done():
        if run.poll() is not None:
            out, err = run.output()
            raise AssertionError(f"run ended early ({run.proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


def test_killed_worker_and_stopped_worker_are_each_replaced_and_the_run_completes(faulted_run):
    """Faults 2 and 3 of the run above. Each time the lost worker's tickets return to the pool, its in-flight draws
    are drawn again by its replacement, which joins the weight sync and resumes the worker's prompt sequence; the run
    trains all 44 steps within the bound, with every group once. (The automatic hang timeout, max(60 s, 10 median
    steps) capped at ``cluster.timeout_s``, is tested in tests/unit/test_hang_detect.py; the fault drill runs it at
    its default.)"""
    out, code, stdout, stderr = (faulted_run[key] for key in ("out", "code", "stdout", "stderr"))
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    assert "rollout worker 1 died" in stderr and "starting a replacement" in stderr, stderr[-3000:]
    # the silent rule (launch/hang.py, rule 3; its deadline is the hang timeout here, 15 s) while worker 1 and the
    # learner answer; the hang timeout's own rule if they were late too
    m = re.search(r"rollout worker 0 hung \(no answer to a control ping for (\d+)s (?:while the learner and 1 other "
                  r"worker\(s\) answered every \d+s or sooner \(silent deadline|\(hang timeout) (\d+)s[^)]*\)\); "
                  r"killing it and starting a replacement \(restart 2 of at most 3 within 3600s\)", stderr)
    assert m, stderr[-3000:]
    silent, hang_s = int(m.group(1)), int(m.group(2))
    print(f"declared hung after {silent}s without an answer (deadline {hang_s}s); the replacement logged its "
          f"pid {faulted_run['replaced_after']:.0f}s after SIGSTOP")
    assert hang_s == HANG_S and hang_s <= silent < hang_s + 30
    verdicts = [json.loads(line) for line in (out / "hangs.jsonl").read_text().splitlines()]
    assert [(v["worker"], v["incarnation"]) for v in verdicts] == [(0, 0)], verdicts  # no false verdict
    train = surviving_steps(_train_records(_records(out)))
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[0]["workers/restarts"] == 0 and train[-1]["workers/restarts"] == 2
    assert train[0]["workers/hung"] == 0 and train[-1]["workers/hung"] == 1
    print("tickets returned:", train[-1]["workers/tickets_returned"], "sync members retired:",
          train[-1]["workers/sync_failures"])
    assert train[-1]["workers/tickets_returned"] >= 1  # the lost workers held tickets: they were granted again
    assert max(r["staleness/max"] for r in _train_records(_records(out))) <= K
    # No group trained twice: every trained group id and every trained ticket is unique, B per step. (Training
    # consumes tickets in order, so a ticket of a lost worker that never came back would have stalled the run.)
    groups = _trained(out)
    assert len(groups) == STEPS * 4
    assert len({g[0] for g in groups}) == len(groups), "a group id was trained twice"
    assert len({g[1] for g in groups}) == len(groups), "a ticket was trained twice"
    for worker in (1, 0):
        # the replacement (incarnation 1) resumed the worker's prompt sequence and its groups were trained (ids
        # "<worker>.1-<draw>"); no prompt of the worker trained twice, none accepted from the lost one dropped
        log = (out / "logs" / f"worker-{worker}.log").read_text()
        first_draw = int(re.search(r"incarnation 1, from draw (\d+)", log).group(1))
        before, after = _draws(groups, f"{worker}-"), _draws(groups, f"{worker}.1-")
        assert before, f"the first incarnation of worker {worker} trained nothing"
        assert after, f"no group of worker {worker}'s replacement was trained"
        assert min(after) >= first_draw and not before & after
    assert set(range(first_draw)) <= _draws(groups, "0-"), "a prompt accepted from the stopped worker was lost"
    faulted_run["run"].assert_no_leftovers()


def _descendant_pids(root: int, marker: str) -> list[int]:
    """Processes under ``root`` (the launcher: Ray's raylet and its workers are its descendants) whose command line
    contains ``marker``."""
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True, text=True).stdout.splitlines()
    children: dict[int, list[int]] = {}
    args: dict[int, str] = {}
    for row in rows:
        pid, ppid, *rest = row.split(None, 2)
        children.setdefault(int(ppid), []).append(int(pid))
        args[int(pid)] = rest[0] if rest else ""
    found, stack = [], [root]
    while stack:
        pid = stack.pop()
        for child in children.get(pid, []):
            stack.append(child)
            if marker in args.get(child, ""):
                found.append(child)
    return found


# k=0, one worker, one group at a time in the engine (its batch is always the same n samples), seeded sampling
EXACT = ("cluster.rollout_workers=1", "rollout.max_staleness=0", "rollout.rollout_batch_size=2",
         "rollout.num_return_sequences_in_group=4", "rollout.max_num_seqs=4", "rollout.sampling.seed=0",
         "trainer.save_every=3", "trainer.total_steps=6",
         # no held-out round at version 0: it shares the engine with step 1's groups (rollout/evaluation.py), so
         # which answers are batched together depends on when the tickets arrive, and CPU kernels are not batch
         # invariant (a CI run's reference and cut runs parted at step 1 that way); the final round trains nothing
         "trainer.eval_at_start=false")


def _final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


def test_killed_learner_resumes_exactly(tmp_path):
    """k=0, one worker: a run whose learner is SIGKILLed after its step-3 checkpoint, resumed from it, trains the
    prompt sequence of a run that never stopped, and ends with bit-identical weights."""
    ref_dir, cut_dir, res_dir = tmp_path / "ref", tmp_path / "cut", tmp_path / "res"
    # the uninterrupted run and the one to be cut side by side (two local Ray clusters; what they train does not
    # depend on timing, so sharing the cores changes nothing but the wall time: ~15 s less than one after the other)
    ref = _start(ref_dir, *EXACT, "rollout.reward_fn=tests.reliability_helpers:exact")
    # auto_resume off: this test resumes by hand (test_killed_learner_comes_back_by_itself covers the automatic way)
    run = _start(cut_dir, *EXACT, "rollout.reward_fn=tests.reliability_helpers:exact_then_hang",
                 "trainer.auto_resume=false")
    try:
        _wait_for_step(run, cut_dir, 4)  # step 4 is trained; the worker hangs in step 5's first group
        assert (cut_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
        (learner,) = _descendant_pids(run.proc.pid, "LearnerActor")
        os.kill(learner, signal.SIGKILL)
    finally:
        code, out, err = run.finish(300)
        ref_code, ref_out, ref_err = ref.finish(900)
    assert code == 1, err[-3000:]
    assert ref_code == 0, ref_out[-3000:] + ref_err[-3000:]
    run.assert_no_leftovers()
    ref.assert_no_leftovers()

    run = _start(res_dir, *EXACT, "rollout.reward_fn=tests.reliability_helpers:exact",
                 f"trainer.resume_from={cut_dir}")
    code, out, err = run.finish(900)
    assert code == 0, out[-3000:] + err[-3000:]
    steps = lambda d: [json.loads(line) for line in (d / "trained_groups.jsonl").read_text().splitlines()]
    ref, cut, res = steps(ref_dir), steps(cut_dir), steps(res_dir)
    assert [s["step"] for s in res] == [4, 5, 6]
    # the same groups (ids name the worker's draw numbers), tickets and prompts, step by step
    assert [s["groups"] for s in cut[:3]] + [s["groups"] for s in res] == [s["groups"] for s in ref]
    # the same numbers step by step (which step parted, if any, before the weights say only that something did)
    losses = lambda d: [(r["step"], r["actor/pg_loss"], r["actor/mismatch_kl"])
                        for r in _records(d) if "actor/pg_loss" in r]
    assert losses(cut_dir)[:3] + losses(res_dir) == losses(ref_dir)
    want, got = _final_weights(ref_dir), _final_weights(res_dir)
    assert set(want) == set(got)
    from safetensors.torch import load_file

    step3 = load_file(str(cut_dir / "checkpoints" / "step_3" / "actor" / "model.safetensors"))
    assert any(not torch.equal(step3[name], t) for name, t in want.items())  # steps 4-6 did change the weights
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), f"{name} differs after resuming"
    run.assert_no_leftovers()


def test_a_learner_killed_in_the_final_evaluation_comes_back_to_finish_the_run(tmp_path):
    """The learner SIGKILLed after its last step and last checkpoint, while the engines evaluate the final weights
    (1,024 held-out prompts: a few seconds): the launcher restarts it from that checkpoint, it trains no step, pushes
    the weights, has them evaluated and writes ``final/``; exit 0. (Before, the restarted learner refused a
    checkpoint at ``total_steps``, "nothing to train", and the run ended with exit 1 and no final model.)"""
    out = tmp_path / "run"
    run = _start(out, "cluster.rollout_workers=1", "rollout.rollout_batch_size=2", "trainer.total_steps=3",
                 "trainer.save_every=3", "data.num_eval_prompts=1024",
                 "rollout.reward_fn=tests.reliability_helpers:exact")
    try:
        deadline = time.time() + 600
        latest = out / "checkpoints" / "latest"
        while not (latest.exists() and latest.read_text().strip() == "step_3"):  # written after step 3's record
            assert run.poll() is None and time.time() < deadline, run.output()[1][-3000:]
            time.sleep(0.05)
        (learner,) = _descendant_pids(run.proc.pid, "LearnerActor")
        os.kill(learner, signal.SIGKILL)  # in the final push or evaluation: its records show step 3 only
        assert not (out / "final").exists() and not (out / "summary.json").exists()
    finally:
        code, stdout, stderr = run.finish(600)
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    assert "learner died after step 3" in stderr and "learner restarted at step 3 (0 step(s) since the checkpoint " \
        "lost" in stderr, stderr[-3000:]
    assert "no step left to train (resumed from" in stdout, stdout[-3000:]
    records = _records(out)
    assert [r["step"] for r in _train_records(records)] == [1, 2, 3]  # no step trained twice
    final_eval = [r for r in records if r["step"] == 3 and "eval/accuracy_greedy" in r]
    assert final_eval and final_eval[-1]["eval/version_min"] == 3  # the final weights were evaluated
    assert (out / "final" / "model.safetensors").is_file()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["eval_after"]["accuracy_greedy"] == final_eval[-1]["eval/accuracy_greedy"]
    run.assert_no_leftovers()


def test_killed_learner_comes_back_by_itself(faulted_run):
    """Fault 1 of the run above, SIGKILL of the learner mid-run with checkpoints on: the launcher restarts it from
    the latest checkpoint, the rollout workers stay up and reconnect, the run finishes all its steps (exit 0), and
    the surviving steps trained every group once: no prompt trained twice, none lost beyond the re-drawn ones."""
    out, code, stdout, stderr = (faulted_run[key] for key in ("out", "code", "stdout", "stderr"))
    assert code == 0, stdout[-3000:] + stderr[-5000:]
    assert "learner died after step" in stderr and f"learner restarted at step {SAVE_EVERY}" in stderr, stderr[-3000:]
    records = _train_records(_records(out))
    lost = max(r["step"] for r in records[:next(i for i, r in enumerate(records) if r.get("learner/restarts"))])
    train = surviving_steps(records)
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert train[0]["learner/restarts"] == 0 and train[-1]["learner/restarts"] == 1
    assert train[-1]["learner/steps_lost"] == lost - SAVE_EVERY >= 2  # the steps since the checkpoint, trained again
    assert max(r["staleness/max"] for r in records) <= K
    # the workers stayed up: the same processes, reconnected to the new learner
    assert faulted_run["workers_after_restart"] == faulted_run["workers_before"]
    for i in faulted_run["workers_before"]:
        assert "the learner was restarted; reconnecting" in (out / "logs" / f"worker-{i}.log").read_text()
    # No prompt trained twice: the surviving steps' groups name distinct (worker, draw) pairs, B per step, and each
    # worker's draws form its sequence from 0 without a gap beyond the draws still in flight at the end.
    groups = _trained(out)
    assert len(groups) == STEPS * 4
    draws = [(g[0].split("-")[0].split(".")[0], int(g[0].split("-")[1])) for g in groups]
    assert len(set(draws)) == len(draws), "a prompt was trained twice"
    assert len({g[1] for g in groups}) == len(groups), "a ticket was trained twice"
    for w in {d[0] for d in draws}:
        mine = sorted(s for x, s in draws if x == w)
        assert len(set(range(mine[-1] + 1)) - set(mine)) <= 2 * 4, (w, mine)  # at most the groups in flight
    faulted_run["run"].assert_no_leftovers()
