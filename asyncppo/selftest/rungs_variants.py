"""The learner-variants rung: one PPO step of every advantage estimator, policy loss, aggregation, rollout
correction and packing layout on the device, each with its own small model set (actor, critic, reference as the
setting needs them).

Why a rung of its own: a tensor made on the CPU and used beside the batch's (a random permutation, a quantile's
levels) works on a CPU-only machine, where every test of the suite runs, and fails on the first CUDA step. The
first GPU run of the project found two such bugs, each in a path the 0.5B learner-step rung does not take; this
rung sweeps the option set so that the next one is found by ``asyncppo selftest``, not in a user's run. A tiny
model keeps it to seconds; the figures are pass counts, not speeds.
"""

from __future__ import annotations

import math
import tempfile
import time

from asyncppo.selftest.ladder import Context

# (label, algorithm overrides; "model.*" keys go to the model section); every entry is one learner step
_BASE = {"adv_estimator": "grpo"}
VARIANTS: list[tuple[str, dict]] = [
    ("gae + critic", {"adv_estimator": "gae"}),
    ("gae, kl loss, huber", {"adv_estimator": "gae", "use_kl_loss": True, "huber_delta": 1.0}),
    ("gae, packed", {"adv_estimator": "gae", "max_tokens_per_micro_batch": 256, "pack_sequences": True}),
    *[(name, {"adv_estimator": name}) for name in
      ("grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline")],
    ("kl in reward, adaptive", {**_BASE, "add_token_level_kl": True, "kl_ctrl.type": "adaptive"}),
    ("tis, sequence, mask", {**_BASE, "off_policy_correction": "tis", "off_policy_level": "sequence",
                             "off_policy_truncation": "mask"}),
    ("tis, icepop, normalised", {**_BASE, "off_policy_correction": "tis", "off_policy_truncation": "icepop",
                                 "off_policy_normalize": True}),
    ("token rejection k3", {**_BASE, "rejection": "token", "rejection_stat": "k3"}),
    ("sequence rejection k2", {**_BASE, "rejection": "sequence", "rejection_stat": "k2"}),
    ("running reward norm", {**_BASE, "reward_norm": "running"}),
    ("group norm, clip", {**_BASE, "reward_norm": "group", "reward_clip": 1.0}),
    ("overlong penalty", {**_BASE, "overlong_buffer_len": 16}),
    ("mask truncated", {**_BASE, "mask_truncated": True}),
    ("dual clip, entropy", {**_BASE, "dual_clip_loss": True, "entropy_coef": 0.01, "advantage_clip": 2.0}),
    ("2 epochs x 2 minis, early stop", {**_BASE, "early_stop_kl": 0.0001, "ppo_epochs": 2,
                                         "ppo_num_mini_batches": 2}),
    ("token budget", {**_BASE, "max_tokens_per_micro_batch": 256}),
    *[(f"loss {name}", {**_BASE, "policy_loss": name})
      for name in ("gspo", "cispo", "gmpo", "clip_cov", "kl_cov", "reinforce_tis")],
    *[(f"agg {mode}", {**_BASE, "loss_agg_mode": mode})
      for mode in ("seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")],
]
CUDA_VARIANTS: list[tuple[str, dict]] = [
    ("bfloat16", {**_BASE, "model.dtype": "bfloat16"}),
    # flex-attention has no CPU backward (config validation refuses it there)
    ("gae, packed, flex-attention", {"adv_estimator": "gae", "max_tokens_per_micro_batch": 256,
                                     "model.attn_implementation": "flex_attention"}),
]


def _groups(vocab: int, seed: int):
    """4 groups x 4 samples of 4-59 response tokens, one cut at the limit per group, versions 0-1."""
    import numpy as np  # heavy: numpy

    from asyncppo.stream.records import Sample, TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for g in range(4):
        samples = []
        for j in range(4):
            n = int(rng.integers(4, 60))
            samples.append(Sample(response_ids=rng.integers(4, vocab, size=n).astype(np.int32),
                                  behavior_logprobs=(-rng.random(n) * 3).astype(np.float32),
                                  reward=float(rng.integers(0, 2)), finish_reason="length" if j == 0 else "stop",
                                  version_min=0, version_max=1))
        prompt = rng.integers(4, vocab, size=int(rng.integers(3, 9))).astype(np.int32)
        out.append(TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=prompt, samples=samples))
    return out


def _config(overrides: dict):
    from asyncppo.config.schema import AsyncPPOConfig
    from asyncppo.config.validate import resolve_derived

    cfg = AsyncPPOConfig()
    cfg.rollout.response_length = 64
    cfg.rollout.rollout_batch_size = 4
    cfg.rollout.num_return_sequences_in_group = 4
    for key, value in overrides.items():
        section, name = (cfg.model, key[len("model."):]) if key.startswith("model.") else (cfg.algorithm, key)
        *path, last = name.split(".")
        for part in path:
            section = getattr(section, part)
        setattr(section, last, value)
    return resolve_derived(cfg)


def learner_variants(ctx: Context) -> dict:
    """One step per variant; raises with every failing variant named, else reports the count."""
    import torch  # heavy: torch

    from asyncppo.data.tiny import build_tiny_model
    from asyncppo.learner.batch import collate_groups
    from asyncppo.learner.build import build_models

    device = torch.device(ctx.device)
    variants = VARIANTS + (CUDA_VARIANTS if ctx.device == "cuda" else [])
    failures: list[str] = []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(tmp, hidden=64, layers=2, heads=2, intermediate=128, seed=3)
        for i, (label, overrides) in enumerate(variants):
            try:
                models = build_models(_config(overrides), model_dir, None, device, 0, 1)
                vocab = min(int(models.actor.config.vocab_size), 16)
                metrics = models.updater.step(collate_groups(_groups(vocab, seed=i), 0))
                if not all(torch.isfinite(p).all() for p in models.actor.parameters()):
                    raise RuntimeError("non-finite parameters after the step")
                if not math.isfinite(float(metrics["actor/pg_loss"])):
                    raise RuntimeError(f"pg_loss {metrics['actor/pg_loss']}")
            except Exception as exc:  # every variant is tried; the rung fails with all of them named
                failures.append(f"{label}: {type(exc).__name__}: {exc}")
    if failures:
        raise RuntimeError(f"{len(failures)} of {len(variants)} variants failed: " + " || ".join(failures))
    return {"variants": len(variants), "passed": len(variants), "s": round(time.perf_counter() - t0, 1)}
