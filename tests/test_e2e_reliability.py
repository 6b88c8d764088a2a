"""End to end: runs that survive a rollout worker killed mid-run, and report a stopped one by name in time.

Real Ray, vLLM (CPU), ZeroMQ and gloo, as in tests/test_e2e_launch.py. The faults are injected from outside, with
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

from test_e2e_launch import ASYNCPPO, REPO, _assert_no_leftovers, _train_records

pytestmark = pytest.mark.slow

SMALL = ("trainer.logger.wandb=false", "rollout.rollout_batch_size=4", "data.num_eval_prompts=16",
         "trainer.eval_every=0", "cluster.rollout_workers=2")


def _start(out_dir: Path, *overrides: str) -> subprocess.Popen:
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1")
    return subprocess.Popen([*ASYNCPPO, "launch", f"trainer.output_dir={out_dir}", *SMALL, *overrides], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


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


def _wait_for_step(proc: subprocess.Popen, out_dir: Path, step: int, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"run ended early ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}")
        if len(_train_records(_records(out_dir))) >= step:
            return
        time.sleep(0.5)
    raise AssertionError(f"step {step} not reached in {timeout_s}s")


def _trained(out_dir: Path) -> list[list]:
    lines = (out_dir / "trained_groups.jsonl").read_text().splitlines()
    return [g for line in lines for g in json.loads(line)["groups"]]


def test_killed_worker_is_replaced_and_the_run_completes(tmp_path):
    k, steps = 1, 40
    out = tmp_path / "run"
    proc = _start(out, f"trainer.total_steps={steps}", f"rollout.max_staleness={k}", "cluster.max_worker_restarts=2",
                  "rollout.reward_fn=tests.reliability_helpers:exact_slow_while_marked")
    try:
        _wait_for_step(proc, out, 5)
        pids = _worker_pids(out)
        assert sorted(pids) == [0, 1], pids
        # the survivor slows down until the replacement is up, so the replacement has steps left to take part in
        (out / "SLOW").touch()
        os.kill(pids[1], signal.SIGKILL)
        deadline = time.time() + 600
        while _worker_pids(out).get(1) == pids[1] and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        (out / "SLOW").unlink()
        stdout, stderr = proc.communicate(timeout=900)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    assert "rollout worker 1 died" in stderr and "starting a replacement" in stderr, stderr[-3000:]
    train = _train_records(_records(out))
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    assert train[-1]["workers/restarts"] == 1 and train[0]["workers/restarts"] == 0
    assert max(r["staleness/max"] for r in train) <= k
    # No group trained twice: every trained group id and every trained ticket is unique, B per step.
    groups = _trained(out)
    assert len(groups) == steps * 4
    assert len({g[0] for g in groups}) == len(groups), "a group id was trained twice"
    assert len({g[1] for g in groups}) == len(groups), "a ticket was trained twice"
    # The replacement (incarnation 1 of worker 1) joined the weight sync, resumed the worker's prompt sequence and
    # its groups were trained (group ids "1.1-<draw>"), within the staleness bound like every other group.
    log = (out / "logs" / "worker-1.log").read_text()
    assert "rollout worker 1 (incarnation 1, from draw" in log, log[-2000:]
    replaced = [g for g in groups if g[0].startswith("1.1-")]
    assert replaced, "no group of the replacement was trained"
    first_draw = int(re.search(r"incarnation 1, from draw (\d+)", log).group(1))
    assert min(int(g[0].split("-")[1]) for g in replaced) >= first_draw
    _assert_no_leftovers()


def test_stopped_worker_is_named_within_the_timeout(tmp_path):
    timeout = 60
    out = tmp_path / "run"
    proc = _start(out, "trainer.total_steps=400", "rollout.max_staleness=1", f"cluster.timeout_s={timeout}")
    stopped = None
    try:
        _wait_for_step(proc, out, 3)
        pids = _worker_pids(out)
        stopped = pids[1]
        os.kill(stopped, signal.SIGSTOP)
        t_stop = time.time()
        stdout, stderr = proc.communicate(timeout=4 * timeout + 120)
        elapsed = time.time() - t_stop
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-3000:]
    # The learner names the late worker and what it waited for: its tickets, or the weights pushed to it.
    assert re.search(r"rollout worker(\(s\))? \[?1\]?( \(incarnation \d+\))? (late|did not take)", stderr), \
        stderr[-3000:]
    assert "cluster.timeout_s" in stderr
    # Reported within the deadline (plus the shutdown): not the 10-minute default, not a hang.
    assert elapsed < timeout + 60, elapsed
    assert len(_train_records(_records(out))) < 400
    _assert_no_leftovers()


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


EXACT = ("cluster.rollout_workers=1", "rollout.max_staleness=0", "rollout.rollout_batch_size=2",
         "rollout.num_return_sequences_in_group=4", "rollout.max_num_seqs=4", "rollout.sampling.seed=0", "trainer.save_every=3",
         "trainer.total_steps=6", "trainer.lr=1e-3")


def _final_weights(run: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(run / "final" / "model.safetensors"))


def test_killed_learner_resumes_exactly(tmp_path):
    """k=0, one worker: a run whose learner is SIGKILLed after its step-3 checkpoint, resumed from it, trains the
    prompt sequence of a run that never stopped, and ends with bit-identical weights."""
    ref_dir, cut_dir, res_dir = tmp_path / "ref", tmp_path / "cut", tmp_path / "res"
    proc = _start(ref_dir, *EXACT, "rollout.reward_fn=tests.reliability_helpers:exact")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]

    proc = _start(cut_dir, *EXACT, "rollout.reward_fn=tests.reliability_helpers:exact_then_hang")
    try:
        _wait_for_step(proc, cut_dir, 4)  # step 4 is trained; the worker hangs in step 5's first group
        assert (cut_dir / "checkpoints" / "latest").read_text().strip() == "step_3"
        (learner,) = _descendant_pids(proc.pid, "LearnerActor")
        os.kill(learner, signal.SIGKILL)
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err[-3000:]
    _assert_no_leftovers()

    proc = _start(res_dir, *EXACT, "rollout.reward_fn=tests.reliability_helpers:exact",
                  f"trainer.resume_from={cut_dir}")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    steps = lambda run: [json.loads(line) for line in (run / "trained_groups.jsonl").read_text().splitlines()]
    ref, cut, res = steps(ref_dir), steps(cut_dir), steps(res_dir)
    assert [s["step"] for s in res] == [4, 5, 6]
    # the same groups (ids name the worker's draw numbers), tickets and prompts, step by step
    assert [s["groups"] for s in cut[:3]] + [s["groups"] for s in res] == [s["groups"] for s in ref]
    want, got = _final_weights(ref_dir), _final_weights(res_dir)
    assert set(want) == set(got)
    from safetensors.torch import load_file

    step3 = load_file(str(cut_dir / "checkpoints" / "step_3" / "actor" / "model.safetensors"))
    assert any(not torch.equal(step3[name], t) for name, t in want.items())  # steps 4-6 did change the weights
    for name, tensor in want.items():
        assert torch.equal(tensor, got[name]), f"{name} differs after resuming"
    _assert_no_leftovers()
