"""Seconds per PPO update of the built-in recipe at 1 or 2 torch threads, with OpenMP's wait policy as given, on an
idle machine or next to a process that spins on one core (what an engine sharing the cores looks like to OpenMP).

Each configuration runs in its own process (the wait policy is read when torch loads OpenMP):

    python scripts/bench_update_threads.py                      # threads 1 and 2 x default / PASSIVE, idle
    python scripts/bench_update_threads.py --busy               # the same next to a spinning process

Batches are sampled from the built-in model itself (asyncppo/bench/inproc.py); 5 timed updates after one warm-up.
Results and their use: docs/benchmarks.md, "The embedded default against the 5-minute target".
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def one(threads: int, overrides: list[str]) -> None:
    import torch

    torch.set_num_threads(threads)
    sys.path.insert(0, HERE)
    from asyncppo.bench.inproc import load, sampled_batch

    from asyncppo.config import load_config
    from asyncppo.data.tasks import get_task
    from asyncppo.data.tiny import resolve_model_path
    from asyncppo.learner.models import load_actor
    from asyncppo.learner.ppo import PPOUpdate
    from asyncppo.learner.value_head import build_critic

    cfg = load_config(overrides)
    model_dir = resolve_model_path("builtin:tiny-addition")
    dev = torch.device("cpu")
    actor = load_actor(model_dir, torch.float32, dev)
    update = PPOUpdate(cfg, actor, build_critic(cfg, model_dir, torch.float32, dev, False), None, dev)
    tok = load(model_dir)[1]
    rows = get_task("addition", seed=0, num_eval=256).splits().train
    gen = torch.Generator().manual_seed(0)
    prompts = cfg.rollout.rollout_batch_size
    batches = [sampled_batch(actor, tok, rows[i * prompts:(i + 1) * prompts], gen) for i in range(6)]
    update.step(batches[0])
    t0 = time.perf_counter()
    for b in batches[1:]:
        update.step(b)
    print(f"RESULT {(time.perf_counter() - t0) / 5:.3f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy", action="store_true", help="run next to a process spinning on one core")
    ap.add_argument("--one", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="config overrides (default: the built-in recipe)")
    args = ap.parse_args()
    if args.one:
        return one(args.one, args.overrides)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        print(f"PPO update of the recipe, seconds per step ({'one core busy' if args.busy else 'idle'}):")
        for threads, policy in ((1, ""), (2, ""), (2, "PASSIVE")):
            env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
            if policy:
                env["OMP_WAIT_POLICY"] = policy
            out = subprocess.run([sys.executable, __file__, "--one", str(threads), *args.overrides], env=env,
                                 capture_output=True, text=True, check=True).stdout
            secs = next(line.split()[1] for line in out.splitlines() if line.startswith("RESULT"))
            print(f"  threads {threads}  wait policy {policy or 'default':8}  {secs} s", flush=True)
    finally:
        if spinner is not None:
            spinner.kill()


if __name__ == "__main__":
    main()
