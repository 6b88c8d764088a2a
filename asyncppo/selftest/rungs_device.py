"""The rungs that run in this process on one device: a PPO learner step, the transformers engine, the vLLM engine.

Sizes: on CUDA the 0.5B model in bfloat16 (the learner's ``model.dtype=bfloat16`` path), 8 groups x 4 samples of
64 prompt + 192 response tokens per step, 128 x 4 generations of 128 tokens; on CPU the tiny model in float32 and a
few dozen tokens, enough to prove the code path, not to measure it.
"""

from __future__ import annotations

import os
import time

from asyncppo.selftest.ladder import Context, Skip


def _sync(device: str) -> None:
    import torch  # heavy: torch

    if device == "cuda":
        torch.cuda.synchronize()


def _synthetic_groups(groups: int, samples: int, prompt_len: int, response_len: int, vocab: int, seed: int = 0):
    """Stream records with random tokens, behaviour log-probs and 0/1 rewards: the learner's real input type."""
    import numpy as np  # heavy: numpy

    from asyncppo.stream.records import Sample, TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(4, vocab, size=prompt_len).astype(np.int32)
        samples_ = [Sample(response_ids=rng.integers(4, vocab, size=response_len).astype(np.int32),
                           behavior_logprobs=(-rng.random(response_len) * 3).astype(np.float32),
                           reward=float(rng.integers(0, 2)), finish_reason="length", version_min=0, version_max=0)
                    for _ in range(samples)]
        out.append(TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=prompt, samples=samples_))
    return out


def learner_shape(ctx: Context) -> tuple[int, int, int, int]:
    """(groups, samples, prompt length, response length) of a learner rung's synthetic batch."""
    return (8, 4, 64, 192) if ctx.device == "cuda" else (4, 4, 8, 24)


def learner_config(groups: int, samples: int, response_len: int, **algorithm):
    """A learner rung's config: GRPO, micro-batches of 8, the batch shape; ``algorithm`` overrides on top."""
    from asyncppo.config.schema import AsyncPPOConfig
    from asyncppo.config.validate import resolve_derived

    cfg = AsyncPPOConfig()
    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.micro_batch_size = 8
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    cfg.rollout.response_length = response_len
    cfg.rollout.num_return_sequences_in_group = samples
    cfg.rollout.rollout_batch_size = groups
    return resolve_derived(cfg)


def timed_steps(update, actor, batch, device: str, steps: int) -> tuple[float, dict]:
    """Seconds per :meth:`PPOUpdate.step` on ``batch`` over ``steps`` steps after one warm-up (allocator, kernels,
    optimizer state), CUDA's peak memory counted from the warm-up on, and the last step's metrics; RuntimeError when
    the update left a non-finite parameter."""
    import torch  # heavy: torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    update.step(batch)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        metrics = update.step(batch)
    _sync(device)
    seconds = (time.perf_counter() - t0) / steps
    if not all(torch.isfinite(p).all() for p in actor.parameters()):
        raise RuntimeError("non-finite parameters after the update")
    return seconds, metrics


def learner_step(ctx: Context) -> dict:
    """The project's PPO update (GRPO advantages, clipped policy loss, AdamW) on a synthetic batch."""
    import torch  # heavy: torch

    from asyncppo.learner.batch import collate_groups
    from asyncppo.learner.models import load_actor
    from asyncppo.learner.ppo import PPOUpdate

    cuda = ctx.device == "cuda"
    groups, samples, prompt_len, response_len = learner_shape(ctx)
    cfg = learner_config(groups, samples, response_len)
    device = torch.device(ctx.device)
    dtype = torch.bfloat16 if cuda else torch.float32
    actor = load_actor(ctx.model_dir, dtype, device)
    update = PPOUpdate(cfg, actor, None, None, device)
    vocab = min(int(actor.config.vocab_size), 64)  # the character tokenizer's symbols
    batch = collate_groups(_synthetic_groups(groups, samples, prompt_len, response_len, vocab), 0)
    tokens = groups * samples * (prompt_len + response_len)
    seconds, metrics = timed_steps(update, actor, batch, ctx.device, steps=3)
    figures = {"dtype": str(dtype).removeprefix("torch."), "tokens/step": tokens, "s/step": round(seconds, 3),
               "tokens/s": round(tokens / seconds, 1), "approx_kl": round(float(metrics["actor/approx_kl"]), 5)}
    if cuda:
        figures["peak GiB"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    return figures


def _generate_rate(engine, ctx: Context, prompts: int, n: int, max_tokens: int) -> dict:
    import random

    rng = random.Random(0)
    batch = [[rng.randrange(4, 16) for _ in range(16)] for _ in range(prompts)]
    engine.generate(batch[:2], n=1, max_tokens=4, temperature=1.0, seed=0)  # warm-up
    _sync(ctx.device)
    t0 = time.perf_counter()
    out = engine.generate(batch, n=n, max_tokens=max_tokens, temperature=1.0, seed=1)
    _sync(ctx.device)
    seconds = time.perf_counter() - t0
    generated = sum(c.num_tokens for group in out for c in group)
    if generated == 0:
        raise RuntimeError("the engine generated no tokens")
    return {"sequences": prompts * n, "tokens": generated, "s": round(seconds, 2),
            "tokens/s": round(generated / seconds, 1)}


def hf_engine(ctx: Context) -> dict:
    """The transformers engine the rollout workers use (``rollout.engine=hf``)."""
    from asyncppo.rollout.engines import make_engine

    cuda = ctx.device == "cuda"
    engine = make_engine("hf", ctx.model_dir, dtype="bfloat16" if cuda else "float32", max_model_len=512,
                         device=ctx.device, max_num_seqs=512 if cuda else 64)
    try:
        return _generate_rate(engine, ctx, *((128, 4, 128) if cuda else (8, 4, 16)))
    finally:
        engine.close()


def vllm_engine(ctx: Context) -> dict:
    """The vLLM engine, where it is installed (it pins its own torch, so a bare GPU machine usually lacks it)."""
    try:
        import vllm  # noqa: F401  # optional: vllm
    except Exception as exc:  # ImportError, or a vLLM build for another torch
        raise Skip(f"vllm is not importable here ({type(exc).__name__}: {exc})") from None
    from asyncppo.rollout.engines import make_engine

    cuda = ctx.device == "cuda"
    if not cuda:
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    engine = make_engine("vllm", ctx.model_dir, dtype="bfloat16" if cuda else "float32", max_model_len=512,
                         device=ctx.device, gpu_memory_utilization=0.4, kv_cache_gib=1.0, enforce_eager=not cuda,
                         num_threads=1, max_num_seqs=256 if cuda else 32)
    try:
        return _generate_rate(engine, ctx, *((128, 4, 128) if cuda else (8, 4, 16)))
    finally:
        engine.close()
