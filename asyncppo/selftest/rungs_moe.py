"""The mixture-of-experts rung: a PPO learner step with routing replay and the transformers engine recording experts,
on a Qwen3-MoE with random weights (docs/moe.md).

Sizes: on CUDA ~1.2B parameters in bfloat16 (hidden 1024, 16 layers, 32 experts of width 512, top-4, Qwen2.5's
vocabulary: ~0.3B of them active per token), 8 groups x 4 samples of 64 + 192 tokens a step, 64 x 4 generations of 128
tokens; on CPU two layers of 64 and 4 experts, enough to prove the path. What it shows only a GPU can: the grouped
expert kernels under the replay hooks, the learner's memory with the routing column, and what recording the experts
costs the engine (the rate with and without it, side by side).
"""

from __future__ import annotations

import os
import time

from asyncppo.selftest.ladder import Context

SHAPES = {
    "0.5b": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=4, experts=32,
                 top_k=4, expert_intermediate=512, vocab_size=151936),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, experts=4,
                 top_k=2, expert_intermediate=64, vocab_size=64),
}


def build_moe_model(out_dir: str, size: str, dtype: str) -> str:
    """A random Qwen3-MoE of ``SHAPES[size]`` with the character tokenizer, written once to ``out_dir``."""
    import torch  # heavy: torch
    from transformers import Qwen2Config  # heavy: transformers

    from asyncppo.data.tiny import build_tokenizer
    from asyncppo.data.tiny_moe import moe_model
    from asyncppo.models.moe_routing import moe_routers

    if os.path.isfile(os.path.join(out_dir, "config.json")):
        return out_dir
    shape = dict(SHAPES[size])
    experts, top_k, width = shape.pop("experts"), shape.pop("top_k"), shape.pop("expert_intermediate")
    tokenizer = build_tokenizer()
    shape["vocab_size"] = max(shape["vocab_size"], len(tokenizer))
    dense = Qwen2Config(**shape, intermediate_size=4 * shape["hidden_size"],
                        head_dim=shape["hidden_size"] // shape["num_attention_heads"], max_position_embeddings=4096,
                        tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = moe_model(dense, experts=experts, top_k=top_k, expert_intermediate=width)
        with torch.no_grad():
            for router in moe_routers(model):  # transformers initialises routers at zero: give them preferences
                router.weight.normal_(0, 0.02)
        model = model.to(getattr(torch, dtype))
    tmp = out_dir.rstrip("/") + ".partial"
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    os.replace(tmp, out_dir)
    return out_dir


def _routed_groups(groups: int, samples: int, prompt_len: int, response_len: int, vocab: int, shape):
    """Synthetic stream records that carry a routing column of valid, distinct experts per position."""
    import numpy as np  # heavy: numpy

    from asyncppo.selftest.rungs_device import _synthetic_groups
    from asyncppo.stream.routing import RoutingColumn

    rng = np.random.default_rng(1)
    out = _synthetic_groups(groups, samples, prompt_len, response_len, vocab)
    for g in out:
        rows = prompt_len + response_len
        records = []
        for _ in range(samples):
            ids = np.argsort(rng.random((rows, shape.layers, shape.num_experts)), axis=-1)[..., : shape.top_k]
            ids[-1] = -1
            records.append(ids)
        g.routing = RoutingColumn.from_samples(records, shape.num_experts)
    return out


def moe(ctx: Context) -> dict:
    """Learner step (routing replay on) and engine tokens/s with and without recording the experts."""
    import torch  # heavy: torch

    from asyncppo.learner.batch import collate_groups
    from asyncppo.learner.build import attach_routing
    from asyncppo.learner.models import load_actor
    from asyncppo.learner.ppo import PPOUpdate
    from asyncppo.models.moe_routing import hooks_of
    from asyncppo.rollout.engines import make_engine
    from asyncppo.selftest.rungs_device import learner_config, learner_shape, timed_steps

    cuda = ctx.device == "cuda"
    dtype = "bfloat16" if cuda else "float32"
    model_dir = build_moe_model(os.path.join(ctx.out_dir, f"moe-{ctx.size}"), ctx.size, dtype)
    groups, samples, prompt_len, response_len = learner_shape(ctx)
    cfg = learner_config(groups, samples, response_len, routing_replay="rollout")
    device = torch.device(ctx.device)
    actor = load_actor(model_dir, getattr(torch, dtype), device)
    attach_routing(cfg, actor, model_dir)
    update = PPOUpdate(cfg, actor, None, None, device)
    vocab = min(int(actor.config.vocab_size), 64)
    batch = collate_groups(_routed_groups(groups, samples, prompt_len, response_len, vocab, hooks_of(actor).shape), 0)
    step_s, metrics = timed_steps(update, actor, batch, ctx.device, steps=2)
    figures = {"params (M)": round(parameter_count_moe(model_dir) / 1e6, 1), "learner s/step": round(step_s, 3),
               "learner tokens/s": round(groups * samples * (prompt_len + response_len) / step_s, 1),
               "expert load": round(float(metrics["moe/expert_load"]), 2)}
    if cuda:
        figures["learner peak GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    del actor, update, batch
    for record in (False, True):
        engine = make_engine("hf", model_dir, dtype=dtype, max_model_len=512, device=ctx.device,
                             max_num_seqs=256 if cuda else 32, capture_routing=record)
        try:
            rate, complete = _stream_rate(engine, ctx, *((64, 4, 128) if cuda else (8, 4, 16)))
        finally:
            engine.close()
        figures[f"engine tokens/s{' recording' if record else ''}"] = rate
        if record and not complete:
            raise RuntimeError("a streamed sample came back without a full routing record")
    return figures


def parameter_count_moe(model_dir: str) -> int:
    """Parameters in the saved weights, every expert counted (the memory planner's dense arithmetic knows none)."""
    from safetensors import safe_open  # heavy: safetensors

    total = 0
    for name in os.listdir(model_dir):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, name), framework="pt") as fh:
                for key in fh.keys():
                    n = 1
                    for d in fh.get_slice(key).get_shape():
                        n *= d
                    total += n
    return total


def _stream_rate(engine, ctx: Context, prompts: int, n: int, max_tokens: int) -> tuple[float, bool]:
    """Tokens/s streaming ``prompts`` x ``n`` samples of ``max_tokens``; whether every sample's record is complete."""
    import random

    from asyncppo.rollout.engine import SamplingSpec, warm_up
    from asyncppo.selftest.rungs_device import _sync

    rng = random.Random(0)
    warm_up(engine, [5, 6, 7])
    _sync(ctx.device)
    t0 = time.perf_counter()
    for i in range(prompts):
        engine.add_group(f"g{i}", [rng.randrange(4, 16) for _ in range(16)],
                         SamplingSpec(n=n, max_tokens=max_tokens, seed=i, ignore_eos=True))
    tokens, complete = 0, True
    while engine.num_unfinished_seqs():
        for group in engine.step():
            for c in group.completions:
                tokens += c.num_tokens
                rec = c.routed_experts
                complete &= rec is None or bool((rec[:-1] >= 0).all())
    _sync(ctx.device)
    return round(tokens / (time.perf_counter() - t0), 1), complete
