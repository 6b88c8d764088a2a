"""``asyncppo bench lora``: LoRA against full fine-tuning on the built-in addition task, at equal steps, held-out
accuracy side by side.

Each variant is the built-in recipe (configs/data/addition.yaml: 128 prompts x 8 samples, 4 mini-batches, the critic
as a value head on the policy, lr annealed to 0) with its own overrides, trained synchronously in process:
asyncppo's own models and update (learner/build.py, so the LoRA actor, its reference and optimiser are the ones a
launch builds) fed by the in-process sampler of inproc.py, i.e. what ``rollout.max_staleness=0`` trains on, without
Ray and the engines. Learning, not speed, is compared, so variants run as parallel processes. Also kept: the
trainable parameters, the actor's optimiser state and the bytes one weight push sends, the costs LoRA is chosen for.
"""

from __future__ import annotations

import json
import os
import sys

LORA = ["model.lora_rank=8", "model.lora_alpha=16"]
VARIANTS = {
    "full": [],  # the built-in recipe: lr 2e-4
    "lora-2e-4": LORA + ["trainer.lr=2e-4"],  # the full fine-tuning rate
    "lora-1e-3": LORA + ["trainer.lr=1e-3"],
    "lora-2e-3": LORA + ["trainer.lr=2e-3"],  # ~10x the full rate, the usual LoRA rule
    "lora-4e-3": LORA + ["trainer.lr=4e-3"],
}


def _sizes(actor, updater, pushed: dict) -> dict:
    opt = sum(t.numel() * t.element_size() for s in updater.actor_opt.state.values() for t in s.values()
              if hasattr(t, "numel"))
    return {"trainable": sum(p.numel() for p in actor.parameters() if p.requires_grad), "optimizer_bytes": opt,
            "push_bytes": sum(t.numel() * t.element_size() for t in pushed.values())}


def run_one(name: str, steps: int, eval_every: int, out_path: str, extra: list[str]) -> None:
    """Train one variant in this process, writing its evaluations and rewards to ``out_path`` (JSON lines)."""
    import torch

    from asyncppo.bench.inproc import evaluate, load, sampled_batch
    from asyncppo.config import load_config
    from asyncppo.data.tasks import get_task
    from asyncppo.data.tiny import resolve_model_path
    from asyncppo.learner.build import build_models
    from asyncppo.learner.lora import adapter_tensors, is_lora
    from asyncppo.learner.models import full_state_dict

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cfg = load_config(["rollout.max_staleness=0", f"trainer.total_steps={steps}", *VARIANTS[name], *extra])
    splits = get_task("addition", seed=0, num_eval=256).splits()
    path = resolve_model_path(cfg.model.path)
    models = build_models(cfg, path, None, torch.device("cpu"), 0, 1)
    actor, update, tok = models.actor, models.updater, load(path)[1]
    gen = torch.Generator().manual_seed(cfg.trainer.seed)
    order = torch.randperm(len(splits.train), generator=gen).tolist()
    with open(out_path, "w") as f:
        for step in range(steps + 1):
            if step % eval_every == 0 or step == steps:
                f.write(json.dumps({"step": step, "eval": evaluate(actor, tok, splits.eval)}) + "\n")
                f.flush()
            if step == steps:
                break
            n = cfg.rollout.rollout_batch_size
            rows = [splits.train[order[(step * n + i) % len(order)]] for i in range(n)]
            m = update.step(sampled_batch(actor, tok, rows, gen))
            f.write(json.dumps({"step": step + 1, "reward": m.get("reward/mean")}) + "\n")
            if step == 0:
                pushed = adapter_tensors(actor) if is_lora(actor) else full_state_dict(actor)
                f.write(json.dumps({"sizes": _sizes(actor, update, pushed), "lr": cfg.trainer.lr}) + "\n")
            f.flush()


def read_variant(path: str) -> dict:
    """A variant's record: its evaluations over steps, its sizes and rate."""
    with open(path, encoding="utf-8") as f:
        recs = [json.loads(line) for line in f]
    info = next((r for r in recs if "sizes" in r), {"sizes": {}, "lr": None})
    return {"evals": [r for r in recs if "eval" in r], **info}


def run(opts: dict, seed: int, work: str) -> dict:
    from asyncppo.bench.inproc import run_variants

    names = list(opts["variants"])
    run_variants([sys.executable, "-m", "asyncppo.bench.lora"], names, VARIANTS, work, steps=opts["steps"],
                 eval_every=opts["eval_every"], parallel=opts["parallel"],
                 overrides=[*opts["overrides"], f"trainer.seed={seed}"])
    figures, units, detail = {}, {}, {}
    for name in names:
        path = os.path.join(work, f"{name}.jsonl")
        if not os.path.exists(path):
            continue
        rec = detail[name] = read_variant(path)
        start, end = rec["evals"][0]["eval"], rec["evals"][-1]["eval"]
        for metric in ("sampled", "greedy"):
            figures[f"held-out {metric} {name}"], units[f"held-out {metric} {name}"] = end[metric], "accuracy"
        print(f"[lora] {name}: {start['sampled']:.3f} / {start['greedy']:.3f} -> {end['sampled']:.3f} / "
              f"{end['greedy']:.3f} at step {rec['evals'][-1]['step']}", flush=True)
    full = detail.get("full")
    for name in names:
        if name != "full" and full and name in detail:
            for metric in ("sampled", "greedy"):
                key = f"{metric} {name} - full"
                figures[key] = figures[f"held-out {metric} {name}"] - figures[f"held-out {metric} full"]
                units[key] = "accuracy"
    return {"figures": figures, "units": units, "detail": detail}


def main() -> None:
    """``--one NAME``: train one variant (how :func:`run_variants` starts each, as its own process)."""
    from asyncppo.bench.inproc import variant_parser

    args = variant_parser(__doc__, steps=160, eval_every=40, variants="full,lora-2e-3", parallel=2).parse_args()
    run_one(args.one, args.steps, args.eval_every, os.path.join(args.keep, f"{args.one}.jsonl"), args.overrides)


if __name__ == "__main__":
    main()
