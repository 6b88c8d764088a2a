"""The built-in long-tailed task ``reverse``: splits, length distribution, tokenizer, preset, model build, eval."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from asyncppo.data.rewards import exact_match, resolve_reward_fn
from asyncppo.data.tasks import ReverseTask, get_task
from asyncppo.data.tiny import build_tokenizer, ensure_builtin_model


@pytest.fixture(scope="module")
def splits():
    return get_task("reverse", seed=0, num_eval=256).splits()


def _pct(xs: list[int], q: float) -> int:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def test_rows_are_reversals_and_splits_deterministic_and_disjoint(splits):
    task = get_task("reverse", seed=0)
    assert isinstance(task, ReverseTask) and task.name == "reverse" and task.max_response_tokens == 49
    assert task.row("cabd") == {"prompt": "cabd>", "answer": "dbac"}
    assert len(splits.eval) == 256 and len(splits.train) == 20000
    for r in splits.train + splits.eval:
        assert r["prompt"].endswith(">") and r["prompt"][:-1][::-1] == r["answer"]
        assert 1 <= len(r["answer"]) <= 48 and set(r["answer"]) <= set("abcdefghijklmnop")
    assert get_task("reverse", seed=0).splits() == splits
    assert get_task("reverse", seed=1).splits().eval != splits.eval
    # held out: no eval prompt is ever a train prompt
    assert {r["prompt"] for r in splits.eval}.isdisjoint({r["prompt"] for r in splits.train})
    # long strings are distinct (only the tiny spaces of lengths 1-3 are drawn with replacement)
    long_eval = [r["prompt"] for r in splits.eval if len(r["answer"]) > 3]
    assert len(long_eval) == len(set(long_eval)) > 100
    # other parameters: lengths stay in [1, max_len]
    small = get_task("reverse", seed=3, num_eval=50, max_len=10, num_train=500).splits()
    assert len(small.eval) == 50 and len(small.train) == 500
    assert all(1 <= len(r["answer"]) <= 10 for r in small.train + small.eval)
    assert {r["prompt"] for r in small.eval}.isdisjoint({r["prompt"] for r in small.train})
    with pytest.raises(ValueError, match="max_len"):
        get_task("reverse", max_len=0)


def test_length_distribution_is_heavy_tailed(splits):
    lens = [len(r["answer"]) for r in splits.train]
    median, p90, p99 = _pct(lens, 0.5), _pct(lens, 0.9), _pct(lens, 0.99)
    mean = sum(lens) / len(lens)
    # measured (seed 0): median 5, mean 7.2, p90 16, p99 35, max 48; 10% of rows >= 16, 3.5% >= 25
    assert median <= 6 and max(lens) >= 46
    assert p99 / median >= 4 and p90 / median >= 2.5 and mean > median + 1
    assert 0.05 <= sum(n >= 16 for n in lens) / len(lens) <= 0.2
    assert sum(n >= 25 for n in lens) / len(lens) >= 0.02
    # the held-out split follows the same distribution
    ev = [len(r["answer"]) for r in splits.eval]
    assert abs(_pct(ev, 0.5) - median) <= 1 and _pct(ev, 0.99) >= 2 * median


def test_tokenizer_round_trips_prompts_and_answers(splits):
    task = get_task("reverse")
    tok = build_tokenizer(task.alphabet())
    assert set(task.alphabet()) == set("abcdefghijklmnop>")
    for r in splits.eval[:50] + splits.train[:50]:
        for text in (r["prompt"], r["answer"]):
            ids = tok.encode(text, add_special_tokens=False)
            assert len(ids) == len(text) and tok.unk_token_id not in ids
            assert tok.decode(ids) == text


def test_registry_reward_and_preset_compose():
    from asyncppo.config import load_config

    assert resolve_reward_fn("auto", task="reverse") is exact_match
    cfg = load_config(["data=reverse"])
    assert cfg.data.task == "reverse" and cfg.model.path == "builtin:tiny-reverse"
    assert cfg.data.train_files == [] and cfg.data.apply_chat_template is False
    task = get_task(cfg.data.task, seed=cfg.data.seed, num_eval=cfg.data.num_eval_prompts)
    assert cfg.rollout.response_length >= task.max_len + 1
    assert cfg.rollout.prompt_length >= task.max_len + 1
    assert cfg.trainer.sft_warmup_steps > 0


def test_evaluator_generates_up_to_the_tasks_longest_answer(monkeypatch):
    import asyncppo.data.warmstart as ws
    from asyncppo.config import load_config
    from asyncppo.data.heldout import task_probe

    seen = []
    monkeypatch.setattr(ws, "answer_accuracy", lambda model, tok, rows, **kw: seen.append((len(rows), kw)) or 0.5)

    class _Model:
        training = True

        def train(self, mode=True):
            self.training = mode

    for overrides, max_new in ((["data=reverse"], 49), ([], 5)):
        seen.clear()
        out = task_probe(load_config(overrides)).evaluate(_Model(), tokenizer=None)
        assert out == {"accuracy_sampled": 0.5, "accuracy_greedy": 0.5}
        assert [kw["max_new_tokens"] for _, kw in seen] == [max_new, max_new]
        assert [n for n, _ in seen] == [4 * 256, 256]


def test_builtin_tiny_reverse_builds_and_loads(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_builtin_model("tiny-reverse", cache_dir=str(tmp_path), sft_steps=3, verbose=False)
    assert Path(path).parent == tmp_path and Path(path).name.startswith("tiny-reverse-")
    build = json.loads((Path(path) / "build.json").read_text())
    assert build["params"]["task"] == "reverse" and build["params"]["sft"]["length_buckets"] == 4
    assert build["sft"]["steps"] == 3 and 0.0 <= build["sft"]["sampled_acc"] <= 1.0
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(path)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads == 64
    assert not cfg.tie_word_embeddings and cfg.max_position_embeddings >= 2 * 49
    assert cfg.vocab_size == len(tok) and tok.decode(tok.encode("abc>", add_special_tokens=False)) == "abc>"
    ids = torch.tensor([tok.encode("abc>", add_special_tokens=False)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert out.shape[0] == 1 and out.shape[1] <= ids.shape[1] + 4
    assert ensure_builtin_model("tiny-reverse", cache_dir=str(tmp_path), sft_steps=3, verbose=False) == path
