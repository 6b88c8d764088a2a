"""End to end: `asyncppo launch` with checkpoints, then a second launch that resumes from the first run's directory.

The resumed run must continue the step and version numbering, keep the staleness bound, and generate its first
batch with the checkpoint's weights (not the initial model's): its behaviour log-probs then match the learner's
proximal log-probs, which the learner reports as ``actor/mismatch_kl``.

Both launches run DAPO (``algorithm=dapo``), so the first one is also the run on which DAPO's dynamic sampling is
checked: one launch where there were two of nearly the same configuration (8 groups per step, k=1, 6 steps).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_e2e_launch import _assert_no_leftovers, _launch, _train_records

pytestmark = pytest.mark.slow

K = 1
GROUPS, FIRST_STEPS = 8, 6
COMMON = (f"rollout.rollout_batch_size={GROUPS}", f"rollout.max_staleness={K}", "trainer.save_every=3",
          "data.num_eval_prompts=16", "trainer.eval_every=0", "trainer.lr=1e-3", "algorithm=dapo")


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, tiny_model_dir) -> tuple[Path, subprocess.CompletedProcess, list[dict]]:
    """The run that is resumed below and whose dynamic sampling is checked: launched once for both tests."""
    first_dir = tmp_path_factory.mktemp("first")
    proc, records = _launch(first_dir, f"model.path={tiny_model_dir}", f"trainer.total_steps={FIRST_STEPS}", *COMMON)
    return first_dir, proc, records


def _policy_gap(initial_dir: str, ckpt_actor_dir: str) -> float:
    """Mean per-token k3 KL between the initial model and the checkpoint's actor on answers the checkpoint samples:
    the mismatch the resumed run would report if its workers generated with the initial model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncppo import algo

    tok = AutoTokenizer.from_pretrained(ckpt_actor_dir)
    new = AutoModelForCausalLM.from_pretrained(ckpt_actor_dir).eval()
    old = AutoModelForCausalLM.from_pretrained(initial_dir).eval()
    torch.manual_seed(0)
    prompts = [f"{a:02d}+{b:02d}=" for a, b in zip(range(3, 99, 7), range(91, 0, -6))]
    ids = torch.tensor([tok.encode(p) for p in prompts])
    with torch.no_grad():
        out = new.generate(ids, do_sample=True, temperature=1.0, max_new_tokens=4, num_return_sequences=4,
                           pad_token_id=tok.pad_token_id)
        resp = out[:, ids.shape[1]:]
        lp = lambda m: torch.log_softmax(m(out).logits[:, ids.shape[1] - 1:-1].float(), -1).gather(
            -1, resp.unsqueeze(-1)).squeeze(-1)
        kl = algo.kl_penalty(lp(new), lp(old), "k3")
    return float(kl.mean())


def test_dynamic_sampling_skips_all_equal_groups_and_still_fills_every_batch(first_run):
    """DAPO's dynamic sampling in the stream (learner/dynamic_sampling.py): all-equal groups are skipped, their tickets
    released and refilled, every step still trains ``rollout_batch_size`` groups, and the staleness bound holds."""
    steps, k, groups = FIRST_STEPS, K, GROUPS
    first_dir, proc, records = first_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    train = _train_records(records)
    assert [r["policy_version"] for r in train] == list(range(1, steps + 1))
    skipped = [r["batch/skipped_groups"] for r in train]
    # the warm-started model answers some prompts always right (8 of 8), others never: such groups come every step
    assert sum(skipped) > 0, skipped
    assert train[-1]["batch/skipped_groups_total"] == sum(skipped)
    # the cap (dynamic_sampling_max_skip=0: 4 x the batch) bounds every step; it is reached when the policy's answers
    # become deterministic (measured once in a full-suite run), and then the step trains the groups as they come
    assert all(s <= 4 * groups for s in skipped), skipped
    assert max(r["staleness/max"] for r in train) <= k
    lines = [json.loads(x) for x in (first_dir / "run" / "trained_groups.jsonl").read_text().splitlines()]
    assert [len(x["groups"]) for x in lines] == [groups] * steps  # the batch is filled, not shrunk
    _assert_no_leftovers()


def test_resume_continues_steps_versions_and_weights(first_run, tmp_path, tiny_model_dir):
    first_dir, proc, records = first_run
    second_dir = tmp_path / "second"
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run1 = first_dir / "run"
    ckpts = run1 / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_6"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_3", "step_6"]
    assert (run1 / "final" / "config.json").is_file()
    assert [r["policy_version"] for r in _train_records(records)] == [1, 2, 3, 4, 5, 6]
    _assert_no_leftovers()

    proc, records = _launch(second_dir, f"model.path={tiny_model_dir}", "trainer.total_steps=9",
                            f"trainer.resume_from={run1}", *COMMON)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resuming from" in proc.stdout and "step_6" in proc.stdout
    train = _train_records(records)
    assert [r["step"] for r in train] == [7, 8, 9]
    assert [r["policy_version"] for r in train] == [7, 8, 9]
    assert all(r["staleness/max"] <= K for r in train), [r["staleness/max"] for r in train]
    # The first batch can only come from the pushed version-6 weights: lag 0 at step 7.
    assert train[0]["staleness/max"] == 0
    # ... and those weights are the checkpoint's: the engine's log-probs agree with the learner's (float noise),
    # far below the gap to the initial model that generating with it would show.
    gap = _policy_gap(tiny_model_dir, str(ckpts / "step_6" / "actor"))
    first_mismatch = train[0]["actor/mismatch_kl"]
    print(f"first resumed mismatch_kl {first_mismatch:.3g}; initial-vs-checkpoint KL {gap:.3g}")
    assert first_mismatch < 1e-4 and first_mismatch < gap / 20, (first_mismatch, gap)
    run2 = second_dir / "run"
    assert (run2 / "checkpoints" / "latest").read_text().strip() == "step_9"
    state = torch.load(run2 / "checkpoints" / "step_9" / "trainer_state.pt", weights_only=True)
    assert state["version"] == 9 and state["extra"]["samples_trained"] == 9 * 8 * 8
    assert (run2 / "final" / "config.json").is_file()
    assert json.loads((run2 / "checkpoints" / "step_9" / "meta.json").read_text())["version"] == 9
    _assert_no_leftovers()


def test_resume_without_checkpoint_fails_clearly(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty"
    os.makedirs(empty)
    proc, _ = _launch(tmp_path, f"model.path={tiny_model_dir}", f"trainer.resume_from={empty}", timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "no checkpoint found" in proc.stderr and str(empty) in proc.stderr
