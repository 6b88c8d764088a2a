"""``asyncppo bench embodied``: embodied PPO, the asynchronous launcher against a single-process reference loop.

The reference loop is the same algorithm with the same parts (gymnasium vector env, :class:`ActorCritic`,
:class:`SegmentBuilder`, :class:`EmbodiedPPO`) in one process: collect a segment, update, repeat - no Ray, no
sockets, no weight broadcast, no overlap. The launcher run is ``asyncppo launch`` with the same overrides (and
``rollout.max_staleness=k``). Figures: wall time, environment steps per second, the mean return of the last 100
episodes, the best of it within ``budget_steps`` environment steps (what the target is set on: a run that never
gets there is a miss, not a missing number) and the env steps at which it first reached ``target_return``.
Sample efficiency (does the lag cost learning?) and speed (does the overlap pay?) are separate questions, and both
are kept.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from asyncppo.bench.limit import REPO

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


def launched(overrides: list[str], k: int, workers: int, work: str) -> dict:
    """``asyncppo launch`` with the same overrides at ``max_staleness=k``, read back (:func:`read_run`)."""
    out = Path(work) / f"k{k}"
    cmd = [sys.executable, "-m", "asyncppo", "launch", *overrides, f"rollout.max_staleness={k}",
           f"cluster.rollout_workers={workers}", f"trainer.output_dir={out}", "trainer.logger.wandb=false",
           "trainer.logger.console=false"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"launch failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
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


def run(opts: dict, seed: int, work: str) -> dict:
    overrides = [*opts["preset"], *opts["overrides"], f"trainer.seed={seed}"]
    results = [] if not opts["reference"] else [reference_loop(overrides)]
    results += [launched(overrides, int(k), opts["workers"], work) for k in opts["ks"]]
    figures, units = {}, {}
    for r in results:
        hit = next((x for x, _, y in r["curve"] if y >= opts["target_return"]), None)
        best = max((y for x, _, y in r["curve"] if x <= opts["budget_steps"]), default=None)
        r["steps_to_target"] = hit
        label = r["mode"]
        for key, value, unit in ((f"best return within {opts['budget_steps']} env steps {label}", best, "return"),
                                 (f"env steps to {opts['target_return']:g} {label}", hit, "env steps"),
                                 (f"env steps/s {label}", r["env_steps_per_s"], "env steps/s"),
                                 (f"return {label}", r["return_recent"], "return")):
            figures[key], units[key] = value, unit
        print(f"[embodied] {label}: {r['wall_s']:.1f} s, {r['env_steps']} env steps, "
              f"{r['env_steps_per_s']:.0f} steps/s, return {r['return_recent']:.1f}, steps to target "
              f"{hit or 'not reached'}", flush=True)
    ref = next((r for r in results if r["mode"] == "reference"), None)
    for r in results:
        if ref is not None and r is not ref:
            key = f"speed over reference {r['mode']}"
            figures[key], units[key] = r["env_steps_per_s"] / ref["env_steps_per_s"], "ratio"
    return {"figures": figures, "units": units, "detail": {"runs": results}}
