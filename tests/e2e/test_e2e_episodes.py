"""End to end: a multi-turn run (``data=guess``, a scripted text environment) through `asyncppo launch` with the
real vLLM engine (prefix caching), ZeroMQ stream, gloo weight sync and Ray.

What it proves: the rollout worker runs episodes (several model turns with the environment's replies in between),
the learner trains those records (environment tokens in the response, masked out of the loss), the per-token
staleness bound holds across turns, the episode metrics reach metrics.jsonl and the console, the held-out rows are
played as games at the start and the end (``eval/success_*``) while a SkyRL-format eval file is evaluated as episodes,
environment faults of every kind are counted without losing a group, and `asyncppo report` reads the run.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from process_tags import TAG_VAR, assert_no_leftovers, new_tag

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ASYNCPPO = [sys.executable, "-m", "asyncppo"]
TAG = new_tag("e2e-episodes")
GUESS_K, GUESS_STEPS = 1, 8  # the guess game: max_staleness, steps
SKYRL_STEPS, SKYRL_MAX_TURNS = 4, 3  # the SkyRL rows run


def _env() -> dict:
    """The tagged environment of this module's commands, with tests/ on the path of a run's actors too: they import
    the environments from tests/episode_envs.py."""
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONPATH=path, **{TAG_VAR: TAG})


def _run(args: list, timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([*ASYNCPPO, *args], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def episode_runs(tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    """The two launches of this module, side by side (test_e2e_launch.py's ``_launch_side_by_side``: two local Ray
    clusters; what each checks does not depend on timing: one launch's start-up and shutdown for both, which one
    after the other took 43 + 33 s on the 2-core box). Each returns its completed process and run directory; the
    chat model is built once for both. Without skyrl-gym only the guess game runs (its test then skips, saying so)."""
    import importlib.util

    from test_e2e_launch import _launch_side_by_side
    from vllm_required import require_vllm

    require_vllm()
    from asyncppo.envs.examples import build_chat_model

    root = tmp_path_factory.mktemp("episodes")
    model = build_chat_model(str(root / "chat-model"))
    runs = [("guess", _guess_args)] + ([("skyrl", _skyrl_args)] if importlib.util.find_spec("skyrl_gym") else [])
    dirs = {name: root / name for name, _ in runs}
    for d in dirs.values():
        d.mkdir()
    done = _launch_side_by_side({name: (dirs[name], args(model, dirs[name])) for name, args in runs}, engine=None,
                                env=_env())
    return {name: (proc, run_dir) for name, (proc, _, run_dir) in done.items()}


def _guess_args(model: str, tmp_path: Path) -> tuple:
    k, steps = GUESS_K, GUESS_STEPS
    return ("data=guess", f"model.path={model}", f"trainer.total_steps={steps}", f"rollout.max_staleness={k}",
            f"rollout.admission_lookahead={k}", "rollout.rollout_batch_size=8",
            "rollout.num_return_sequences_in_group=4", "rollout.max_num_seqs=16",
            "data.num_eval_prompts=16", f"data.eval_files=[{_eval_rows(tmp_path)}]",
            "env.text_env=episode_envs.FaultyGuessEnv", "env.on_error=zero_reward", "env.step_timeout_s=2",
            "env.max_concurrency=64")


def _skyrl_args(model: str, tmp_path: Path) -> tuple:
    """Four SkyRL-format rows (and a bad one) with distinct ground truths, for RowTruthEnv."""
    truths = [10, 20, 30, 40]
    lines = [json.dumps({"prompt": [{"role": "user", "content": f"a question about {t}"}], "env_class": "gsm8k",
                         "reward_spec": {"method": "rule", "ground_truth": str(t)}, "extra_info": {"i": i}})
             for i, t in enumerate(truths)]
    lines.insert(2, json.dumps({"prompt": "a text prompt", "reward_spec": {"ground_truth": "5"}}))  # bad: skipped
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(lines) + "\n")
    return ("data=guess", f"model.path={model}", f"trainer.total_steps={SKYRL_STEPS}", "rollout.max_staleness=1",
            "rollout.admission_lookahead=1", "rollout.rollout_batch_size=8",
            "rollout.num_return_sequences_in_group=4", "rollout.max_num_seqs=16",
            "rollout.response_length=384", f"data.train_files=[{rows}]",
            "env.text_env=episode_envs.RowTruthEnv", "+env.text_env_config.truth_bonus=1.0",
            f"env.max_turns={SKYRL_MAX_TURNS}", "env.on_error=drop")


def test_guess_episodes_train_end_to_end_within_the_bound(episode_runs):
    """The guess game with scripted faults by hidden number (tests/episode_envs.py: FaultyGuessEnv) under
    ``env.on_error=zero_reward``: an ``init`` that raises drops its group (its ticket is given back); a step that
    hangs past ``env.step_timeout_s``, a malformed observation and a NaN reward each end their episode with reward
    0 and the group trains. Every kind is counted, no group is lost, and the run trains every step within the
    bound. Beside it, SkyRL-format ``data.eval_files`` are evaluated as episodes (:func:`_eval_rows`)."""
    proc, out_dir = episode_runs["guess"]
    k, steps = GUESS_K, GUESS_STEPS
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == steps
    # episodes of several turns: a random policy rarely guesses right at once, so most episodes run to max_turns
    assert max(r["episodes/turns_max"] for r in train) >= 2
    assert all(1.0 <= r["episodes/turns_mean"] <= r["episodes/turns_max"] <= 4 for r in train), train[-1]
    assert sum(r["episodes/turns_mean"] for r in train) / steps > 2.5  # measured: 3.8
    # the environment's replies are in the trained sequences (~0.83 of their tokens, measured) and out of the loss:
    # the learner's loss-mask length is at most 4 turns x 4 model tokens, the sequences are longer (tests/component/
    # test_episodes.py and the learner's unit tests check the mask token by token)
    assert all(0.3 < r["episodes/env_token_frac"] < 0.99 for r in train), [r["episodes/env_token_frac"] for r in train]
    assert all(r["response_length/mean"] <= 16 < r["response_length/max"] for r in train), train[-1]
    _assert_faults_counted_and_no_group_lost(out_dir, train, steps)
    # (a random policy does emit <tool_call> tokens now and then: counted as tool errors, the run goes on)
    assert all(r["episodes/tool_errors"] >= 0 and r["episodes/env_s_per_step"] >= 0 for r in train)
    assert max(r["staleness/max"] for r in train) <= k
    assert train[-1]["policy_version"] == steps
    # the console shows the episode metrics; the held-out rows were played as games at start and end (success: the
    # share solved, among them the games whose init raises: 0)
    assert "turns " in proc.stdout and "envtok " in proc.stdout, proc.stdout[-3000:]
    summary = json.loads((out_dir / "summary.json").read_text())
    for when in ("eval_before", "eval_after"):
        assert 0.0 <= summary[when]["success_sampled"] <= 1.0 and "success_greedy" in summary[when], summary
    # the eval file's episodes: two free wins (1.0 each) and two games whose init raises (dropped: 0), greedy and
    # sampled, at the first point and the last
    for point in ("first", "last"):
        scores = {k.rsplit("/", 1)[-1]: v for k, v in summary["eval_files"][point].items() if "eval_rows" in k}
        assert scores["num_prompts"] == 4 and scores["accuracy_greedy"] == scores["accuracy_sampled"] == 0.5, scores
    report = _run(["report", str(out_dir)], timeout=300)
    assert report.returncode == 0, report.stdout[-2000:] + report.stderr[-3000:]
    assert_no_leftovers(TAG)


def _eval_rows(tmp_path: Path) -> Path:
    """A SkyRL-format eval file for FaultyGuessEnv: two rows that win at once and two whose ``init`` raises."""
    rows = [{"prompt": [{"role": "user", "content": f"eval game {i}"}], "env_class": "guess", "target": target,
             **({"free_win": True} if target else {})} for i, target in enumerate([5, 0, 7, 0])]
    path = tmp_path / "eval_rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _assert_faults_counted_and_no_group_lost(out_dir: Path, train: list, steps: int) -> None:
    """Every fault kind of FaultyGuessEnv is counted (step metrics and the worker's closing totals); only groups
    whose ``init`` raised were dropped (four episodes, four raises each); every granted ticket was started, and
    every started group was sent, dropped or still in flight when the run stopped."""
    kinds = ("raised", "timeout", "malformed", "nonfinite_reward")
    by_kind = {k: sum(r[f"episodes/env_faults_{k}"] for r in train) for k in kinds}
    assert all(v >= 1 for v in by_kind.values()), by_kind
    assert sum(r["episodes/env_faults"] for r in train) == sum(by_kind.values())
    logs = "".join(p.read_text(errors="replace") for p in (out_dir / "logs").glob("*.log"))
    tally = re.search(r"episode groups started (\d+), sent (\d+), dropped (\d+), in flight at stop (\d+), "
                      r"abandoned by a learner restart 0, tickets not started (\d+); env faults (\{[^}]*\})", logs)
    assert tally is not None, logs[-3000:]
    started, sent, dropped, in_flight, not_started = map(int, tally.groups()[:5])
    faults = ast.literal_eval(tally.group(6))
    assert all(faults[k] >= by_kind[k] for k in kinds), (faults, by_kind)
    assert started == sent + dropped + in_flight, tally.group(0)
    assert dropped >= 1 and 4 * dropped <= faults["raised"], tally.group(0)  # init faults only: 4 raises a group
    drops = re.findall(r"group \S+ dropped \((.*)\); its ticket is given back", logs)
    assert len(drops) == dropped and all("init: RuntimeError" in d for d in drops), drops[:5]
    assert sent >= 8 * steps  # every trained group was sent (and the learner trained 8 x steps of them)
    summary = json.loads((out_dir / "summary.json").read_text())
    granted = sum(summary["admission"]["granted_by_worker"].values())
    assert granted >= started + not_started, (granted, tally.group(0))  # a grant may still be on its way
    assert summary["samples_trained"] == 8 * 4 * steps


def test_skyrl_rows_launch_episodes_of_their_own_rows(episode_runs):
    """``data.train_files`` in SkyRL's format (a bad row among them) with skyrl-gym's multi-turn GSM8K environment
    (tests/episode_envs.py: RowTruthEnv adds ``truth_bonus`` x the row's ground truth at the last turn): the worker
    draws the rows, each episode's environment gets its row's messages, extras, ``env.max_turns`` and
    ``env.text_env_config``, and the run trains every step on multi-turn episodes."""
    pytest.importorskip("skyrl_gym")
    proc, out_dir = episode_runs["skyrl"]
    steps, max_turns = SKYRL_STEPS, SKYRL_MAX_TURNS
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "'bad_rows': 1" in proc.stdout, proc.stdout[-3000:]  # the worker's start line: the bad row was skipped
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == steps and train[-1]["policy_version"] == steps
    # every episode's reward is its own row's ground truth (10..40) plus GSM8K's own score (at most 1 + 0.2)
    assert all(10 <= r["reward/min"] and r["reward/max"] <= 41.2 for r in train), train[-1]
    # different rows reached different episodes: the lowest and the highest truth both show (measured: 10 and 40
    # in every step, mean 25: each step's 8 groups are two passes over the 4 rows)
    assert min(r["reward/min"] for r in train) < 11 and max(r["reward/max"] for r in train) >= 40, train
    # no init saw another row's messages (a mismatch would drop its group), and episodes ran several turns
    assert sum(r["episodes/dropped_groups"] for r in train) == 0
    assert all(r["episodes/turns_max"] == max_turns for r in train), [r["episodes/turns_max"] for r in train]
    assert sum(r["episodes/turns_mean"] for r in train) / steps > 2.5
    assert_no_leftovers(TAG)
