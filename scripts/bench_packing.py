"""Learner step time and padded-token fraction, padded against packed micro-batches, on long-tailed lengths.

    python scripts/bench_packing.py                    # CPU, the defaults below
    python scripts/bench_packing.py --device cuda      # on a GPU (sdpa)
    python scripts/bench_packing.py --device cuda --flex   # and the packed forward on flex-attention

The batch is what a long-generation task hands the learner: ``--groups`` prompts x ``--n`` samples, prompts of 32-64
tokens, response lengths drawn from a log-normal (mean about ``--mean``, one sample at ``--max``), so most rows are
short and a few are very long. Token ids are random: a forward's cost does not depend on them. The model is a
randomly initialised Qwen2 of the given size (``asyncppo.data.tiny.build_tiny_model``). Three learner settings run
the same GRPO step (one mini-batch, decoupled correction):

* ``padded-count``: ``micro_batch_size`` rows per micro-batch, padded forwards (the schema's way without a budget);
* ``padded-tokens``: ``max_tokens_per_micro_batch`` filled by token count, ``pack_sequences=false``;
* ``packed``: the same budget, sequences packed (``pack_sequences`` auto): on CPU (sdpa, a block-diagonal mask)
  rows as wide as each micro-batch's longest sequence;
* ``packed-budget-rows``: the row layout of the varlen (flash-attention) path, rows filled up to the budget, run here
  through the same mask (so its pad fraction is the GPU path's, its CPU time is not);
* ``packed-varlen``: the learner loaded with ``model.attn_implementation=sdpa_varlen`` (one causal sdpa call per
  sequence of a packed row), rows filled up to the budget;
* ``packed-flex`` (``--flex``, CUDA): the learner loaded with ``model.attn_implementation=flex_attention``, whose
  block mask skips the blocks outside every sequence, so rows are filled up to the budget as on the varlen path.

Each setting: one warm-up step, then ``--steps`` timed steps; the median is reported with ``perf/pad_fraction``.
Results: docs/benchmarks.md, "Packed learner micro-batches".
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--mean", type=float, default=150.0)
    ap.add_argument("--max", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=4096, help="max_tokens_per_micro_batch of the token settings")
    ap.add_argument("--micro", type=int, default=8, help="micro_batch_size of padded-count")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--flex", action="store_true", help="add packed-flex (CUDA: flex-attention has no CPU backward)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(tmp, hidden=args.hidden, layers=args.layers, heads=args.heads,
                                     intermediate=4 * args.hidden, max_position_embeddings=2 * args.max, seed=1)
        vocab = load_actor(model_dir, torch.float32, torch.device("cpu")).config.vocab_size
        groups = make_groups(args, vocab)
        lengths = np.array([len(s.response_ids) for g in groups for s in g.samples])
        print(f"responses: {lengths.size}, mean {lengths.mean():.1f}, p50 {np.percentile(lengths, 50):.0f}, "
              f"p99 {np.percentile(lengths, 99):.0f}, max {lengths.max()}; threads {torch.get_num_threads()}")
        results = [
            run_setting("padded-count", model_dir, groups, args, micro_batch_size=args.micro, pack_sequences=False),
            run_setting("padded-tokens", model_dir, groups, args, max_tokens_per_micro_batch=args.tokens,
                        pack_sequences=False),
            run_setting("packed", model_dir, groups, args, max_tokens_per_micro_batch=args.tokens),
            run_setting("packed-budget-rows", model_dir, groups, args, varlen_rows=True,
                        max_tokens_per_micro_batch=args.tokens),
            run_setting("packed-varlen", model_dir, groups, args, attn="sdpa_varlen",
                        max_tokens_per_micro_batch=args.tokens),
        ]
        if args.flex:
            results.append(run_setting("packed-flex", model_dir, groups, args, attn="flex_attention",
                                       max_tokens_per_micro_batch=args.tokens))
    for r in results:
        print(f"RESULT {r['setting']:>18}  step {r['step_s']:7.3f} s  pad_fraction {r['pad_fraction']:.3f}  "
              f"peak {r['peak_gib']:.2f} GiB  pg_loss {r['loss']:.6f}")


if __name__ == "__main__":
    main()
