"""End to end: `asyncppo launch env=cartpole` through real Ray, ZeroMQ (segment records), admission tickets, gloo
weight broadcast and gymnasium. The policy must learn by a margin noise cannot fake while every trained env step
stays within the staleness bound, a run must survive a killed learner, a killed env worker and an environment that
stops returning, and no run may leave a process behind."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _env_actors(run_dir: Path) -> list[str]:
    """Actor processes of *this* run: Ray actors whose stdout is a log file under ``run_dir`` (launch/console.py
    redirects every actor's output there), so other runs on a shared machine do not count."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    mine = []
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if not args.startswith("ray::"):
            continue
        try:
            target = os.readlink(f"/proc/{pid}/fd/1")
        except OSError:
            continue
        if target.startswith(str(run_dir)):
            mine.append(line.strip())
    return mine


def test_cartpole_learns_through_the_asynchronous_machinery(tmp_path):
    k, steps = 2, 110
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncppo", "launch", "env=cartpole", f"trainer.total_steps={steps}",
         f"rollout.max_staleness={k}", f"trainer.output_dir={out}", "trainer.logger.wandb=false"],
        cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "env_steps" in r]
    assert len(train) == steps
    assert train[-1]["env_steps"] == steps * 8 * 32
    for key in ("episode/return_recent", "throughput/env_steps_per_s", "staleness/max", "staleness/token_mean",
                "util/rollout_busy", "util/train_busy", "actor/approx_kl", "actor/clipfrac", "actor/is_weight_mean",
                "critic/vf_loss", "policy_version", "time/wall_s"):
        assert key in train[-1], key
    walls = [r["time/wall_s"] for r in train]  # the training clock the progress line's eta reads
    assert walls == sorted(walls) and walls[0] > 0
    assert any(line.startswith("step ") and " | eta " in line for line in proc.stdout.splitlines())
    # Every trained env step was chosen by weights at most k versions old; the workers do run ahead.
    assert max(r["staleness/max"] for r in train) <= k
    assert max(r["staleness/max"] for r in train) >= 1
    # A uniformly random CartPole policy lasts ~22 steps; 110 steps of 256 transitions reach > 150 (measured:
    # ~190-260 in the last ten steps). Each window averages dozens of episodes, so the gap is far beyond noise.
    returns = [r["episode/return_mean"] for r in train if "episode/return_mean" in r]
    first = sum(returns[:5]) / 5
    last = sum(returns[-10:]) / 10
    assert first < 50, returns[:5]
    assert last > 150, returns[-10:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["buffer"]["dropped_stale"] == 0
    assert sum(summary["rejected"].values()) == 0
    deadline = time.time() + 20
    while _env_actors(out) and time.time() < deadline:
        time.sleep(1)
    assert not _env_actors(out), f"processes left behind: {_env_actors(out)}"


def _records(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip().endswith("}")]


def _wait(proc: subprocess.Popen, out: Path, what, timeout_s: float = 600) -> None:
    deadline = time.time() + timeout_s
    while not what():
        assert proc.poll() is None, f"the run ended early ({proc.returncode})"
        assert time.time() < deadline, "timed out"
        time.sleep(0.5)


def _pids(out: Path, marker: str) -> list[int]:
    """Pids of this run's actor processes whose command line contains ``marker`` (see :func:`_env_actors`)."""
    return [int(line.split()[0]) for line in _env_actors(out) if marker in line]


def _reconnected_workers(out: Path) -> int:
    """How many worker logs say the worker moved to a restarted learner."""
    logs = [p.read_text(errors="replace") for p in (out / "logs").glob("worker-*.log")]
    return sum("the learner was restarted; reconnecting" in text for text in logs)


# CartPole-v1 whose step can be made to raise or to never return (tests/gym_envs.py), named in gymnasium's
# module:id form
FAULTY_ENV = "tests.gym_envs:FaultyCartPole-v1"


def test_cartpole_survives_a_raising_environment_a_killed_learner_a_killed_worker_and_a_wedged_environment(
        tmp_path):
    """One launch, four faults, one after the other:

    0. after step 2, one environment's ``step`` raises: its worker makes a fresh vector env and collects the segment
       again (no restart), and the learner reports it as ``env/errors``;
    1. SIGKILL the learner after a checkpoint: the launcher restarts it from there, the env workers stay up and
       reconnect, and the restarted learner continues the checkpoint's training state;
    2. SIGKILL an env worker: it is replaced;
    3. once that death is seen, one environment's ``step`` stops returning (a wedged simulator): its worker
       answers the launcher's pings but makes no progress, is found hung after ``cluster.hang_timeout_s=10``, killed
       through Ray and replaced; the environment is let go once the hang was reported. ``cluster.push_timeout_s=60``:
       at its default (the hang timeout) the missed weight push names the same worker at the same moment (it did,
       first, in a trial run), and this part is about the progress rule.

    The run finishes every step within the staleness bound. (Learning is the run above's, without faults: a
    CartPole run through three faults learns too, but with a spread a learning margin cannot be set on.)"""
    k, steps, every, hang_s = 1, 30, 5, 10
    out, wedge, raising = tmp_path / "run", tmp_path / "WEDGE", tmp_path / "RAISE"
    err_file = tmp_path / "err.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "asyncppo", "launch", "env=cartpole", f"env.id={FAULTY_ENV}",
         f"+env.kwargs.wedge_file={wedge}", f"+env.kwargs.raise_file={raising}", f"trainer.total_steps={steps}",
         f"rollout.max_staleness={k}",
         f"trainer.output_dir={out}", "trainer.logger.wandb=false", "cluster.rollout_workers=2",
         f"trainer.save_every={every}", f"cluster.hang_timeout_s={hang_s}", "cluster.push_timeout_s=60"],
        cwd=REPO, env=dict(os.environ, PYTHONUNBUFFERED="1"), stdout=open(tmp_path / "out.txt", "w"),
        stderr=open(err_file, "w"), text=True)  # files, not pipes: nothing fills up
    try:
        _wait(proc, out, lambda: len(_records(out)) >= 2)
        raising.touch()
        _wait(proc, out, lambda: any(r.get("env/errors") for r in _records(out)))  # trained, before the faults below
        _wait(proc, out, lambda: len(_records(out)) >= 7)
        (learner,) = _pids(out, "EnvLearnerActor")
        os.kill(learner, signal.SIGKILL)
        _wait(proc, out, lambda: any(r.get("learner/restarts") for r in _records(out)[-1:])
              and _records(out)[-1]["step"] >= 12)
        # both workers moved to the new learner before one is killed (on a loaded box one worker can feed the
        # learner to step 12 while the other has not taken its next turn yet; killing that one first would leave
        # its replacement, which connects fresh, nothing to report)
        _wait(proc, out, lambda: _reconnected_workers(out) == 2)
        worker = max(_pids(out, "EnvRolloutActor"))
        os.kill(worker, signal.SIGKILL)
        _wait(proc, out, lambda: "rollout worker" in err_file.read_text())  # the death was seen: now the wedge
        wedge.touch()
        wedged_at, wedged_step = time.time(), _records(out)[-1]["step"]
        _wait(proc, out, lambda: " hung (" in err_file.read_text())
        print(f"wedged at step {wedged_step}; reported hung {time.time() - wedged_at:.1f}s after the wedge file "
              "appeared")
        for claimed in tmp_path.glob("WEDGE*"):
            claimed.unlink()  # the wedged process is being killed; its replacement's environments step normally
        proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stdout, stderr = (tmp_path / "out.txt").read_text(), err_file.read_text()
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    # the kill lands after step 7 or, on a fast box, a few steps later: the restart is from the latest checkpoint
    restarted = re.search(r"learner restarted at step (\d+)", stderr)
    assert restarted and "died" in stderr and "starting a replacement" in stderr, stderr[-3000:]
    ckpt = int(restarted.group(1))
    assert ckpt >= every and ckpt % every == 0, ckpt
    records = [r for r in _records(out) if "env_steps" in r]
    restart = next(i for i, r in enumerate(records) if r["learner/restarts"])
    assert records[restart]["step"] == ckpt + 1  # the new learner went on from the checkpoint
    assert records[restart]["learner/steps_lost"] == records[restart - 1]["step"] - ckpt
    # its env-step count was restored from the checkpoint: it counts only the steps that survived
    assert records[restart]["env_steps"] == (ckpt + 1) * 8 * 32
    assert records[-1]["step"] == steps and records[-1]["env_steps"] == steps * 8 * 32
    assert max(r["staleness/max"] for r in records) <= k
    logs = {p.name: p.read_text() for p in (out / "logs").glob("worker-*.log")}
    assert _reconnected_workers(out) == 2
    assert any(re.search(r"env worker \d \(incarnation 1\): pid", text) for text in logs.values())
    # the raising environment: recovered in its worker (no restart; the two below are the kill and the wedge)
    assert sum(r.get("env/errors", 0) for r in records) == 1
    told = [line for line in stdout.splitlines() if "the environment raised in step" in line]
    assert len(told) == 1 and "scripted error (raise_file)" in told[0] and told[0].startswith("[worker-"), told
    # the wedged environment: its worker answered pings without progress, and was replaced
    m = re.search(r"rollout worker (\d) hung \(no progress \(decode or env step, group sent\) for (\d+)s while "
                  r"generating \(hang timeout (\d+)s\)\); killing it and starting a replacement \(restart 2 of at "
                  r"most 3 within 3600s\)", stderr)
    assert m, stderr[-3000:]
    hung, still, timeout = (int(g) for g in m.groups())
    assert timeout == hang_s and hang_s <= still < hang_s + 30, (still, timeout)
    incarnations = re.findall(r"env worker \d \(incarnation (\d+)\): pid", logs[f"worker-{hung}.log"])
    assert incarnations and max(map(int, incarnations)) >= 1, logs[f"worker-{hung}.log"][-2000:]
    assert records[-1]["workers/hung"] == 1 and records[-1]["workers/restarts"] == 2, records[-1]
    deadline = time.time() + 20
    while _env_actors(out) and time.time() < deadline:
        time.sleep(1)
    assert not _env_actors(out), f"processes left behind: {_env_actors(out)}"
