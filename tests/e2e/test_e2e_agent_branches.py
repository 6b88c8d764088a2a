"""End to end: an agent that rewrites its history, trained with every branch (``env.agent_branches=all``) through
`asyncppo launch` (real vLLM, the aiohttp endpoint, ZeroMQ, gloo, Ray).

What it proves: groups that carry more samples than episodes (each episode's earlier branch beside its final one)
pass the learner's door and train, the branches are counted in the step metrics, and the held-out evaluation counts
one answer per episode (its final branch), not one per branch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from process_tags import TAG_VAR, assert_no_leftovers, new_tag

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
TAG = new_tag("e2e-agent-branches")
STEPS, B, N, EVAL_ROWS = 3, 4, 4, 8


def test_every_branch_of_a_rewriting_agent_trains(tmp_path):
    from vllm_required import require_vllm

    require_vllm()
    from asyncppo.envs.examples import build_chat_model

    model = build_chat_model(str(tmp_path / "chat-model"))
    path = os.pathsep.join(p for p in (str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, WANDB_MODE="offline", PYTHONUNBUFFERED="1", PYTHONPATH=path, **{TAG_VAR: TAG})
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "asyncppo", "launch", "data=calculator_agent", f"model.path={model}",
         "env.agent=agent_programs:summarising_agent", "env.agent_branches=all", f"trainer.output_dir={out}",
         "trainer.logger.wandb=false", f"trainer.total_steps={STEPS}", f"rollout.rollout_batch_size={B}",
         f"rollout.num_return_sequences_in_group={N}", "rollout.max_num_seqs=32", f"data.num_eval_prompts={EVAL_ROWS}",
         "trainer.eval_every=0"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    train = [r for r in records if "reward/mean" in r]
    assert len(train) == STEPS
    # every episode branches once and keeps its first branch: B x N episodes a step, 2 samples each. (The worker's
    # counts ride on the groups it sends, evaluation episodes' included: their sum covers the trained episodes.)
    assert sum(r["episodes/branches"] for r in train) >= STEPS * B * N, [r["episodes/branches"] for r in train]
    assert all(r["episodes/branch_tokens_dropped"] == 0 for r in train)
    assert train[-1]["samples_trained"] == STEPS * B * N * 2, train[-1]["samples_trained"]
    # held-out: one answer per episode (1 greedy + 4 sampled per row), whatever the branches
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] and all(0.0 <= v <= 1.0 for v in summary["eval_after"].values())
    evals = [r for r in records if "eval/num_prompts" in r]
    assert evals and all(r["eval/num_prompts"] == EVAL_ROWS for r in evals), evals
    assert_no_leftovers(TAG)
