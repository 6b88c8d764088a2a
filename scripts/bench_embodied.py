"""Embodied PPO benchmark: the asynchronous launcher against a single-process reference loop, side by side.

The reference loop is the same algorithm with the same parts (gymnasium vector env, :class:`ActorCritic`,
:class:`SegmentBuilder`, :class:`EmbodiedPPO`) in one process: collect a segment, update, repeat - no Ray, no
sockets, no weight broadcast, no overlap. The launcher run is ``asyncppo launch`` with the same overrides (and
``rollout.max_staleness=k``). Both print wall time, environment steps per second and the return; a PNG of the
return curves goes to ``--plot``.

    .venv/bin/python scripts/bench_embodied.py env=cartpole --ks 1 --plot docs/img/cartpole.png
    .venv/bin/python scripts/bench_embodied.py env=HalfCheetah-v5 --ks 0 2 --workers 2 --skip-reference
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def reference_loop(overrides: list[str]) -> dict:
    """One process, strictly alternating: collect rollout_batch_size segments, update. Returns the curve."""
    import numpy as np
    import torch

    from asyncppo.config import load_config
    from asyncppo.models.actor_critic import ActorCritic
    from asyncppo.envs.segments import SegmentBuilder
    from asyncppo.envs.spaces import describe_env, make_vector_env
    from asyncppo.learner.embodied_update import EmbodiedPPO

    torch.set_num_threads(1)
    cfg = load_config(overrides)
    e, tr = cfg.env, cfg.trainer
    desc = describe_env(e)
    torch.manual_seed(tr.seed)
    policy = ActorCritic(desc.policy_spec(cfg))
    updater = EmbodiedPPO(cfg, policy, torch.device("cpu"))
    env = make_vector_env(e, e.num_envs)
    builder = SegmentBuilder(desc, e.num_envs, e.segment_length)
    obs, _ = env.reset(seed=tr.seed + 1000)
    builder.start(np.asarray(obs))
    gen = torch.Generator().manual_seed(tr.seed + 1000)
    curve, recent, steps, t0 = [], [], 0, time.perf_counter()
    for step in range(1, tr.total_steps + 1):
        segments = []
        for _ in range(cfg.rollout.rollout_batch_size):
            while not builder.full:
                a, lp = policy.act(torch.as_tensor(builder.obs), gen)
                env_a = a if desc.discrete else np.clip(a, desc.action_low, desc.action_high)
                o, r, term, trunc, info = env.step(env_a)
                builder.record(a, lp, r, term, trunc, np.asarray(o), info, step - 1)
            segments.append(builder.finish(len(segments), "ref"))
        policy.eval()
        updater.step(segments)
        steps += sum(s.num_envs * s.num_steps for s in segments)
        recent = (recent + [float(x) for s in segments for x in s.episode_returns])[-100:]
        curve.append((steps, time.perf_counter() - t0, float(np.mean(recent)) if recent else 0.0))
    wall = time.perf_counter() - t0
    return {"mode": "reference", "wall_s": wall, "env_steps": steps, "env_steps_per_s": steps / wall,
            "return_recent": curve[-1][2], "curve": curve}


def launched(overrides: list[str], k: int, workers: int) -> dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench-embodied-k{k}-"))
    cmd = [sys.executable, "-m", "asyncppo", "launch", *overrides, f"rollout.max_staleness={k}",
           f"cluster.rollout_workers={workers}", f"trainer.output_dir={out}", "trainer.logger.wandb=false",
           "trainer.logger.console=false"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return read_run(out, f"async k={k}, {workers} worker(s)", total)


def read_run(out: Path, label: str, total: float = 0.0) -> dict:
    """A finished ``asyncppo launch`` run directory as a result row (``--add-run`` reuses one)."""
    out = Path(out)
    summary = json.loads((out / "summary.json").read_text())
    curve = [(r["env_steps"], 0.0, r["episode/return_recent"])
             for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "env_steps" in r]
    return {"mode": label, "wall_s": summary["wall_s"], "launch_total_s": total,
            "env_steps": summary["env_steps"], "env_steps_per_s": summary["env_steps_per_s"],
            "return_recent": summary["return_recent"], "curve": curve, "run_dir": str(out),
            "lag_max": max((json.loads(line).get("staleness/max", 0) for line in
                            (out / "metrics.jsonl").read_text().splitlines()), default=0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", default=["env=cartpole"])
    p.add_argument("--ks", type=int, nargs="*", default=[1], help="staleness bounds to launch (none: only the reference)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--skip-reference", action="store_true")
    p.add_argument("--plot", default="")
    p.add_argument("--json", default="")
    p.add_argument("--target", type=float, default=475.0, help="report the env steps at which return(100) first "
                   "reaches this")
    p.add_argument("--add-run", action="append", default=[], metavar="LABEL=DIR",
                   help="also report (and plot) a finished run directory")
    args = p.parse_args()
    results = [read_run(Path(spec.rsplit("=", 1)[1]), spec.rsplit("=", 1)[0]) for spec in args.add_run]
    jobs = ([] if args.skip_reference else [lambda: reference_loop(args.overrides)])
    jobs += [lambda k=k: launched(args.overrides, k, args.workers) for k in args.ks]
    for job in jobs:
        results.append(job())
        if args.json:  # after every job: a long benchmark loses nothing to a later failure
            Path(args.json).write_text(json.dumps(results, indent=1))
    print(f"{'mode':<28} {'wall s':>8} {'env steps':>10} {'steps/s':>9} {'return(100)':>12} "
          f"{'steps to ' + format(args.target, 'g'):>14}")
    for r in results:
        hit = next((x for x, _, y in r["curve"] if y >= args.target), None)
        r["steps_to_target"] = hit
        print(f"{r['mode']:<28} {r['wall_s']:>8.1f} {r['env_steps']:>10} {r['env_steps_per_s']:>9.0f} "
              f"{r['return_recent']:>12.1f} {str(hit or 'not reached'):>14}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for r in results:
            xs, _, ys = zip(*r["curve"])
            ax.plot(xs, ys, label=r["mode"])
        ax.set_xlabel("environment steps")
        ax.set_ylabel("mean return, last 100 episodes")
        ax.set_title(" ".join(args.overrides))
        ax.legend()
        ax.grid(alpha=0.3)
        fig.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(args.plot)), exist_ok=True)
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
