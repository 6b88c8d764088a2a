"""The supervised warm start must turn a random policy into one that PPO has something to improve."""

from __future__ import annotations

import time

import torch

from asyncppo.data.tasks import get_task
from asyncppo.data.tiny import build_tiny_model
from asyncppo.data.warmstart import answer_accuracy, encode_rows, supervised_warmstart

SFT_STEPS = 150


def test_encode_rows_masks_answer_and_eos_only():
    from asyncppo.data.tiny import build_tokenizer

    tok = build_tokenizer()
    ids, attn, mask = encode_rows(tok, [{"prompt": "01+02=", "answer": "3"}, {"prompt": "99+99=", "answer": "198"}])
    assert ids.shape == (2, 10)
    assert tok.decode(ids[1].tolist()) == "99+99=198<eos>"
    assert mask[0].tolist() == [0] * 6 + [1, 1, 0, 0] and attn[0].tolist() == [1] * 8 + [0, 0]
    assert mask[1].tolist() == [0] * 6 + [1] * 4


def test_warmstart_improves_heldout_accuracy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = build_tiny_model(str(tmp_path / "m"), seed=0)
    task = get_task("addition", seed=0)
    held_out = task.splits().eval[:128]
    tok = AutoTokenizer.from_pretrained(d)
    before = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    acc0_greedy = answer_accuracy(before, tok, held_out, temperature=0.0)
    acc0_sampled = answer_accuracy(before, tok, held_out, temperature=1.0)
    t0 = time.time()
    report = supervised_warmstart(d, task, steps=SFT_STEPS, seed=0, eval_rows=128, verbose=False)
    elapsed = time.time() - t0
    after = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)  # the trained weights were saved
    acc1_greedy = answer_accuracy(after, tok, held_out, temperature=0.0)
    acc1_sampled = answer_accuracy(after, tok, held_out, temperature=1.0)
    print(
        f"\nwarm start {SFT_STEPS} steps in {elapsed:.1f}s (train {report['train_s']}s): "
        f"greedy {acc0_greedy:.3f} -> {acc1_greedy:.3f}, sampled {acc0_sampled:.3f} -> {acc1_sampled:.3f}"
    )
    assert acc1_greedy == report["greedy_acc"]  # the saved model is the one that was evaluated
    assert acc0_greedy <= 0.02 and acc0_sampled <= 0.02
    # seeded and single-threaded, so deterministic here: measured greedy 0.109, sampled 0.070 after 150 steps
    assert acc1_greedy >= 0.06 and acc1_sampled >= 0.03
    assert acc1_greedy > acc0_greedy + 0.05
