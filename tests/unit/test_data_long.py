"""The built-in long-generation task ``long``: the working, the splits, the length distribution, the reward, the
preset, and the refusal of a sequence longer than the model's context or the engine's KV cache."""

from __future__ import annotations

import json

import pytest

from asyncppo.config import load_config
from asyncppo.data.long_task import LongTask, little_endian, long_working
from asyncppo.data.rewards import resolve_reward_fn
from asyncppo.data.tasks import get_task
from asyncppo.data.tiny import BUILTIN_MODELS, build_tokenizer
from asyncppo.launch.context_check import check_sequence_fits
from asyncppo.launch.resolve import LaunchError, resolve_plan


@pytest.fixture(scope="module")
def splits():
    return get_task("long", seed=0, num_eval=256).splits()


def _pct(xs: list[int], q: float) -> int:
    return sorted(xs)[int(q * (len(xs) - 1))]


def _value(digits: str) -> int:
    return int(digits[::-1])


def test_the_working_is_repeated_subtraction_written_little_endian():
    assert little_endian(42) == "2400" and little_endian(1853) == "3581"
    # 42 mod 7 by hand: 35, 28, 21, 14, 7, 0 -> remainder 0
    assert LongTask.row(42, 7) == {"prompt": "7:2400,", "answer": "5300,8200,1200,4100,7000,0000=0"}
    # 23 mod 9: 14, 5 -> 5 (the last value is the first below 9)
    assert LongTask.row(23, 9) == {"prompt": "9:3200,", "answer": "4100,5000=5"}
    task = get_task("long")
    assert isinstance(task, LongTask) and task.max_response_tokens == 5 * 205 + 2
    with pytest.raises(ValueError, match="max_steps"):
        get_task("long", max_steps=5000)


def test_splits_are_correct_deterministic_and_disjoint(splits):
    assert len(splits.eval) == 256 and len(splits.train) == 20000
    for r in splits.train[:3000] + splits.eval:
        d, n = int(r["prompt"][0]), _value(r["prompt"][2:6])
        working, answer = r["answer"].split("=")
        values = [_value(v) for v in working.split(",")]
        assert values == list(range(n - d, -1, -d)) and int(answer) == n % d == values[-1] < d
    assert get_task("long", seed=0).splits() == splits
    assert get_task("long", seed=1).splits().eval != splits.eval
    assert {r["prompt"] for r in splits.eval}.isdisjoint({r["prompt"] for r in splits.train})


def test_reference_lengths_have_a_long_heavy_tail(splits):
    """Issue #21's bounds on the reference response (characters = tokens of the char-level tokenizer, eos not
    counted): mean >= 150, p99 >= 4x the mean, max >= 1,024. Measured (seed 0): mean 158, p50 106, p99 801, max 1026."""
    lens = [len(r["answer"]) for r in splits.train]
    mean = sum(lens) / len(lens)
    assert mean >= 150 and _pct(lens, 0.99) >= 4 * mean and max(lens) >= 1024
    assert _pct(lens, 0.5) < mean  # most responses are shorter than the mean: a tail, not a shift
    ev = [len(r["answer"]) for r in splits.eval]
    assert 0.7 * mean <= sum(ev) / len(ev) <= 1.3 * mean  # the held-out split follows the same distribution
    tok = build_tokenizer(get_task("long").alphabet(), model_max_length=2048)
    row = max(splits.train, key=lambda r: len(r["answer"]))
    assert len(tok.encode(row["answer"], add_special_tokens=False)) == len(row["answer"])
    assert len(tok.encode(row["prompt"], add_special_tokens=False)) == 7


def test_reward_is_exact_and_the_opt_in_partial_credit_is_half_the_correct_prefix():
    ref = LongTask.row(42, 7)["answer"]  # 6 steps: 5300,8200,1200,4100,7000,0000=0
    exact = resolve_reward_fn("auto", task="long")  # the default: exact match of the whole working
    assert exact(ref, ref) == 1.0 and exact(ref.replace("1200", "1300"), ref) == 0.0
    assert exact(ref[:-1] + "3", ref) == 0.0
    reward = resolve_reward_fn("long_working")
    assert reward is long_working
    assert reward(ref, ref) == 1.0 and reward(ref + "\n", ref) == 1.0
    assert reward(ref.replace("1200", "1300"), ref) == 0.5 * 2 / 6  # right until the third step
    assert reward(ref[:-1] + "3", ref) == 0.5  # every step right, the wrong remainder: never 1.0
    assert reward("5300,8200", ref) == 0.5 * 2 / 6  # stopped early
    assert reward("=0", ref) == 0.0 and reward("", ref) == 0.0


def test_preset_fits_the_longest_answer_and_the_model_context():
    cfg = load_config(["data=long"])
    task = get_task(cfg.data.task)
    assert cfg.model.path == "builtin:tiny-long" and cfg.algorithm.pack_sequences is True
    assert cfg.rollout.response_length >= task.max_response_tokens
    assert cfg.rollout.prompt_length >= 7
    context = BUILTIN_MODELS["tiny-long"]["max_position_embeddings"]
    assert context >= 2048 and cfg.rollout.prompt_length + cfg.rollout.response_length <= context


def _model_dir(tmp_path, context=2048, layers=2, hidden=128, heads=2):
    (tmp_path / "config.json").write_text(json.dumps({
        "max_position_embeddings": context, "num_hidden_layers": layers, "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": heads, "head_dim": hidden // heads}))
    return str(tmp_path)


def test_an_overlong_sequence_is_refused_by_name_before_ray_starts(tmp_path):
    model = _model_dir(tmp_path)
    fits = load_config(["data=long", f"model.path={model}", f"trainer.output_dir={tmp_path / 'run'}"])
    check_sequence_fits(fits, model)  # 8 + 1028 <= 2048
    long = load_config(["data=long", f"model.path={model}", "rollout.response_length=2041",
                        f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(LaunchError, match=r"rollout.prompt_length \+ rollout.response_length = 8 \+ 2041 = 2049 "
                                          r"tokens exceeds the context .*max_position_embeddings 2048"):
        resolve_plan(long)
    assert not (tmp_path / "run").exists()


def test_a_kv_cache_smaller_than_one_sequence_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    # 48 layers x 16 heads x 128 x 2 (keys, values) x 4 bytes = 768 KiB per token: 2,000 tokens need 1.46 GiB
    model = _model_dir(tmp_path, context=4096, layers=48, hidden=2048, heads=16)
    base = ["data=long", f"model.path={model}", "rollout.response_length=1992"]
    with pytest.raises(ValueError, match=r"rollout.kv_cache_gib=1 .* cannot hold one sequence .* 2000 tokens "
                                         r"\(1.46 GiB"):
        check_sequence_fits(load_config(base), model)
    check_sequence_fits(load_config([*base, "rollout.kv_cache_gib=2"]), model)
    check_sequence_fits(load_config([*base, "rollout.engine=hf"]), model)  # no vLLM cache to size
