"""``asyncppo bench packing``: learner step time and padded-token fraction, padded against packed micro-batches, on
long-tailed lengths.

The batch is what a long-generation task hands the learner: ``groups`` prompts x ``n`` samples, prompts of 32-64
tokens, response lengths drawn from a log-normal (mean about ``mean``, one sample at ``max``), so most rows are
short and a few are very long. Token ids are random: a forward's cost does not depend on them. The model is a
randomly initialised Qwen2 of the given size (``asyncppo.data.tiny.build_tiny_model``). Settings, each the same
GRPO step (one mini-batch, decoupled correction):

* ``padded-count``: ``micro_batch_size`` rows per micro-batch, padded forwards (the schema's way without a budget);
* ``padded-tokens``: ``max_tokens_per_micro_batch`` filled by token count, ``pack_sequences=false``;
* ``packed``: the same budget, sequences packed (``pack_sequences`` auto): on CPU (sdpa, a block-diagonal mask)
  rows as wide as each micro-batch's longest sequence;
* ``packed-budget-rows``: the row layout of the varlen (flash-attention) path, rows filled up to the budget, run here
  through the same mask (so its pad fraction is the GPU path's, its CPU time is not);
* ``packed-varlen``: the learner loaded with ``model.attn_implementation=sdpa_varlen`` (one causal sdpa call per
  sequence of a packed row), rows filled up to the budget;
* ``packed-flex`` (``flex=true``, CUDA): ``model.attn_implementation=flex_attention``, whose block mask skips the
  blocks outside every sequence, so rows are filled up to the budget as on the varlen path.

Each setting: one warm-up step, then ``steps`` timed steps; the median is the figure, with ``perf/pad_fraction``
(an exact count, so it does not move with the machine's load the way step times do).
"""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import numpy as np
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.models import load_actor
from asyncppo.learner import ppo as ppo_module
from asyncppo.learner.packing import uses_varlen_attention
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.stream.records import Sample, TrajectoryGroup


def long_tailed_lengths(count: int, mean: float, longest: int, rng: np.random.Generator) -> np.ndarray:
    """Log-normal lengths (sigma 1: p99 about 5x the mean), clipped to [8, longest], one sample at ``longest``."""
    sigma = 1.0
    lengths = rng.lognormal(np.log(mean) - sigma**2 / 2, sigma, size=count)
    lengths = np.clip(np.round(lengths), 8, longest).astype(int)
    lengths[rng.integers(count)] = longest
    return lengths


def make_groups(args, vocab: int) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(args.seed)
    lengths = long_tailed_lengths(args.groups * args.n, args.mean, args.max, rng).reshape(args.groups, args.n)
    groups = []
    for g in range(args.groups):
        samples = [Sample(response_ids=rng.integers(3, vocab, size=int(n)).astype(np.int32),
                          behavior_logprobs=(-rng.random(int(n))).astype(np.float32),
                          reward=float(rng.integers(0, 2)), finish_reason="stop", version_min=0, version_max=0)
                   for n in lengths[g]]
        prompt = rng.integers(3, vocab, size=int(rng.integers(32, 65))).astype(np.int32)
        groups.append(TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=prompt, samples=samples))
    return groups


def run_setting(name: str, model_dir: str, groups, args, varlen_rows: bool = False, attn: str | None = None,
                **algorithm) -> dict:
    cfg = AsyncPPOConfig()
    cfg.algorithm.adv_estimator = "grpo"
    cfg.algorithm.clip_ratio_low = cfg.algorithm.clip_ratio_high = cfg.algorithm.pg_clip  # as validation fills in
    cfg.rollout.response_length = args.max
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    actor = load_actor(model_dir, torch.float32 if args.device == "cpu" else torch.bfloat16, dev,
                       attn_implementation=attn)
    update = PPOUpdate(cfg, actor, None, None, dev)
    ppo_module.uses_varlen_attention = (lambda model: True) if varlen_rows else uses_varlen_attention
    update.step(collate_groups(groups, pad_token_id=0))  # warm-up
    times, fractions = [], []
    for _ in range(args.steps):
        batch = collate_groups(groups, pad_token_id=0)
        if args.device != "cpu":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        metrics = update.step(batch)
        if args.device != "cpu":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        fractions.append(metrics["perf/pad_fraction"])
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device != "cpu" else float("nan")
    if args.device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    return dict(setting=name, step_s=statistics.median(times), pad_fraction=statistics.mean(fractions),
                peak_gib=peak, loss=float(metrics["actor/pg_loss"]))


def run(opts: dict, seed: int, work: str) -> dict:
    args = SimpleNamespace(**opts, seed=seed)
    model_dir = build_tiny_model(work, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                 intermediate=4 * args.hidden, max_position_embeddings=2 * args.max, seed=1)
    vocab = load_actor(model_dir, torch.float32, torch.device("cpu")).config.vocab_size
    groups = make_groups(args, vocab)
    lengths = np.array([len(s.response_ids) for g in groups for s in g.samples])
    print(f"[packing] responses: {lengths.size}, mean {lengths.mean():.1f}, p50 {np.percentile(lengths, 50):.0f}, "
          f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}; threads {torch.get_num_threads()}", flush=True)
    budget = {"max_tokens_per_micro_batch": args.tokens}
    settings = [("padded-count", {}, dict(micro_batch_size=args.micro, pack_sequences=False)),
                ("padded-tokens", {}, dict(budget, pack_sequences=False)),
                ("packed", {}, budget),
                ("packed-budget-rows", {"varlen_rows": True}, budget),
                ("packed-varlen", {"attn": "sdpa_varlen"}, budget)]
    if args.flex:
        settings.append(("packed-flex", {"attn": "flex_attention"}, budget))
    figures, units, rows = {}, {}, []
    for name, how, algorithm in settings:
        r = run_setting(name, model_dir, groups, args, **how, **algorithm)
        rows.append(r)
        figures[f"step s {name}"], units[f"step s {name}"] = r["step_s"], "s"
        figures[f"pad fraction {name}"], units[f"pad fraction {name}"] = r["pad_fraction"], "fraction"
        print(f"[packing] {name:>18}  step {r['step_s']:7.3f} s  pad_fraction {r['pad_fraction']:.3f}", flush=True)
    return {"figures": figures, "units": units,
            "detail": {"rows": rows, "lengths": {"mean": float(lengths.mean()), "max": int(lengths.max()),
                                                 "p99": float(np.percentile(lengths, 99))}}}
