"""End to end: `asyncppo launch` on CPU with the real vLLM engine, ZeroMQ stream, gloo weight sync and Ray.

These runs take minutes; they are the proof that the parts add up to a trainer that learns while respecting the
staleness bound, and that a run leaves no process behind.
"""

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

from process_tags import TAG_VAR, assert_no_leftovers, new_tag

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ASYNCPPO = [sys.executable, "-m", "asyncppo"]


# Every process a launch in this module starts carries this tag in its environment (tests/process_tags.py).
TAG = new_tag("e2e-launch")


# The built-in task's recipe generates with transformers (configs/data/addition.yaml); these tests run the vLLM
# engine unless they say otherwise, so the product's main engine is what they exercise.
VLLM = "rollout.engine=vllm"


def _launch(tmp_path: Path, *overrides: str, timeout: int = 900,
            engine: str | None = VLLM) -> tuple[subprocess.CompletedProcess, list[dict]]:
    """``engine``: an override put before the test's own (None: the preset's engine, as a user gets it)."""
    out_dir = tmp_path / "run"
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", **{TAG_VAR: TAG})
    proc = subprocess.run(
        [*ASYNCPPO, "launch", f"trainer.output_dir={out_dir}", "trainer.logger.wandb=false",
         *([engine] if engine else []), *overrides],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )
    records = []
    metrics = out_dir / "metrics.jsonl"
    if metrics.exists():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return proc, records


def _launch_side_by_side(runs: dict[str, tuple[Path, tuple[str, ...]]], timeout: int = 900,
                         engine: str | None = VLLM, env: dict | None = None
                         ) -> dict[str, tuple[subprocess.CompletedProcess, list[dict], Path]]:
    """Several independent launches at once (``name -> (directory, overrides)``; ``engine`` and the run directory
    ``<directory>/run`` as in :func:`_launch`), each with its own local Ray cluster; returns what :func:`_launch`
    returns and the run directory, per name. ``env``: the launches' environment (default: this module's, tagged).
    Output goes to files, not pipes, so that no launch blocks on a full pipe while another is read."""
    env = env or dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", **{TAG_VAR: TAG})
    started = {}
    for name, (tmp_path, overrides) in runs.items():
        out_dir = tmp_path / "run"
        stdout, stderr = open(tmp_path / "stdout.txt", "w+"), open(tmp_path / "stderr.txt", "w+")
        args = [*ASYNCPPO, "launch", f"trainer.output_dir={out_dir}", "trainer.logger.wandb=false",
                *([engine] if engine else []), *overrides]
        started[name] = (out_dir, stdout, stderr, subprocess.Popen(args, cwd=REPO, env=env, stdout=stdout,
                                                                   stderr=stderr, text=True))
    deadline, results = time.time() + timeout, {}
    try:
        for name, (out_dir, stdout, stderr, proc) in started.items():
            proc.wait(timeout=max(1.0, deadline - time.time()))
            stdout.seek(0)
            stderr.seek(0)
            done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout.read(), stderr.read())
            metrics = out_dir / "metrics.jsonl"
            records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] \
                if metrics.exists() else []
            results[name] = (done, records, out_dir)
    finally:
        for _, stdout, stderr, proc in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            stdout.close()
            stderr.close()
    return results


@pytest.fixture(scope="module")
def side_by_side(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, list[dict], Path]]:
    """Three independent launches of the tests below, run at once (one launch's start-up and shutdown for the three;
    what each checks does not depend on timing): the synchronous run with eval files, the JSONL dataset with bad
    rows and a raising reward function, and the run whose worker dies. One after the other they took 42 + 26 + 23 s
    on the 2-core box."""
    from asyncppo.data.tasks import get_task

    dirs = {name: tmp_path_factory.mktemp(name) for name in ("sync", "jsonl", "dead")}
    rows = get_task("addition", seed=0, num_eval=256).splits().eval
    heldout = dirs["sync"] / "heldout.jsonl"
    heldout.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in rows))
    rows = get_task("addition", seed=0).splits().train[:200]
    lines = [json.dumps({"question": r["prompt"], "answer": f"so the sum is\n#### {r['answer']}"}) for r in rows]
    lines.insert(3, "{not json")
    lines.insert(7, json.dumps({"question": 12, "answer": "#### 1"}))
    lines.insert(9, json.dumps({"question": "9" * 80 + "+1=", "answer": "#### 1"}))
    data = dirs["jsonl"] / "train.jsonl"
    data.write_text("\n".join(lines) + "\n")
    (dirs["jsonl"] / "run").mkdir()
    (dirs["jsonl"] / "run" / "checkpoints").write_text("a file where the checkpoints go: every save fails")
    return _launch_side_by_side({
        "sync": (dirs["sync"], (f"data.eval_files=[{heldout}]", "trainer.total_steps=6", "trainer.eval_every=3",
                                "rollout.max_staleness=0")),
        "jsonl": (dirs["jsonl"], (f"data.train_files=[{data}]", "data.prompt_key=question", "data.answer_key=answer",
                                  "rollout.prompt_length=16", "rollout.overlong_prompt=skip", "trainer.total_steps=5",
                                  "trainer.save_every=2",
                                  "rollout.rollout_batch_size=8",
                                  "rollout.reward_fn=tests.failure_helpers:raise_sometimes_math")),
        # no replacement configured (tests/e2e/test_e2e_reliability.py covers restarts): the first death ends the
        # run; 8 prompts x 8 per step, so a few steps finish before the reward function's 300th call kills it
        "dead": (dirs["dead"], ("rollout.reward_fn=tests.failure_helpers:die_after_some",
                                "rollout.rollout_batch_size=8", "trainer.total_steps=200",
                                "cluster.max_worker_restarts=0", "data.num_eval_prompts=16")),
    })


def _train_records(records: list[dict]) -> list[dict]:
    return [r for r in records if "reward/mean" in r]


def _assert_no_leftovers() -> None:
    assert_no_leftovers(TAG)


def test_async_run_learns_within_staleness_bound(tmp_path):
    k = 2
    steps = 60  # the built-in recipe (128 prompts x 8 per step, 4 optimizer steps): 61,440 samples
    # the default exactly as `asyncppo launch` runs it (transformers engine); vLLM learning: the long-tailed test below
    proc, records = _launch(tmp_path, f"trainer.total_steps={steps}", f"rollout.max_staleness={k}", engine=None)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = _train_records(records)
    assert len(train) == steps
    for key in ("policy_version", "staleness/min", "staleness/mean", "staleness/max", "actor/approx_kl",
                "actor/clipfrac", "actor/entropy", "actor/mismatch_kl", "critic/explained_variance",
                "throughput/gen_tokens_per_s", "throughput/train_tokens_per_s", "util/rollout_busy",
                "util/train_busy", "time/step_s"):
        assert key in train[-1], key
    assert max(r["staleness/max"] for r in train) <= k
    # The bound is not trivially met by running synchronously: the workers do run ahead.
    assert max(r["staleness/max"] for r in train) >= 1
    # Training reward: 15 steps x 1024 samples per window; a window's standard error is about 0.01 (0.02 counting
    # the correlation within prompt groups), so a rise of 0.08 is > 4 sigma of the difference.
    first = sum(r["reward/mean"] for r in train[:15]) / 15
    last = sum(r["reward/mean"] for r in train[-15:]) / 15
    assert last - first > 0.08, (first, last)
    # Held-out prompts never trained on: 1024 sampled answers before and after (paired by prompt; standard error of
    # the difference ~0.02), and 256 greedy answers (~0.03). Measured by a k=1 launch after 50 steps: +0.18
    # sampled, +0.17 greedy (docs/benchmarks.md); the bounds are 5 and 2.5 standard errors.
    evals = [r for r in records if "eval/accuracy_sampled" in r]
    before, after = evals[0], evals[-1]
    assert after["eval/accuracy_sampled"] - before["eval/accuracy_sampled"] > 0.10, evals
    assert after["eval/accuracy_greedy"] - before["eval/accuracy_greedy"] > 0.07, evals
    _assert_no_leftovers()


def test_long_tailed_task_learns_with_continuous_generation_and_inflight_updates(tmp_path):
    """data=reverse (heavy-tailed response lengths) with continuous generation and in-flight weight updates: the
    policy learns, every trained token is within the bound, long samples are trained rather than dropped, and
    weight pushes do land while sequences are in flight (so some samples span two versions).

    Admitted one version ahead (``admission_lookahead=1``) under the bound ``k=2``: at ``j=k=2`` five runs gained
    +0.052, +0.150, +0.027, +0.098, +0.146 (two below the bound of 0.06: the lag, ~1.9, not the machinery, costs
    the accuracy; docs/benchmarks.md "Three seeds"), at ``j=1`` four runs gained +0.115, +0.148, +0.137, +0.079
    at lag ~0.96."""
    k, steps = 2, 40
    proc, records = _launch(tmp_path, "data=reverse", "algorithm=grpo", f"trainer.total_steps={steps}",
                            f"rollout.max_staleness={k}", "rollout.admission_lookahead=1", "rollout.max_num_seqs=64",
                            "trainer.eval_every=0")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = _train_records(records)
    assert len(train) == steps
    for key in ("rollout/occupancy", "rollout/inflight_updates", "staleness/token_mean", "waste/tokens_frac",
                "sync/push_s", "response_length/mean", "response_length/max"):
        assert key in train[-1], key
    assert max(r["staleness/max"] for r in train) <= k
    assert max(r["staleness/token_max"] for r in train) <= k  # per token too, not only per sample's oldest
    # fresh samples from the lookahead: ~1 version old, only stragglers trained behind later groups are older
    assert sum(r["staleness/mean"] for r in train) / steps <= 1.25
    assert train[-1]["waste/tokens_frac"] == 0.0
    assert max(r["response_length/max"] for r in train) >= 30  # the tail is trained, not dropped
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["buffer"]["dropped_stale"] == 0
    assert summary["rollout"]["inflight_updates"] > 0
    assert max(r["staleness/version_spread_max"] for r in train) >= 1  # a trained sample spans two versions
    # Held-out accuracy at T=1 on 1024 answers (256 prompts x 4): the warm start gives ~0.30, and 40 steps of
    # 128 samples lift it by ~0.15 (measured); the standard error of the difference is ~0.02.
    before, after = summary["eval_before"]["accuracy_sampled"], summary["eval_after"]["accuracy_sampled"]
    assert after - before > 0.06, (before, after)
    _assert_no_leftovers()


def test_skipped_groups_with_pushes_every_second_step_never_stall_the_run(tmp_path):
    """Dynamic sampling releases the ticket of every all-equal group, and the released ticket is granted again for
    the batch being trained. With pushes every second step that batch (at an odd version) used to need weights
    never pushed before it: the same launch on the code before the fix stopped after step 1 and waited until it
    was killed (docs/staleness.md). ``cluster.timeout_s`` is short so that a stall fails the test fast."""
    steps = 30
    proc, records = _launch(tmp_path, f"trainer.total_steps={steps}", "algorithm.dynamic_sampling=true",
                            "rollout.sync_every=2", "rollout.max_staleness=1", "rollout.rollout_batch_size=16",
                            "data.num_eval_prompts=16", "trainer.eval_every=0", "cluster.timeout_s=90",
                            engine=None, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = _train_records(records)
    assert len(train) == steps
    assert train[-1]["batch/skipped_groups_total"] > 0  # tickets were released and granted again
    assert max(r["staleness/max"] for r in train) <= 1
    _assert_no_leftovers()


def test_too_many_gpus_fails_fast_and_clear(tmp_path):
    proc, _ = _launch(tmp_path, "--rollout-gpus", "4", "--train-gpus", "4", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "GPU" in proc.stderr and "8" in proc.stderr, proc.stderr[-3000:]
    _assert_no_leftovers()


def test_unreadable_dataset_fails_clearly(tmp_path):
    missing = tmp_path / "nope.jsonl"
    proc, _ = _launch(tmp_path, f"data.train_files=[{missing}]", timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert str(missing) in proc.stderr
    _assert_no_leftovers()


def test_bad_override_fails_clearly(tmp_path):
    proc, _ = _launch(tmp_path, "algorithm.clip_ratio_c=0.5", timeout=120)
    assert proc.returncode == 2
    assert "clip_ratio_c" in proc.stderr and "0.5" in proc.stderr


def test_a_directory_holding_a_run_is_refused_and_left_alone(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    earlier = '{"step": 1, "reward/mean": 0.5}\n'
    (run_dir / "metrics.jsonl").write_text(earlier)
    proc, _ = _launch(tmp_path, timeout=120)
    assert proc.returncode == 2
    assert "already holds a run" in proc.stderr and "trainer.resume_from=" in proc.stderr
    assert (run_dir / "metrics.jsonl").read_text() == earlier  # nothing appended, nothing overwritten
    assert not (run_dir / "config.yaml").exists()


def test_jsonl_dataset_with_bad_rows_a_raising_reward_function_and_unwritable_checkpoints_trains(side_by_side):
    """A real dataset file: unreadable rows and over-long prompts are counted and skipped; a reward function that
    raises on every third call is counted per sample, told to the user once, and never kills the worker; checkpoints
    that cannot be written (a file where their directory goes) are told and counted, each save once; the run still
    trains to its end and writes its final model."""
    proc, records, run_dir = side_by_side["jsonl"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = _train_records(records)
    assert len(train) == 5
    # saves at steps 2 and 4 and the run's end (5): three warnings, each naming its step and the cause
    warned = [line for line in proc.stdout.splitlines() if "could not be written" in line]
    assert [line.split("checkpoint ")[1].split(" ")[0] for line in warned] == ["step_2", "step_4", "step_5"], warned
    assert all(line.startswith("[learner] [asyncppo] WARNING: ") and "FileExistsError" in line
               and "There is no checkpoint yet" in line for line in warned), warned
    assert "tries again at step 4" in warned[0] and "this was the run's last checkpoint" in warned[2]
    assert [r.get("checkpoint/failures", 0) for r in train] == [0, 0, 1, 1, 2]  # a step's save follows its record
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["checkpoint_failures"] == 3 and summary["steps"] == 5
    assert re.search(r"^checkpoints not written +\| 3 ", proc.stdout, re.M), proc.stdout[-3000:]
    assert (run_dir / "final" / "config.json").is_file()  # the trained model is still saved
    assert not (run_dir / ".tmp-final").exists()  # final/ is written aside and renamed when whole
    assert (run_dir / "checkpoints").read_text().startswith("a file where")  # left as the user had it
    out = proc.stdout + proc.stderr
    assert "'bad_rows': 2" in out and "'skipped_overlong': 1" in out, out[-3000:]
    # math-verify scores the GSM8K-style answers: the warm-started policy gets some of them right
    assert max(r["reward/mean"] for r in train) > 0
    # one call in three raises: about a third of the samples are scored as failed
    failed = sum(r["reward/failed_frac"] for r in train) / len(train)
    assert 0.25 < failed < 0.42, failed
    # the user is told, once and with the error, by the worker that saw it (not once per failure)
    told = [line for line in proc.stdout.splitlines() if "the reward function failed" in line]
    assert told and told[0].startswith("[worker-0] ") and "failed 1 time(s)" in told[0], proc.stdout[-3000:]
    assert len(told) <= 4, told
    _assert_no_leftovers()


def test_dead_worker_stops_the_run_with_a_clear_error(side_by_side):
    proc, records, _ = side_by_side["dead"]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "actor" in proc.stderr.lower() and ("died" in proc.stderr.lower() or "exit" in proc.stderr.lower()), \
        proc.stderr[-3000:]
    # what was trained before the failure is on disk, one record per finished step
    assert 0 < len(_train_records(records)) < 200
    _assert_no_leftovers()


def test_ctrl_c_and_sigterm_stop_everything(tmp_path):
    """Ctrl-C, and SIGTERM (``kill``, a scheduler's cancel or preemption) alike, stop every actor and the local Ray
    cluster. SIGTERM here gets the default grace: the learner finishes its step and writes a checkpoint of it first,
    so a resume loses no step; Ctrl-C here has none (``cluster.stop_grace_s=0``): no checkpoint, at once. The two
    launches run side by side (two local Ray clusters; each is signalled once it has logged two steps): one launch's
    start-up and shutdown time for both."""
    from asyncppo.learner.checkpoint import resolve_checkpoint
    from asyncppo.learner.run_files import latest_name

    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", **{TAG_VAR: TAG})
    runs = {}
    for name, signum, extra in (("ctrl-c", signal.SIGINT, ["cluster.stop_grace_s=0"]), ("sigterm", signal.SIGTERM, [])):
        out_dir = tmp_path / name
        runs[name] = (signum, out_dir / "metrics.jsonl", subprocess.Popen(
            [*ASYNCPPO, "launch", f"trainer.output_dir={out_dir}", "trainer.logger.wandb=false", VLLM,
             "trainer.total_steps=5000", "rollout.rollout_batch_size=16", "data.num_eval_prompts=16", *extra],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            # as from a terminal, whatever started pytest: a background job of a script inherits SIGINT ignored
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        ))
    deadline = time.time() + 300
    waiting = dict(runs)
    try:
        # two steps logged: mid-training, with the engine generating and a push behind it
        while waiting and time.time() < deadline:
            for name, (signum, metrics, proc) in list(waiting.items()):
                if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                    proc.send_signal(signum)
                    del waiting[name]
            time.sleep(1)
        assert not waiting, f"training never started in {sorted(waiting)}"
        outputs = {}
        for name, (signum, metrics, proc) in runs.items():
            outputs[name] = proc.communicate(timeout=120)
            assert proc.returncode == 130, (name, outputs[name][1][-3000:])
            assert "interrupted" in outputs[name][1], (name, outputs[name][1][-3000:])
        # SIGTERM: the checkpoint is of the last step the learner logged (save_every is 20; it stopped near 2)
        out, err = outputs["sigterm"]
        records = _train_records([json.loads(line) for line in runs["sigterm"][1].read_text().splitlines()])
        last = records[-1]["step"]
        assert 2 <= last < 20, last
        assert f"stopped at step {last} with checkpoint step_{last}; continue with the same command and " \
               f"trainer.resume_from={tmp_path / 'sigterm'}" in err, err[-3000:]
        assert resolve_checkpoint(str(tmp_path / "sigterm")).version == last
        summary = json.loads((tmp_path / "sigterm" / "summary.json").read_text())
        assert summary["stopped_at"] == last and summary["checkpoint"] == f"step_{last}"
        assert not (tmp_path / "sigterm" / "final").exists()  # the run is not done: no final model
        # Ctrl-C without a grace: no checkpoint, no waiting
        assert "writes a checkpoint" not in outputs["ctrl-c"][1] and latest_name(str(tmp_path / "ctrl-c")) is None
    finally:
        for _, _, proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    _assert_no_leftovers()


def test_synchronous_run_has_zero_lag_and_evaluates_eval_files_on_the_rollout_engines(side_by_side):
    """k=0: every trained token has lag 0, one version per step, and a clean console. data.eval_files runs on the
    rollout engines at step 0, every eval_every steps and on the final weights. The file holds the built-in task's
    held-out prompts, which the task's probe (the same engines, its own seeds and token budget) also scores at step 0
    and at the end: the two evaluations must agree."""
    proc, records, run_dir = side_by_side["sync"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = _train_records(records)
    assert len(train) == 6
    for r in train:
        assert r["staleness/min"] == r["staleness/max"] == 0, r
    assert [r["policy_version"] for r in train] == list(range(1, 7))
    # A clean console: one progress line per step from the driver, no Ray prefixes or colour codes, actor output
    # in the run directory's log files, and a summary table at the end.
    out = proc.stdout
    assert "pid=" not in out and "\x1b[" not in out, out[-3000:]
    progress = [line for line in out.splitlines() if line.startswith("step ") and "reward" in line]
    assert [line.split(" |")[0] for line in progress] == [f"step {i}/6" for i in range(1, 7)], out[-3000:]
    assert "run summary" in out and re.search(r"samples trained +\| 6,144\n", out), out[-3000:]  # 6 x 128 x 8
    logs = run_dir / "logs"
    assert (logs / "learner.log").stat().st_size > 0 and (logs / "worker-0.log").stat().st_size > 0
    assert "training started" in (logs / "learner.log").read_text()
    # the rollout actor was created before the learner and built its engine while the learner started
    early = re.search(r"engine build started ([0-9.]+)s before the learner's addresses came",
                      (logs / "worker-0.log").read_text())
    assert early and float(early.group(1)) > 0, (logs / "worker-0.log").read_text()[-2000:]

    engine_evals = {r["step"]: r for r in records if "eval/heldout.jsonl/accuracy_greedy" in r}
    assert sorted(engine_evals) == [0, 3, 6], records
    final = engine_evals[6]
    assert final["eval/version_min"] == 6 and final["eval/workers"] == 1  # the final weights were evaluated
    assert final["eval/heldout.jsonl/num_prompts"] == 256
    assert 1.0 < final["eval/heldout.jsonl/length_mean"] < 5.0  # 2-3 digits, eos not counted
    learner = [r for r in records if "eval/accuracy_greedy" in r]
    for engine_rec, learner_rec in ((engine_evals[0], learner[0]), (final, learner[-1])):
        # vLLM and transformers greedy agree except on near-ties: a few prompts of 256 at most
        assert abs(engine_rec["eval/heldout.jsonl/accuracy_greedy"] - learner_rec["eval/accuracy_greedy"]) <= 0.02, \
            (engine_rec, learner_rec)
    # 1024 sampled answers: the same distribution as the learner's sampled estimate, within noise (3 sigma ~ 0.06)
    assert abs(engine_evals[0]["eval/heldout.jsonl/accuracy_sampled"] - learner[0]["eval/accuracy_sampled"]) < 0.07
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_files"]["points"] == [0, 3, 6] and summary["eval_files"]["rejected"] == 0
    assert "heldout.jsonl/accuracy_greedy" in proc.stdout
    _assert_no_leftovers()
