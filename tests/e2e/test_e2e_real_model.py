"""The real-model path, without a hub: a multi-shard HF directory with a BPE tokenizer and a ChatML chat template
(tests/real_model_builder.py), GSM8K-format JSONL files, ``data=gsm8k`` with the math-verify reward, evaluation of
the eval file on the rollout engines, a checkpoint, and a second launch that resumes from it.

The model is taught one reflex before the run (answer every chat-formatted question with ``#### 7``), so the numbers
are known by hand: 6 of the 8 eval questions have the answer 7, so greedy accuracy is exactly 0.75; a training group
scores 1 when its question's answer is 7 and 0 otherwise, so each step's mean reward follows from which questions it
trained on (``trained_groups.jsonl`` names them).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from process_tags import TAG_VAR, assert_no_leftovers, new_tag
from real_model_builder import IM_END, IM_START, SYSTEM_PROMPT, build_real_model, gsm8k_rows, write_jsonl
from test_e2e_launch import _launch, _train_records

TRAIN_ANSWERS = [7, 12]  # row i's final number: 7 for even i, 12 for odd i
EVAL_ANSWERS = [7, 7, 7, 13]
RUN = ("data=gsm8k", "rollout.reward_fn=math", "rollout.prompt_length=96", "rollout.response_length=12",
       "rollout.rollout_batch_size=4", "rollout.num_return_sequences_in_group=4", "rollout.max_staleness=1",
       "trainer.save_every=2", "trainer.eval_every=2", "algorithm.use_kl_loss=true")


@pytest.fixture(scope="module")
def plain_model(tmp_path_factory) -> str:
    """Untrained, untied, multi-shard: for the structural checks (builds in well under a second)."""
    return build_real_model(tmp_path_factory.mktemp("real-plain"))


def _assert_no_leftovers(tag: str) -> None:
    assert_no_leftovers(tag)


def _shards(model_dir) -> tuple[dict, set]:
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    return index["weight_map"], set(index["weight_map"].values())


def test_builder_writes_a_multi_shard_chat_model(plain_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    weight_map, files = _shards(plain_model)
    assert len(files) >= 2 and all((Path(plain_model) / f).is_file() for f in files), files
    assert "lm_head.weight" in weight_map  # untied: the output layer is its own tensor
    model, info = AutoModelForCausalLM.from_pretrained(plain_model, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.head_dim == 64 and not model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(plain_model)
    assert tok.eos_token == IM_END and model.config.eos_token_id == tok.eos_token_id
    text = "Tom has 3 pens and gets 4 more."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text  # byte-level BPE round trip


def test_gsm8k_config_applies_the_chat_template(plain_model, tmp_path):
    """What ``data=gsm8k`` hands the engines: the question inside the ChatML turns, ending with the assistant header,
    tokenised with the template's special tokens as single ids; the answer is the number after ``####``."""
    from transformers import AutoTokenizer

    from asyncppo.config.loader import load_config
    from asyncppo.data.datasets import build_prompt_dataset

    rows = gsm8k_rows(6, seed=3, answers=[7, 12])
    train = write_jsonl(tmp_path / "train.jsonl", rows)
    cfg = load_config(["data=gsm8k", f"data.train_files=[{train}]", f"data.eval_files=[{train}]",
                       f"model.path={plain_model}", "rollout.prompt_length=96"])
    ds = build_prompt_dataset(cfg, plain_model, split="train")
    assert len(ds) == 6 and ds.stats.templated == 6
    tok = AutoTokenizer.from_pretrained(plain_model)
    first = ds[0]
    assert first.prompt == (f"{IM_START}system\n{SYSTEM_PROMPT}{IM_END}\n{IM_START}user\n{rows[0]['question']}"
                            f"{IM_END}\n{IM_START}assistant\n")
    assert first.answer == "7" and ds[1].answer == "12"
    start, end = tok.convert_tokens_to_ids([IM_START, IM_END])
    assert first.prompt_ids.count(start) == 3 and first.prompt_ids.count(end) == 2
    assert tok.decode(first.prompt_ids) == first.prompt
    cfg.data.apply_chat_template = False
    raw = build_prompt_dataset(cfg, plain_model, split="train")
    assert raw[0].prompt == rows[0]["question"] and raw.stats.templated == 0


def test_tied_multi_shard_model_gets_its_output_layer_pushed(tmp_path):
    """Tied embeddings in a sharded checkpoint: no shard holds ``lm_head.weight``; transformers ties it to the
    embedding, and both the push path and the vLLM engine's shape check (which reads every shard) know the engine
    must be sent ``lm_head.weight`` explicitly in fp32 on CPU (vLLM 0.32 keeps a stale copy otherwise)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from asyncppo.rollout.vllm_engine import VLLMEngine, tied_fp32
    from asyncppo.sync.engine_load import tied_alias_name

    tied = build_real_model(tmp_path / "tied", tied=True, max_shard_size="400KB")
    weight_map, files = _shards(tied)
    assert len(files) >= 2 and "lm_head.weight" not in weight_map
    model = AutoModelForCausalLM.from_pretrained(tied)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert "lm_head.weight" not in dict(model.named_parameters())  # what a push of parameters would omit
    assert tied_alias_name(tied, "float32") == "lm_head.weight" and tied_fp32(tied, "float32")
    assert tied_alias_name(tied, "bfloat16") is None
    shapes = VLLMEngine._checkpoint_shapes(SimpleNamespace(model_path=tied, _shapes=None))
    assert set(shapes) == set(weight_map)  # every shard read, not only the first
    assert tied_alias_name(build_real_model(tmp_path / "untied", max_shard_size="400KB"), "float32") is None


@pytest.mark.parametrize("response,answer,expected", [
    ("Tom has 3 + 4 = 7 pens.\n#### 7", "7", 1.0), ("#### 72", "72", 1.0), ("so she pays $1,200.\n#### 1200",
                                                                             "1200", 1.0),
    ("#### 7", "13", 0.0), ("I do not know", "7", 0.0),
])
def test_math_reward_on_gsm8k_responses_in_any_thread(response, answer, expected):
    from asyncppo.data.datasets import extract_final_answer
    from asyncppo.data.rewards import math_reward

    gold = extract_final_answer(f"work...\n#### {answer}")
    assert math_reward(response, gold) == expected
    got = {}
    th = threading.Thread(target=lambda: got.update(r=math_reward(response, gold)))  # as in a rollout worker
    th.start()
    th.join(60)
    assert got["r"] == expected


@pytest.mark.slow
def test_real_model_trains_evaluates_checkpoints_and_resumes(tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    tag = new_tag("e2e-real-model")
    monkeypatch.setenv(TAG_VAR, tag)  # inherited by every process the launches start

    model = build_real_model(tmp_path / "model", reflex_answer="7")
    _, files = _shards(model)
    assert len(files) >= 2
    train_rows = gsm8k_rows(32, seed=1, answers=TRAIN_ANSWERS)
    train = write_jsonl(tmp_path / "train.jsonl", train_rows)
    test = write_jsonl(tmp_path / "test.jsonl", gsm8k_rows(8, seed=2, answers=EVAL_ANSWERS))
    data = (f"data.train_files=[{train}]", f"data.eval_files=[{test}]", f"model.path={model}")
    reflex_len = len(AutoTokenizer.from_pretrained(model).encode("#### 7", add_special_tokens=False))

    first, second = tmp_path / "first", tmp_path / "second"
    proc, records = _launch(first, *RUN, *data, "trainer.total_steps=4", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "'templated': 32" in proc.stdout, proc.stdout[-3000:]  # every train prompt went through the template
    train_recs = _train_records(records)
    assert [r["policy_version"] for r in train_recs] == [1, 2, 3, 4]
    # the critic (GAE) and the frozen reference (KL loss) were loaded from the sharded directory too
    assert "critic/vf_loss" in train_recs[0] and "actor/kl_loss" in train_recs[0]
    assert all(r["reward/failed_frac"] == 0.0 for r in train_recs)  # math-verify ran in the worker, no errors
    # Each trained group scores 1 (answer 7: the reflex is right) or 0 (answer 12); at T=1 a sample may leave the
    # reflex (entropy ~0.03 nats/token), so allow 2 of a step's 16 samples to differ.
    run1 = first / "run"
    trained = [json.loads(line) for line in (run1 / "trained_groups.jsonl").read_text().splitlines()]
    rewards = {r["step"]: r["reward/mean"] for r in train_recs}
    for entry in trained:
        answers = [TRAIN_ANSWERS[index % 2] for _, _, index in entry["groups"]]
        expected = sum(a == 7 for a in answers) / len(answers)
        assert abs(rewards[entry["step"]] - expected) <= 2 / 16 + 1e-9, (entry, rewards)
    assert 0 < sum(rewards.values()) < len(rewards)  # both outcomes occurred: the reward is not constant
    evals = {r["step"]: r for r in records if "eval/test.jsonl/accuracy_greedy" in r}
    assert sorted(evals) == [0, 2, 4], records
    assert evals[0]["eval/test.jsonl/accuracy_greedy"] == 0.75  # 6 of 8 answers are 7, greedy says "#### 7"
    assert evals[0]["eval/test.jsonl/num_prompts"] == 8 and evals[4]["eval/version_min"] == 4
    assert evals[0]["eval/test.jsonl/length_mean"] == reflex_len  # "#### 7" then <|im_end|> (not counted)
    ckpts = run1 / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_4"
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_2", "step_4"]
    assert (ckpts / "step_4" / "actor" / "chat_template.jinja").is_file()  # the resumed engines keep the template
    _assert_no_leftovers(tag)

    proc, records = _launch(second, *RUN, *data, "trainer.total_steps=6", f"trainer.resume_from={run1}", timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "resuming from" in proc.stdout and "step_4" in proc.stdout
    assert "'templated': 32" in proc.stdout  # the checkpoint's tokenizer still formats the prompts
    train_recs = _train_records(records)
    assert [r["step"] for r in train_recs] == [5, 6] and [r["policy_version"] for r in train_recs] == [5, 6]
    assert train_recs[0]["staleness/max"] == 0  # the first batch came from the pushed step-4 weights
    assert train_recs[0]["actor/mismatch_kl"] < 1e-4  # ... which are the checkpoint's: engine and learner agree
    evals = {r["step"]: r for r in records if "eval/test.jsonl/accuracy_greedy" in r}
    assert 6 in evals and evals[6]["eval/version_min"] == 6 and evals[6]["eval/test.jsonl/accuracy_greedy"] == 0.75
    run2 = second / "run"
    assert (run2 / "checkpoints" / "latest").read_text().strip() == "step_6"
    state = torch.load(run2 / "checkpoints" / "step_6" / "trainer_state.pt", weights_only=True)
    assert state["version"] == 6 and state["extra"]["samples_trained"] == 6 * 4 * 4
    _assert_no_leftovers(tag)
