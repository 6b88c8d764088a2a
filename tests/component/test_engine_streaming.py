"""The vLLM engine's step-level interface (real vLLM CPU engine) against independent transformers computations.

* A weight update lands in the middle of a generation: the sequence goes on, tokens before the update carry the
  old version and tokens after it the new one.
* ``recompute``: the behaviour log-probs after the update equal a transformers forward pass of the *new* weights
  over prompt + every token so far (the engine re-prefilled the sequence).
* ``keep``: they equal what an engine that kept its cache computes: keys/values of the positions processed before
  the swap come from the *old* weights, later ones from the new weights. Reproduced here with a transformers KV
  cache built by the old model and continued by the new one. ``keep`` therefore samples from neither policy
  exactly; the docs (staleness.md) say so.
* In continuous use, a short group added after a long one is returned first.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asyncppo.rollout.engine import SamplingSpec

TOL = 2e-5
PROMPT = [4, 5, 6, 7, 8, 9]  # digits of the char tokenizer (ids 4..13)
BEFORE, TOTAL = 4, 12  # tokens generated before the swap, in all


@pytest.fixture(scope="module")
def weights(tiny_model_dir):
    """(old state dict, new state dict, old model, new model): the new weights are a seeded perturbation."""
    from transformers import AutoModelForCausalLM

    old = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.5 * p.abs().mean() * torch.randn(p.shape, generator=gen))
    old_sd = {k: v.clone() for k, v in old.state_dict().items()}
    new_sd = {k: v.clone() for k, v in new.state_dict().items()}
    return old_sd, new_sd, old, new


def _lp(logits: torch.Tensor, tokens) -> np.ndarray:
    """log-softmax at T=1 of each row, at the given tokens."""
    return torch.log_softmax(logits.double(), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).numpy()


@torch.no_grad()
def full_forward_logprobs(model, prompt, tokens) -> np.ndarray:
    ids = torch.tensor([list(prompt) + list(tokens)])
    return _lp(model(input_ids=ids).logits[0, len(prompt) - 1 : -1], tokens)


@torch.no_grad()
def kept_cache_logprobs(old, new, prompt, tokens, before: int) -> np.ndarray:
    """Log-probs of ``tokens[before:]`` when the keys/values of ``prompt + tokens[:before-1]`` were computed by
    ``old`` (the engine had processed them before the swap) and everything later by ``new``."""
    from transformers import DynamicCache

    cache = DynamicCache()
    ctx = torch.tensor([list(prompt) + list(tokens[: before - 1])])
    old(input_ids=ctx, past_key_values=cache, use_cache=True)
    rest = torch.tensor([list(tokens[before - 1 : -1])])
    pos = torch.arange(ctx.shape[1], ctx.shape[1] + rest.shape[1])[None]
    logits = new(input_ids=rest, past_key_values=cache, use_cache=True, position_ids=pos).logits[0]
    return _lp(logits, tokens[before:])


def _generate_with_swap(engine, new_sd, mode: str, key: str):
    spec = SamplingSpec(n=2, max_tokens=TOTAL, temperature=1.0, seed=123, ignore_eos=True)
    engine.set_weight_version(0)
    engine.add_group(key, PROMPT, spec)
    finished = []
    for _ in range(BEFORE):
        finished += engine.step()
    assert not finished and engine.num_unfinished_seqs() == 2
    engine.update_weights(list(new_sd.items()))
    engine.set_weight_version(1)
    if mode == "recompute":
        engine.recompute_inflight()
    while engine.num_unfinished_seqs():
        finished += engine.step()
    assert [g.key for g in finished] == [key]
    return finished[0].completions


@pytest.mark.parametrize("mode", ["recompute", "keep"])
def test_weight_update_mid_generation(vllm_engine, weights, mode):
    old_sd, new_sd, old, new = weights
    try:
        comps = _generate_with_swap(vllm_engine, new_sd, mode, f"swap-{mode}")
    finally:
        vllm_engine.update_weights(list(old_sd.items()))
        vllm_engine.set_weight_version(0)
    worst_new, worst_kept = 0.0, 0.0
    for c in comps:
        toks = [int(t) for t in c.token_ids]
        assert len(toks) == TOTAL and c.finish_reason == "length"
        assert c.versions.tolist() == [0] * BEFORE + [1] * (TOTAL - BEFORE)
        # before the swap: the old weights, whatever the mode
        np.testing.assert_allclose(c.logprobs[:BEFORE], full_forward_logprobs(old, PROMPT, toks)[:BEFORE], atol=TOL)
        after_new = full_forward_logprobs(new, PROMPT, toks)[BEFORE:]
        after_kept = kept_cache_logprobs(old, new, PROMPT, toks, BEFORE)
        worst_new = max(worst_new, float(np.abs(c.logprobs[BEFORE:] - after_new).max()))
        worst_kept = max(worst_kept, float(np.abs(c.logprobs[BEFORE:] - after_kept).max()))
    print(f"{mode}: max |lp - new-weights forward| {worst_new:.2e}, |lp - kept-cache forward| {worst_kept:.2e}")
    if mode == "recompute":
        assert worst_new < TOL
        assert worst_kept > 10 * TOL  # the perturbation is large enough to tell the two apart
    else:
        assert worst_kept < TOL
        assert worst_new > 10 * TOL


def test_short_group_added_after_long_one_finishes_first(vllm_engine):
    long_spec = SamplingSpec(n=2, max_tokens=20, temperature=1.0, seed=1, ignore_eos=True)
    short_spec = SamplingSpec(n=2, max_tokens=2, temperature=1.0, seed=2, ignore_eos=True)
    vllm_engine.add_group("long", PROMPT, long_spec)
    order = []
    for _ in range(2):
        order += [g.key for g in vllm_engine.step()]
    vllm_engine.add_group("short", PROMPT[:3], short_spec)
    while vllm_engine.num_unfinished_seqs():
        order += [g.key for g in vllm_engine.step()]
    assert order == ["short", "long"]


def test_streaming_matches_one_shot_generate_and_abort(vllm_engine, tiny_tokenizer):
    """Seeded streaming groups give the same samples as one-shot generate; abort_all empties the engine."""
    prompts = [tiny_tokenizer.encode(p) for p in ["12+34=", "07+45=", "99+01="]]
    one_shot = vllm_engine.generate(prompts, n=3, max_tokens=6, temperature=1.0, seed=50)
    for i, p in enumerate(prompts):  # generate() seeds prompt i with seed + i * n
        vllm_engine.add_group(f"g{i}", p, SamplingSpec(n=3, max_tokens=6, temperature=1.0, seed=50 + 3 * i))
    got = {}
    while vllm_engine.num_unfinished_seqs():
        got.update({g.key: g.completions for g in vllm_engine.step()})
    for i in range(len(prompts)):
        for a, b in zip(got[f"g{i}"], one_shot[i]):
            assert a.token_ids.tolist() == b.token_ids.tolist()
            np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    vllm_engine.add_group("doomed", PROMPT, SamplingSpec(n=4, max_tokens=30, ignore_eos=True))
    vllm_engine.step()
    assert vllm_engine.abort_all() == ["doomed"]
    assert vllm_engine.num_unfinished_seqs() == 0 and vllm_engine.step() == []
    with pytest.raises(ValueError, match="already in flight"):
        vllm_engine.add_group("dup", PROMPT, SamplingSpec(n=1, max_tokens=2))
        vllm_engine.add_group("dup", PROMPT, SamplingSpec(n=1, max_tokens=2))
    vllm_engine.abort_all()


def test_closing_a_second_engine_in_the_process_leaves_the_first_one_stepping(vllm_engine, random_model_dir):
    """vLLM's in-process shutdown tears down process-wide state; a second engine closed beside the shared one is
    parked instead (VLLMEngine.close), so the shared engine's next group still decodes (it failed with "pipeline
    model parallel group is not initialized" before)."""
    from asyncppo.rollout.engines import make_engine

    other = make_engine("vllm", random_model_dir, dtype="float32", max_model_len=128, seed=0, kv_cache_gib=1)
    spec = SamplingSpec(n=2, max_tokens=3, temperature=1.0, seed=5, ignore_eos=True)
    other.add_group("other", PROMPT, spec)
    while other.num_unfinished_seqs():
        other.step()
    other.close()
    vllm_engine.add_group("after-close", PROMPT, spec)
    done = []
    while vllm_engine.num_unfinished_seqs():
        done += vllm_engine.step()
    assert [g.key for g in done] == ["after-close"] and all(len(c.token_ids) == 3 for c in done[0].completions)
