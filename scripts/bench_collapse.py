#!/usr/bin/env python
"""The large-update collapse of issue 9 and the settings that rescue it, side by side in one invocation.

Synchronous PPO on the built-in addition task with ``trainer.lr=2e-4 algorithm.ppo_epochs=2
algorithm.ppo_mini_batch_size=8`` (4 optimizer steps per batch) loses its held-out accuracy. This script trains that
configuration next to the variants in ``VARIANTS`` and prints held-out accuracy over steps and the update statistics
that explain it (approx_kl, clip fraction, entropy, grad norm, explained variance, advantage scale, optimizer steps).

Each variant is asyncppo's own update (:class:`PPOUpdate`, the composed config with the variant's overrides, the
learner's actor/critic loaders) fed synchronously by an in-process sampler (asyncppo/bench/inproc.py): what
``asyncppo launch rollout.max_staleness=0`` trains on, without Ray and the vLLM engine, so that several hundred
steps of several variants fit on a loaded 2-core machine. Variants run as parallel processes (``--parallel``):
learning, not speed, is compared, and the result does not depend on timing.

    python scripts/bench_collapse.py --steps 300
    python scripts/bench_collapse.py --variants collapse,early-stop --parallel 2
"""

from __future__ import annotations

import json
import os

COLLAPSE = ["trainer.lr=2e-4", "algorithm.ppo_epochs=2", "algorithm.ppo_mini_batch_size=8"]
VARIANTS = {
    "default": [],  # lr 1e-4, one optimizer step per batch
    "collapse": COLLAPSE,
    "early-stop": COLLAPSE + ["algorithm.early_stop_kl=0.02"],
    "early-stop-tight": COLLAPSE + ["algorithm.early_stop_kl=0.005"],
    "warmup": COLLAPSE + ["trainer.warmup_steps=50"],
    "no-whiten": COLLAPSE + ["algorithm.whiten_advantages=false"],
    "critic-lr": COLLAPSE + ["trainer.critic_lr=1e-4"],
    "grpo": COLLAPSE + ["algorithm=grpo", "algorithm.use_kl_loss=false"],
    "lr-1e-4": COLLAPSE + ["trainer.lr=1e-4"],
    "lr-5e-5": COLLAPSE + ["trainer.lr=5e-5"],
    "big-batch": COLLAPSE + ["rollout.rollout_batch_size=64", "algorithm.ppo_mini_batch_size=32"],
    "kl-anchor": COLLAPSE + ["algorithm.use_kl_loss=true", "algorithm.kl_loss_coef=0.1"],
    "1-epoch": COLLAPSE + ["algorithm.ppo_epochs=1"],
    "shared": ["model.shared_backbone=true"],  # the default with the critic as a value head on the actor
    "shared-big": ["model.shared_backbone=true", "rollout.rollout_batch_size=64", "algorithm.ppo_mini_batch_size=32",
                   "trainer.lr=2e-4", "algorithm.ppo_epochs=2"],
    "shared-critic-lr": ["model.shared_backbone=true", "trainer.critic_lr=1e-2"],
    "shared-big-3e-4": ["model.shared_backbone=true", "rollout.rollout_batch_size=64",
                        "algorithm.ppo_mini_batch_size=32", "trainer.lr=3e-4", "algorithm.ppo_epochs=2"],
    "shared-64x16-1ep": ["model.shared_backbone=true", "rollout.rollout_batch_size=64",
                         "algorithm.ppo_mini_batch_size=16", "trainer.lr=2e-4"],
    "shared-128x32-1ep": ["model.shared_backbone=true", "rollout.rollout_batch_size=128",
                          "algorithm.ppo_mini_batch_size=32", "trainer.lr=2e-4"],
    "shared-lr-2e-4": ["model.shared_backbone=true", "trainer.lr=2e-4"],
    "recipe-constant-lr": ["trainer.lr_schedule=constant"],  # the built-in recipe before the anneal
    "recipe-3e-4": ["trainer.lr=3e-4"],  # the built-in recipe (annealed) from a larger rate
    "shared-32-lr-2e-4": ["model.shared_backbone=true", "trainer.lr=2e-4", "rollout.rollout_batch_size=32"],
}
KEYS = [("actor/approx_kl", "kl"), ("actor/clipfrac", "clip"), ("actor/entropy", "ent"),
        ("actor/grad_norm", "gnorm"), ("critic/explained_variance", "ev"), ("adv_abs", "|adv|"),
        ("actor/optimizer_steps", "opt"), ("reward/mean", "reward")]


def run_one(name: str, steps: int, eval_every: int, out_path: str, extra: list[str]) -> None:
    import torch

    from asyncppo.config import load_config
    from asyncppo.data.tasks import get_task
    from asyncppo.data.tiny import resolve_model_path
    from asyncppo.learner.models import load_actor, load_reference
    from asyncppo.learner.value_head import build_critic
    from asyncppo.config.checks import uses_critic, uses_reference
    from asyncppo.learner.ppo import PPOUpdate
    from asyncppo.bench.inproc import evaluate, load, sampled_batch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config(["rollout.max_staleness=0", *VARIANTS[name], *extra])
    splits = get_task("addition", seed=0, num_eval=256).splits()
    path = resolve_model_path("builtin:tiny-addition")
    dev = torch.device("cpu")
    actor = load_actor(path, torch.float32, dev)
    critic = build_critic(cfg, path, torch.float32, dev, False) if uses_critic(cfg) else None
    tok = load(path)[1]
    reference = load_reference(path, torch.float32, dev) if uses_reference(cfg) else None
    update = PPOUpdate(cfg, actor, critic, reference, dev)
    import asyncppo.algo as algo

    seen = {}  # the advantages of the last update (not among the learner's metrics): their scale after whitening
    compute = algo.compute_advantages

    def spy(*a, **kw):
        adv, ret = compute(*a, **kw)
        mask = a[2] if len(a) > 2 else kw["mask"]
        seen["adv_abs"] = float((adv.abs() * mask).sum() / mask.sum())
        return adv, ret

    algo.compute_advantages = spy
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    order = torch.randperm(len(splits.train), generator=gen).tolist()
    rows_out = []
    with open(out_path, "w") as f:
        for step in range(steps + 1):
            if step % eval_every == 0:
                acc = evaluate(actor, tok, splits.eval)
                f.write(json.dumps({"step": step, "eval": acc}) + "\n")
                f.flush()
            if step == steps:
                break
            n = cfg.rollout.rollout_batch_size
            rows = [splits.train[order[(step * n + i) % len(order)]] for i in range(n)]
            batch = sampled_batch(actor, tok, rows, gen)
            m = update.step(batch)
            m["adv_abs"] = seen["adv_abs"]
            rows_out.append(m)
            f.write(json.dumps({"step": step + 1, **{k: m.get(k) for k, _ in KEYS}}) + "\n")
            f.flush()


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return sum(vals) / len(vals) if vals else float("nan")


def main() -> None:
    import sys
    import tempfile

    from asyncppo.bench.inproc import run_variants, variant_parser

    p = variant_parser(__doc__, steps=300, eval_every=50, variants="default,collapse,early-stop", parallel=3)
    p.add_argument("--window", type=int, default=50, help="learner steps per row of the statistics table")
    args = p.parse_args()
    if args.one:
        return run_one(args.one, args.steps, args.eval_every, os.path.join(args.keep, f"{args.one}.jsonl"),
                       args.overrides)
    names, root = [n for n in args.variants.split(",") if n], args.keep or tempfile.mkdtemp(prefix="bench_collapse_")
    run_variants([sys.executable, __file__], names, VARIANTS, root, steps=args.steps, eval_every=args.eval_every,
                 parallel=args.parallel, overrides=args.overrides)
    report(names, root, args.window)


def report(names: list[str], root: str, window: int) -> None:
    results = {}
    for name in names:
        path = os.path.join(root, f"{name}.jsonl")
        if os.path.exists(path):
            results[name] = [json.loads(line) for line in open(path)]
    print("\nheld-out accuracy, sampled (T=1, 256 prompts x 4) / greedy")
    steps = sorted({r["step"] for recs in results.values() for r in recs if "eval" in r})
    print(f"{'variant':<17}" + "".join(f"{'step ' + str(s):>14}" for s in steps))
    for name, recs in results.items():
        ev = {r["step"]: r["eval"] for r in recs if "eval" in r}
        print(f"{name:<17}" + "".join(f"{ev[s]['sampled']:>8.3f}/{ev[s]['greedy']:.3f}" if s in ev else f"{'-':>14}"
                                      for s in steps))
    print(f"\nupdate statistics, mean per {window} learner steps")
    print(f"{'variant':<17} {'steps':>8} " + " ".join(f"{short:>7}" for _, short in KEYS))
    for name, recs in results.items():
        train = [r for r in recs if "eval" not in r]
        for lo in range(0, len(train), window):
            rows = train[lo : lo + window]
            span = f"{rows[0]['step']}-{rows[-1]['step']}"
            print(f"{name:<17} {span:>8} " + " ".join(f"{_mean([r.get(k) for r in rows]):7.4f}" for k, _ in KEYS))


if __name__ == "__main__":
    main()
