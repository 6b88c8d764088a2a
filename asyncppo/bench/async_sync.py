"""``asyncppo bench async-vs-sync`` (and ``limit``, ``occupancy``): synchronous PPO against asynchronous PPO on real
launches, side by side, with the pipeline's limit beside them.

Launches of ``asyncppo launch`` on the same task, model, seed and number of trained samples, one per mode
(asyncppo/config/schedules.py):

* ``sync``        - ``max_staleness=0``, whole-batch generation (generate a batch, train on it, repeat);
* ``async-batch`` - ``max_staleness=k``, whole-batch generation, weights loaded between batches;
* ``async-cont``  - ``max_staleness=k``, continuous generation with in-flight weight updates;
* ``async-cont-lookahead`` - the same with admission lookahead ``j`` (the ``data=long`` preset's schedule).

The rollout worker and the learner are pinned to disjoint cores (``rollout_cpus`` / ``learner_cpus``), as disjoint
GPU pools would be. Figures per mode: learner time to the same samples, trained samples/s, engine occupancy (whole
run and without the run's drain), held-out accuracy after; the speed-up of each async mode over sync in learner
time; with ``limit=true`` the pipeline's limit (the engine alone and the learner alone on the same samples, each on
its own cores, before and after the launches: asyncppo/bench/limit.py) and ``efficiency = limit / learner time``;
with ``replay=true`` the limit on each launch's own work (the engine alone regenerating the launch's trained samples
at their own lengths, the learner alone on its own batches) and the efficiency against that. Why both: the limit's
sides work on the starting policy's answers, a launch on those of the policy it learns, and on ``data=long`` their
lengths differ.
"""

from __future__ import annotations

import os

from asyncppo.bench.launches import Launch, run_once
from asyncppo.bench.limit import measure_limit, replay_limit

ROWS = [  # (label, key, format) of the printed table
    ("learner time to the same samples (s)", "train_s", "{:.1f}"),
    ("  of which the update (s)", "update_s", "{:.1f}"),
    ("  of which waiting for groups (s)", "wait_s", "{:.1f}"),
    ("wall time, whole launch (s)", "wall_s", "{:.1f}"),
    ("trained samples / s", "samples_per_s", "{:.1f}"),
    ("engine occupancy", "occupancy", "{:.2f}"),
    ("  without the last step (the run's drain)", "occupancy_steady", "{:.2f}"),
    ("rollout busy", "rollout_busy", "{:.2f}"),
    ("train busy", "train_busy", "{:.2f}"),
    ("free slots, no ticket (engine s)", "unfilled_ticket_s", "{:.1f}"),
    ("push latency p50 (s)", "push_p50", "{:.3f}"),
    ("waste (tokens dropped / generated)", "waste", "{:.3f}"),
    ("response length mean", "len_mean", "{:.1f}"),
    ("lag mean", "lag_mean", "{:.2f}"),
    ("lag max", "lag_max", "{:.0f}"),
    ("held-out accuracy after (T=1)", "eval_after", "{:.3f}"),
]


def mean_limit(limits: list):
    """Each side's mean over the measurements (the limit is then the slower mean side)."""
    from asyncppo.report.limit import PipelineLimit

    def avg(key):
        return sum(getattr(m, key) for m in limits) / len(limits)

    return PipelineLimit(engine_s=avg("engine_s"), learner_s=avg("learner_s"), samples=limits[0].samples,
                         engine_occupancy=avg("engine_occupancy"))


def print_table(results: list[dict]) -> None:
    print("\n| metric | " + " | ".join(r["label"] for r in results) + " |")
    print("|---|" + "---|" * len(results))
    for name, key, fmt in ROWS:
        cells = ["-" if r.get(key) is None or r[key] != r[key] else fmt.format(r[key]) for r in results]
        print(f"| {name} | " + " | ".join(cells) + " |")


def figures_of(results: list[dict]) -> tuple[dict, dict]:
    """The figures a result file keeps, per mode, and against sync where a sync launch ran."""
    figures, units = {}, {}

    def put(name: str, value, unit: str) -> None:
        figures[name], units[name] = value, unit

    sync = next((r for r in results if r["label"] == "sync"), None)
    for r in results:
        m = r["label"]
        put(f"learner s {m}", r["train_s"], "s")
        put(f"samples/s {m}", r["samples_per_s"], "samples/s")
        put(f"occupancy {m}", r["occupancy"], "fraction")
        put(f"occupancy steady {m}", r["occupancy_steady"], "fraction")
        put(f"held-out after {m}", r["eval_after"], "accuracy")
        put(f"lag max {m}", r["lag_max"], "versions")
        if "efficiency" in r:
            put(f"efficiency {m}", r["efficiency"], "ratio")
        if "own_efficiency" in r:
            put(f"efficiency own work {m}", r["own_efficiency"], "ratio")
        if sync is not None and r is not sync:
            put(f"speedup over sync {m}", sync["train_s"] / r["train_s"], "x")
            put(f"held-out {m} - sync", r["eval_after"] - sync["eval_after"], "accuracy")
    return figures, units


def run(opts: dict, seed: int, work: str) -> dict:
    launch = Launch(steps=opts["steps"], staleness=opts["staleness"], lookahead=opts["lookahead"],
                    eval_at_start=opts["eval_at_start"], replay=opts["replay"], rollout_cpus=opts["rollout_cpus"],
                    learner_cpus=opts["learner_cpus"], preset=list(opts["preset"]),
                    overrides=[*opts["overrides"], f"trainer.seed={seed}"])
    shared = [*launch.preset, *launch.overrides]
    limits = []
    if opts["limit"]:  # before and after the launches: on a shared box the load drifts, and the spread shows it
        limits.append(measure_limit(shared, launch.steps, launch.rollout_cpus, launch.learner_cpus,
                                    os.path.join(work, "limit-before"))[0])
    results = [run_once(m, launch, work) for m in opts["modes"]]
    detail: dict = {}
    if opts["limit"]:
        limits.append(measure_limit(shared, launch.steps, launch.rollout_cpus, launch.learner_cpus,
                                    os.path.join(work, "limit-after"))[0])
        limit = mean_limit(limits)
        detail["limit"] = limit.as_dict()
        detail["limits"] = [m.as_dict() for m in limits]
        for r in results:
            r["efficiency"] = limit.efficiency(r["train_s"])
    if opts["replay"]:
        for r in results:
            own, _ = replay_limit(r["run_dir"], [*shared, *r["mode_overrides"]], launch.rollout_cpus,
                                  launch.learner_cpus, os.path.join(work, "replay-" + os.path.basename(r["run_dir"])))
            r["own_limit"] = own.as_dict()
            r["own_efficiency"] = own.efficiency(r["train_s"])
    print_table(results)
    figures, units = figures_of(results)
    for name in sorted(figures):
        if name.startswith(("speedup", "efficiency")):
            print(f"[bench] {name}: {figures[name]:.2f}", flush=True)
    detail["launches"] = results
    return {"figures": figures, "units": units, "detail": detail}
