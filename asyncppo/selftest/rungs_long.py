"""The one-device rung that shows why the trainer is asynchronous: ``data=long`` (answers up to 1,028 tokens,
long-tailed) under ``--gpus 1``, synchronous PPO against the task's own preset, to the same trained samples.

Why on one shared device: most GPU machines a user tries first have one GPU, and the long tail is where waiting
for a batch's longest answer costs synchronous PPO most (on one H100: 63.5 s against 22.4 s of learner time, 2.84x;
docs/benchmarks.md). The two launches differ only in how generation is scheduled, as in
``asyncppo bench async-vs-sync`` (asyncppo/bench/async_sync.py): ``sync`` is ``max_staleness=0`` with whole-batch generation, ``async`` the
preset (continuous generation with in-flight weight updates within its window, which the learner moves: ``auto``
from ``k = 12, j = 3``; on a GPU that is where it must show it adapts, docs/staleness.md).
Learner time is the sum of the learner's steps (``time/step_s``): what a run pays per trained sample once started.
"""

from __future__ import annotations

import os

from asyncppo.config.schedules import schedule_overrides
from asyncppo.selftest.ladder import Context, Skip
from asyncppo.selftest.launches import launch_run, mean_of, missing_launch_stack


def shared_long(ctx: Context) -> dict:
    """``data=long`` under ``--gpus 1``: sync against the preset. On CUDA 20 steps of the preset's batch (16
    prompts x 8 answers) with its warm-started model; on CPU the same code path at 3 steps of 2 x 4 answers on the
    model without its warm start (a few seconds to build instead of minutes)."""
    missing = missing_launch_stack()
    if missing:
        raise Skip(f"needs {', '.join(missing)} for the launches, not importable here")
    cuda = ctx.device == "cuda"
    steps = 20 if cuda else 3
    common = ["--gpus", "1", f"cluster.shared_device={ctx.device}", "data=long", "rollout.engine=hf",
              f"trainer.total_steps={steps}", "trainer.eval_every=0", "trainer.eval_at_start=false",
              "data.num_eval_prompts=0", "trainer.save_every=0"]
    if not cuda:
        common += ["trainer.sft_warmup_steps=0", "rollout.rollout_batch_size=2",
                   "rollout.num_return_sequences_in_group=4"]
    figures: dict = {}
    for label, extra in (("sync", schedule_overrides("sync")), ("async", [])):
        run_dir, records = launch_run(ctx, f"long-{label}", common + extra, 900 if cuda else 300)
        if len(records) != steps:
            raise RuntimeError(f"{label}: expected {steps} learner steps, got {len(records)}")
        lag_max = max(int(r["staleness/max"]) for r in records)
        bound = _staleness_bound(run_dir)
        if lag_max > bound:
            raise RuntimeError(f"{label}: a sample was trained {lag_max} versions late (bound {bound})")
        figures[f"{label} learner s"] = round(sum(float(r["time/step_s"]) for r in records), 2)
        figures[f"{label} wait s"] = round(sum(float(r.get("time/wait_s", 0.0)) for r in records), 2)
        figures[f"{label} lag max"] = lag_max
    figures["response length mean"] = mean_of(records, "response_length/mean")
    figures["speed-up"] = round(figures["sync learner s"] / figures["async learner s"], 2)
    return figures


def _staleness_bound(run_dir: str) -> int:
    """The bound the launch ran under (its saved config): 0 for sync; the preset's window is auto, whose ``k`` may
    widen up to ``rollout.max_staleness_cap`` (a fixed one is its ``rollout.max_staleness``)."""
    import yaml  # PyYAML comes with the launch stack this rung needs (omegaconf)

    with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
        rollout = yaml.safe_load(f)["rollout"]
    return int(rollout["max_staleness_cap"] if "k" in rollout.get("window_auto", "") else rollout["max_staleness"])
