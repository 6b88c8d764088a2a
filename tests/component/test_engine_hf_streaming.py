"""The transformers engine's step-level (streaming) interface against an independent transformers forward pass.

Real models throughout (the warm-started ``tiny_model_dir`` and the untrained ``random_model_dir``, which
rarely emits eos, for long generations); the reference is a plain ``AutoModelForCausalLM`` forward pass.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncppo.rollout.engine import Completion, FinishedGroup, SamplingSpec, StreamingEngine
from asyncppo.rollout.engines import make_engine
from tests.engine_reference import ref_logprobs

LOGPROB_TOL = 2e-5


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = make_engine("hf", tiny_model_dir, max_model_len=128, seed=0)
    yield eng
    eng.close()


def run_to_completion(engine, max_steps=200) -> list[list[FinishedGroup]]:
    """Step until the engine is empty; the finished groups of each step."""
    steps = []
    while engine.num_unfinished_seqs():
        steps.append(engine.step())
        assert len(steps) < max_steps
    return steps


def flat(steps) -> dict[str, list[Completion]]:
    out = {}
    for fin in steps:
        for g in fin:
            assert g.key not in out  # each group exactly once
            out[g.key] = g.completions
    return out


def test_protocol_and_defaults(engine):
    assert isinstance(engine, StreamingEngine)
    assert engine.max_num_seqs == 256
    assert engine.num_unfinished_seqs() == 0 and engine.step() == []


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 0.9)])
def test_streamed_logprobs_match_forward_pass(engine, ref_model, prompts, temperature, top_k, top_p):
    spec = SamplingSpec(n=4, max_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, seed=123)
    for i, p in enumerate(prompts[:6]):
        engine.add_group(f"g{i}", p, spec)
    got = flat(run_to_completion(engine))
    assert sorted(got) == [f"g{i}" for i in range(6)]
    worst, count = 0.0, 0
    for i, p in enumerate(prompts[:6]):
        comps = got[f"g{i}"]
        assert len(comps) == 4
        for c in comps:
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.versions.dtype == np.int64 and c.versions.tolist() == [0] * c.num_tokens
            assert 1 <= c.num_tokens <= 8 and c.finish_reason in ("stop", "length")
            ref = ref_logprobs(ref_model, p, c.token_ids.tolist(), temperature, top_k, top_p)
            worst = max(worst, float(np.abs(ref - c.logprobs).max()))
            count += c.num_tokens
    print(f"\n[stream] T={temperature} top_k={top_k} top_p={top_p}: max |logprob diff| = {worst:.2e} over {count} tokens")
    assert worst < LOGPROB_TOL


def test_greedy_stream_equals_greedy_generate(engine, prompts, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    ref = engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)
    for i, p in enumerate(prompts):
        engine.add_group(str(i), p, SamplingSpec(n=1, max_tokens=6, temperature=0.0))
    got = flat(run_to_completion(engine))
    for i, comps in enumerate(ref):
        (a,), (b,) = comps, got[str(i)]
        assert b.token_ids.tolist() == a.token_ids.tolist()
        assert b.finish_reason == a.finish_reason == ("stop" if a.token_ids[-1] == eos else "length")
        assert np.abs(a.logprobs - b.logprobs).max() < LOGPROB_TOL
    assert len({tuple(c[0].token_ids.tolist()) for c in ref}) > 3


def test_seeded_group_does_not_depend_on_batch(engine, prompts):
    spec = SamplingSpec(n=4, max_tokens=8, temperature=1.0, seed=5)
    engine.add_group("x", prompts[0], spec)
    alone = flat(run_to_completion(engine))["x"]
    # Same group with company before and after it: unseeded, differently seeded, other lengths and settings.
    engine.add_group("a", prompts[1], SamplingSpec(n=3, max_tokens=3, temperature=1.0))
    engine.add_group("b", prompts[2], SamplingSpec(n=2, max_tokens=8, temperature=0.7, top_k=4, seed=9))
    engine.add_group("x", prompts[0], spec)
    engine.add_group("c", prompts[3] + prompts[4], SamplingSpec(n=5, max_tokens=6, temperature=0.0))
    together = flat(run_to_completion(engine))
    assert sorted(together) == ["a", "b", "c", "x"]
    for s, t in zip(alone, together["x"]):
        assert s.token_ids.tolist() == t.token_ids.tolist() and s.finish_reason == t.finish_reason
        assert np.abs(s.logprobs - t.logprobs).max() < LOGPROB_TOL
    assert len({tuple(c.token_ids.tolist()) for c in alone}) > 1  # samples j differ from each other


def test_short_group_returns_before_long(random_model_dir):
    eng = make_engine("hf", random_model_dir, max_model_len=64, seed=0)
    eng.add_group("long", [3, 4, 5], SamplingSpec(n=2, max_tokens=20, temperature=1.0, seed=1))
    eng.add_group("short", [6, 7], SamplingSpec(n=2, max_tokens=2, temperature=1.0, seed=2))
    steps = run_to_completion(eng)
    when = {g.key: i for i, fin in enumerate(steps) for g in fin}
    assert when["short"] <= 1 < when["long"]
    assert max(c.num_tokens for c in flat(steps)["long"]) > 2
    eng.close()


@pytest.mark.parametrize("mode", ["cache+recompute", "no_cache+keep", "cache+keep"])
def test_weight_update_mid_generation(random_model_dir, mode):
    """Four tokens under version 0, then new weights + version 1. With the cache dropped (recompute_inflight), or
    with no cache at all (where "keep" is "recompute"), the later tokens' log-probs are those of a forward pass
    of the new weights over prompt + all tokens; keeping the cache keeps old-weight keys/values instead."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    eng = make_engine("hf", random_model_dir, max_model_len=64, seed=0, kv_cache=mode.startswith("cache"))
    prompt = [3, 4, 5, 6]
    eng.add_group("g", prompt, SamplingSpec(n=3, max_tokens=12, temperature=1.0, seed=4))
    for _ in range(4):
        assert eng.step() == []  # (the untrained model rarely stops; checked below)
    eng.update_weights((k, v.clone()) for k, v in new.state_dict().items())
    eng.set_weight_version(1)
    if mode.endswith("recompute"):
        eng.recompute_inflight()
    (fin,) = [g for step in run_to_completion(eng) for g in step]
    long_ones = 0
    for c in fin.completions:
        k = min(4, c.num_tokens)
        assert c.versions.tolist() == [0] * k + [1] * (c.num_tokens - k)
        toks = c.token_ids.tolist()
        ref_old = ref_logprobs(old, prompt, toks, 1.0)
        ref_new = ref_logprobs(new, prompt, toks, 1.0)
        assert np.abs(ref_old[:k] - c.logprobs[:k]).max() < LOGPROB_TOL
        if c.num_tokens > 4:
            long_ones += 1
            new_diff = np.abs(ref_new[4:] - c.logprobs[4:]).max()
            if mode == "cache+keep":
                assert new_diff > 1e-4  # stale keys/values of the first tokens were kept
            else:
                assert new_diff < LOGPROB_TOL
                assert np.abs(ref_old[4:] - c.logprobs[4:]).max() > 1e-3  # the update mattered
    assert long_ones >= 2
    eng.close()


def test_kv_cache_equals_recompute_with_churn(random_model_dir):
    """Rows joining (FIFO, 5 slots), leaving at different lengths and a mid-way cache drop: the cached engine
    produces the same tokens as the no-cache engine, and log-probs within tolerance."""
    out = {}
    for kv in (True, False):
        eng = make_engine("hf", random_model_dir, max_model_len=64, seed=0, max_num_seqs=5, kv_cache=kv)
        for i in range(4):
            spec = SamplingSpec(n=3, max_tokens=3 + 3 * i, temperature=[1.0, 0.7, 0.0, 1.0][i], top_k=[-1, 5, -1, -1][i],
                                seed=10 + i)
            eng.add_group(f"g{i}", list(range(3, 4 + 2 * i)), spec)
        steps = []
        for n in range(100):
            if n == 6:
                eng.recompute_inflight()
            steps.append(eng.step())
            if not eng.num_unfinished_seqs():
                break
        out[kv] = flat(steps)
        eng.close()
    assert sorted(out[True]) == sorted(out[False]) == ["g0", "g1", "g2", "g3"]
    for key in out[True]:
        for a, b in zip(out[True][key], out[False][key]):
            assert a.token_ids.tolist() == b.token_ids.tolist() and a.finish_reason == b.finish_reason
            assert np.abs(a.logprobs - b.logprobs).max() < LOGPROB_TOL
    assert max(c.num_tokens for c in out[True]["g3"]) > 6


def test_more_sequences_than_slots(tiny_model_dir, prompts):
    eng = make_engine("hf", tiny_model_dir, max_model_len=128, seed=0, max_num_seqs=6)
    assert eng.max_num_seqs == 6
    for i in range(3):
        eng.add_group(f"k{i}", prompts[i], SamplingSpec(n=4, max_tokens=10, temperature=1.0))
    assert eng.num_unfinished_seqs() == 12
    seen, trace = [], []
    while eng.num_unfinished_seqs():
        seen += [g.key for g in eng.step()]
        trace.append(len(eng._running))
        assert len(eng._running) <= 6 and len(trace) < 100
    assert sorted(seen) == ["k0", "k1", "k2"]
    assert eng.num_unfinished_seqs() == 0 and eng.step() == []
    # abort_all drops running and waiting groups and names them
    for i in range(3):
        eng.add_group(f"k{i}", prompts[i], SamplingSpec(n=4, max_tokens=10, temperature=1.0))
    eng.step()
    assert eng.abort_all() == ["k0", "k1", "k2"]
    assert eng.num_unfinished_seqs() == 0 and eng.step() == []
    eng.close()


def test_add_group_errors(engine, prompts):
    spec = SamplingSpec(n=2, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_group("e", [], spec)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_group("long", prompts[0], SamplingSpec(n=1, max_tokens=128))
    with pytest.raises(ValueError, match="top_p"):
        engine.add_group("p", prompts[0], SamplingSpec(n=1, max_tokens=4, top_p=0.0))
    engine.add_group("dup", prompts[0], spec)
    with pytest.raises(ValueError, match="dup"):
        engine.add_group("dup", prompts[1], spec)
    assert engine.num_unfinished_seqs() == 2  # the failed calls queued nothing
    assert engine.abort_all() == ["dup"]


def test_warm_up_leaves_the_engine_empty_and_its_shared_generator_untouched(tiny_model_dir, prompts):
    """The worker's warm-up request must not change what the run samples: unseeded groups draw from the engine's
    shared generator, so two engines with the same seed, one warmed up, must give the same tokens."""
    from asyncppo.rollout.engine import warm_up

    spec = SamplingSpec(n=3, max_tokens=6)  # unseeded: the shared generator
    tokens = []
    for warm in (False, True):
        eng = make_engine("hf", tiny_model_dir, max_model_len=128, seed=7)
        try:
            if warm:
                assert warm_up(eng, prompts[0]) > 0 and eng.num_unfinished_seqs() == 0
            for i, p in enumerate(prompts[:3]):
                eng.add_group(f"g{i}", p, spec)
            got = flat(run_to_completion(eng))
            tokens.append([c.token_ids.tolist() for k in sorted(got) for c in got[k]])
        finally:
            eng.close()
    assert tokens[0] == tokens[1]
