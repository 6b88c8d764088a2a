#!/usr/bin/env python
"""Asynchronous against synchronous PPO on the same machine, task and budget, side by side in one command.

Runs ``asyncppo launch`` twice with identical settings except ``rollout.max_staleness`` (0 = synchronous on-policy
PPO; k > 0 = asynchronous), each for the same number of learner steps (= the same number of trained samples), and
prints wall time, the reward reached, held-out accuracy and both sides' busy fractions.

A long-tailed response-length distribution comes from the policy itself: with a short supervised warm start
(``--sft-steps``) the built-in model often fails to stop and runs on to ``--response-length`` tokens, so most samples
are 3 tokens long and a few are ten times longer — the shape that makes synchronous generation wait on stragglers.

    python scripts/bench_async_vs_sync.py --steps 60 --staleness 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def run_once(label: str, staleness: int, args, root: str) -> dict:
    out = os.path.join(root, label)
    cmd = [
        sys.executable, "-m", "asyncppo", "launch",
        f"trainer.output_dir={out}",
        f"trainer.total_steps={args.steps}",
        f"trainer.sft_warmup_steps={args.sft_steps}",
        f"rollout.max_staleness={staleness}",
        f"rollout.response_length={args.response_length}",
        f"rollout.rollout_batch_size={args.batch}",
        f"cluster.rollout_workers={args.workers}",
        "trainer.logger.wandb=false",
        *args.overrides,
    ]
    print(f"[bench] {label}: {' '.join(cmd[2:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-4000:])
        raise SystemExit(f"[bench] {label} failed with exit code {proc.returncode}")
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    train = [r for r in records if "reward/mean" in r]
    evals = [r for r in records if "eval/accuracy_sampled" in r]
    tail = train[-10:]
    steady = train[len(train) // 4 :]  # skip start-up (engine load, first batches)

    def mean(key, rows):
        return sum(r[key] for r in rows) / max(len(rows), 1)

    lengths = [r["response_length/mean"] for r in train]
    return {
        "label": label,
        "wall_s": wall,
        "train_s": sum(r["time/step_s"] for r in train),
        "steady_step_s": mean("time/step_s", steady),
        "samples": train[-1]["samples_trained"],
        "reward_first10": mean("reward/mean", train[:10]),
        "reward_last10": mean("reward/mean", tail),
        "eval_before": evals[0]["eval/accuracy_sampled"] if evals else float("nan"),
        "eval_after": evals[-1]["eval/accuracy_sampled"] if evals else float("nan"),
        "rollout_busy": mean("util/rollout_busy", steady),
        "train_busy": mean("util/train_busy", steady),
        "lag_mean": mean("staleness/mean", train),
        "lag_max": max(r["staleness/max"] for r in train),
        "resp_len_mean": sum(lengths) / len(lengths),
        "resp_len_max_step_mean": max(lengths),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--staleness", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--sft-steps", type=int, default=300)
    p.add_argument("--response-length", type=int, default=16)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for both runs")
    args = p.parse_args()
    root = tempfile.mkdtemp(prefix="asyncppo-bench-")
    sync = run_once("sync", 0, args, root)
    asyn = run_once(f"async-k{args.staleness}", args.staleness, args, root)
    rows = [
        ("wall time, whole launch (s)", "wall_s", "{:.1f}"),
        ("learner time for all steps (s)", "train_s", "{:.1f}"),
        ("steady-state s / step", "steady_step_s", "{:.3f}"),
        ("samples trained", "samples", "{:d}"),
        ("reward, first 10 steps", "reward_first10", "{:.3f}"),
        ("reward, last 10 steps", "reward_last10", "{:.3f}"),
        ("held-out accuracy before (T=1)", "eval_before", "{:.3f}"),
        ("held-out accuracy after (T=1)", "eval_after", "{:.3f}"),
        ("rollout busy fraction", "rollout_busy", "{:.2f}"),
        ("train busy fraction", "train_busy", "{:.2f}"),
        ("version lag mean / max", None, None),
        ("response length mean (tokens)", "resp_len_mean", "{:.2f}"),
    ]
    print()
    print(f"| metric | sync (max_staleness=0) | async (max_staleness={args.staleness}) | async / sync |")
    print("|---|---|---|---|")
    for name, key, fmt in rows:
        if key is None:
            print(f"| {name} | {sync['lag_mean']:.2f} / {sync['lag_max']:.0f} | "
                  f"{asyn['lag_mean']:.2f} / {asyn['lag_max']:.0f} | |")
            continue
        a, s = asyn[key], sync[key]
        ratio = f"{a / s:.2f}" if isinstance(s, (int, float)) and s else ""
        print(f"| {name} | {fmt.format(s)} | {fmt.format(a)} | {ratio} |")
    speedup = sync["train_s"] / asyn["train_s"]
    print(f"\nspeed-up of async over sync in learner wall time for {sync['samples']} samples: {speedup:.2f}x")


if __name__ == "__main__":
    main()
