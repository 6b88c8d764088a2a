"""Tasks, the tiny model builder and cache, prompt datasets and reward functions."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path

import pytest

from asyncppo.data.datasets import PromptDataset, extract_final_answer, read_rows
from asyncppo.data.rewards import exact_match, math_reward, resolve_reward_fn, score_safely
from asyncppo.data.tasks import AdditionTask, get_task
from asyncppo.data.tiny import _cache_key, build_tokenizer, ensure_builtin_model


# ----------------------------------------------------------------------------- tasks
def test_addition_rows_and_disjoint_deterministic_splits():
    task = get_task("addition", seed=0, num_eval=256)
    s = task.splits()
    assert len(s.eval) == 256 and len(s.train) == 10000 - 256
    assert {r["prompt"] for r in s.eval}.isdisjoint({r["prompt"] for r in s.train})
    for r in s.train[:50] + s.eval[:50]:
        a, b = r["prompt"][:-1].split("+")
        assert len(a) == len(b) == 2 and r["prompt"].endswith("=")
        assert r["answer"] == str(int(a) + int(b))
    assert AdditionTask().row(7, 45) == {"prompt": "07+45=", "answer": "52"}
    assert get_task("addition", seed=0).splits().eval == s.eval
    assert get_task("addition", seed=1).splits().eval != s.eval
    with pytest.raises(ValueError, match="unknown task 'subtraction'"):
        get_task("subtraction")


# ----------------------------------------------------------------------------- tokenizer / builder
def test_char_tokenizer_roundtrip():
    tok = build_tokenizer()
    for text in ["07+45=", "52", "99+99=198"]:
        ids = tok.encode(text)
        assert len(ids) == len(text)
        assert tok.decode(ids) == text
    assert tok.encode("0") != tok.encode("1")
    assert tok.pad_token_id == 0 and tok.eos_token_id is not None and tok.eos_token_id != tok.pad_token_id
    assert tok.decode(tok.encode("12") + [tok.eos_token_id], skip_special_tokens=True) == "12"


def test_builtin_model_loads_and_is_untied_fp32(random_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    tok = AutoTokenizer.from_pretrained(random_model_dir)
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.hidden_size // cfg.num_attention_heads == 64
    assert not cfg.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert cfg.vocab_size == len(tok)
    assert next(model.parameters()).dtype.is_floating_point and str(next(model.parameters()).dtype) == "torch.float32"
    assert any(p.suffix == ".safetensors" for p in Path(random_model_dir).iterdir())


def test_builtin_cache_is_reused_and_keyed_by_parameters(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCPPO_CACHE", str(tmp_path))
    a = ensure_builtin_model(sft_steps=0, verbose=False)
    assert Path(a).parent == tmp_path and (Path(a) / "build.json").is_file()
    mtime = os.path.getmtime(Path(a) / "model.safetensors")
    assert ensure_builtin_model(sft_steps=0, verbose=False) == a  # cached: not rebuilt
    assert os.path.getmtime(Path(a) / "model.safetensors") == mtime
    b = ensure_builtin_model(sft_steps=0, seed=1, verbose=False)
    assert b != a
    assert _cache_key("tiny-addition", {"sft_steps": 300}) != _cache_key("tiny-addition", {"sft_steps": 150})
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]  # no temporary build left behind
    with pytest.raises(ValueError, match="unknown builtin model 'huge'"):
        ensure_builtin_model("huge")


# ----------------------------------------------------------------------------- datasets
@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def test_gsm8k_answer_extraction():
    assert extract_final_answer("She has 3 + 4 = 7 apples.\n#### 7") == "7"
    assert extract_final_answer("a #### b\n#### 1,234") == "1234"
    assert extract_final_answer(" 42 ") == "42"


def test_jsonl_bad_rows_counted_and_skipped(tmp_path, tok, caplog):
    f = tmp_path / "train.jsonl"
    lines = [
        json.dumps({"question": "01+02=", "answer": "work\n#### 3"}),
        "{not json",
        json.dumps({"question": "05+05="}),  # missing answer
        json.dumps({"question": 7, "answer": "1"}),  # prompt not a string
        "",  # blank lines are not rows
        json.dumps([1, 2]),  # not an object
        json.dumps({"question": "10+10=", "answer": 20}),  # numeric answers are fine
    ]
    f.write_text("\n".join(lines) + "\n")
    with caplog.at_level(logging.WARNING):
        ds = PromptDataset.from_files([str(f)], tok, prompt_key="question", answer_key="answer")
    assert [(it.prompt, it.answer) for it in ds] == [("01+02=", "3"), ("10+10=", "20")]
    assert ds.stats.rows_read == 6 and ds.stats.bad_rows == 4
    assert any(f"{f}:2: invalid JSON" in m for m in caplog.messages)
    assert any(f"{f}:3: missing key 'answer'" in m for m in caplog.messages)
    assert any(f"{f}:4:" in m and "'question'" in m for m in caplog.messages)
    assert ds[0].prompt_ids == tok.encode("01+02=")


def test_parquet_rows_and_bad_rows(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = tmp_path / "train.parquet"
    pq.write_table(pa.table({"prompt": ["01+01=", None, "02+02="], "answer": ["2", "x", None]}), str(f))
    ds = PromptDataset.from_files([str(f)], tok)
    assert [(it.prompt, it.answer) for it in ds] == [("01+01=", "2")]
    assert ds.stats.rows_read == 3 and ds.stats.bad_rows == 2
    assert any("train.parquet:2:" in m for m in ds.stats.bad_examples)


def test_missing_or_unreadable_file_raises(tmp_path, tok):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        PromptDataset.from_files([str(tmp_path / "nope.jsonl")], tok)
    bad = tmp_path / "corrupt.parquet"
    bad.write_bytes(b"not a parquet file")
    with pytest.raises(ValueError, match="corrupt.parquet"):
        PromptDataset.from_files([str(bad)], tok)
    with pytest.raises(ValueError, match="'.csv'"):
        (tmp_path / "x.csv").write_text("a,b\n")
        PromptDataset.from_files([str(tmp_path / "x.csv")], tok)


def test_overlong_prompts_truncated_left_or_skipped(tok):
    rows = [{"prompt": "01+02=", "answer": "3"}, {"prompt": "1234567890+=", "answer": "0"}]
    t = PromptDataset(rows, tok, prompt_length=6, overlong="truncate")
    assert len(t) == 2 and t.stats.truncated == 1 and t.stats.skipped_overlong == 0
    assert t[1].prompt_ids == tok.encode("7890+=")  # the end of the prompt is kept
    s = PromptDataset(rows, tok, prompt_length=6, overlong="skip")
    assert [it.prompt for it in s] == ["01+02="] and s.stats.skipped_overlong == 1 and s.stats.truncated == 0
    with pytest.raises(ValueError, match="overlong='drop'"):
        PromptDataset(rows, tok, overlong="drop")


def test_chat_template_applied_only_when_asked_and_present(tok):
    rows = [{"prompt": "01+02=", "answer": "3"}]
    plain = PromptDataset(rows, tok, apply_chat_template=True)  # no template: prompt unchanged
    assert plain[0].prompt == "01+02="
    templ = build_tokenizer()
    templ.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}+{% endif %}"
    assert PromptDataset(rows, templ, apply_chat_template=True)[0].prompt == "01+02=+"
    assert PromptDataset(rows, templ, apply_chat_template=False)[0].prompt == "01+02="


def test_sharding_disjoint_and_complete_and_iteration(tok):
    ds = PromptDataset.from_task(get_task("addition"), tok, split="eval")
    shards = [ds.shard(w, 3) for w in range(3)]
    idx = [sorted(it.index for it in s) for s in shards]
    assert sum(len(i) for i in idx) == len(ds) == 256
    assert sorted(sum(idx, [])) == list(range(256))
    assert max(len(i) for i in idx) - min(len(i) for i in idx) <= 1
    it = shards[1].iterate(seed=5)
    epoch1 = [next(it).index for _ in range(len(shards[1]))]
    epoch2 = [next(it).index for _ in range(len(shards[1]))]
    assert sorted(epoch1) == sorted(epoch2) == idx[1] and epoch1 != epoch2  # reshuffled each epoch
    again = shards[1].iterate(seed=5)
    assert [next(again).index for _ in range(len(epoch1))] == epoch1  # deterministic by seed
    with pytest.raises(ValueError, match="worker_id=3"):
        ds.shard(3, 3)


# ----------------------------------------------------------------------------- rewards
def test_exact_match():
    assert exact_match(" 52\n", "52") == 1.0
    assert exact_match("520", "52") == 0.0
    assert exact_match("", "52") == 0.0


@pytest.mark.parametrize(
    "response,answer,expected",
    [("0.5", "1/2", 1.0), ("\\boxed{42}", "42", 1.0), ("so it is \\boxed{\\frac{1}{2}}", "0.5", 1.0),
     ("the answer is 41", "42", 0.0), ("no number here", "3", 0.0), ("first 3 then 7", "7", 1.0)],
)
def test_math_reward_equivalences(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_math_reward_works_off_the_main_thread():
    result = {}
    th = threading.Thread(target=lambda: result.update(r=score_safely(math_reward, "\\boxed{1/2}", "0.5")))
    th.start()
    th.join(60)
    assert result["r"] == (1.0, False, None)


def always_half(response_text, answer, **kw):
    return 0.5


def raises(response_text, answer, **kw):
    raise RuntimeError("boom")


def test_resolve_reward_fn(tmp_path, monkeypatch):
    pkg = tmp_path / "myrewards"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scoring.py").write_text("def quarter(response_text, answer, **kw):\n    return 0.25\nNOT_CALLABLE = 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert resolve_reward_fn("exact_match") is exact_match
    assert resolve_reward_fn("math") is math_reward
    assert resolve_reward_fn("auto", builtin_task=True) is exact_match
    assert resolve_reward_fn("auto", builtin_task=False) is math_reward
    assert resolve_reward_fn("auto", task="addition") is exact_match
    assert resolve_reward_fn("auto", task=None) is math_reward
    assert resolve_reward_fn("myrewards.scoring:quarter")("x", "y") == 0.25
    assert resolve_reward_fn("myrewards.scoring.quarter")("x", "y") == 0.25
    assert resolve_reward_fn("os.path:join") is os.path.join
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        resolve_reward_fn("myrewards.scoring:missing")
    with pytest.raises(ValueError, match="non-callable int"):
        resolve_reward_fn("myrewards.scoring:NOT_CALLABLE")
    with pytest.raises(ValueError, match="cannot import module 'no_such_pkg.mod'"):
        resolve_reward_fn("no_such_pkg.mod:fn")
    with pytest.raises(ValueError, match="'bogus'"):
        resolve_reward_fn("bogus")


def test_score_safely_counts_failures():
    assert score_safely(always_half, "x", "y") == (0.5, False, None)
    r, failed, err = score_safely(raises, "x", "y")
    assert (r, failed) == (0.0, True) and "RuntimeError: boom" in err
    r, failed, err = score_safely(lambda *a, **k: float("nan"), "x", "y")
    assert (r, failed) == (0.0, True) and "non-finite" in err
    r, failed, err = score_safely(lambda *a, **k: "high", "x", "y")
    assert (r, failed) == (0.0, True) and "ValueError" in err


def test_read_rows_default_keys(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"prompt": "p", "answer": "a"}) + "\n")
    assert read_rows([str(f)]) == [{"prompt": "p", "answer": "a"}]


def test_build_prompt_dataset_from_config(tmp_path, random_model_dir):
    from asyncppo.config.schema import AsyncPPOConfig
    from asyncppo.data.datasets import build_prompt_dataset

    cfg = AsyncPPOConfig()
    cfg.data.num_eval_prompts = 64
    train = build_prompt_dataset(cfg, random_model_dir, split="train")
    ev = build_prompt_dataset(cfg, random_model_dir, split="eval")
    assert len(ev) == 64 and len(train) == 10000 - 64
    assert {it.prompt for it in ev}.isdisjoint(it.prompt for it in train)
    assert all(len(it.prompt_ids) == 6 for it in ev)
    f = tmp_path / "gsm.jsonl"
    f.write_text(json.dumps({"question": "12+30=" * 20, "answer": "... #### 42"}) + "\n")
    cfg.data.train_files, cfg.data.prompt_key = [str(f)], "question"
    cfg.rollout.prompt_length, cfg.rollout.overlong_prompt = 10, "skip"
    skipped = build_prompt_dataset(cfg, random_model_dir)
    assert len(skipped) == 0 and skipped.stats.skipped_overlong == 1
    cfg.rollout.overlong_prompt = "truncate"
    (item,) = build_prompt_dataset(cfg, random_model_dir)
    assert len(item.prompt_ids) == 10 and item.answer == "42"
    with pytest.raises(ValueError, match="eval_files"):
        build_prompt_dataset(cfg, random_model_dir, split="eval")
