"""``asyncppo bench push-cadence``: ``rollout.sync_every=auto`` against each fixed push cadence, on the same work.

One seed launches the task at one fixed window (``staleness``, ``lookahead``) once per fixed cadence in
``cadences`` (``rollout.sync_every=s``), once with ``rollout.sync_every=auto`` (learner/push_cadence.py), then the
``control`` cadence a second time, all in the ``async-cont-lookahead`` schedule, pinned as every schedule benchmark is
(bench/launches.py). The default task is ``data=reverse`` as ``auto-window-reverse`` runs it: learner steps of
0.07-0.15 s against weight loads of ~0.02 s, the one task here where a push every step costs the engine a real share
of its time, and where the benchmarks pushed every second step by hand.

Figures: each launch's learner time to the same samples, mean lag, pushes the engines loaded and held-out accuracy
after; ``auto / best fixed`` (the target: at most 1.05, as for the auto window), ``worst fixed / auto`` and
``control / best fixed``, the noise floor: a second launch of a fixed cadence judged as auto is (window_sweep.py
says why a ratio near it is noise). The best fixed cadence is the best of the seed's own launches, so a lucky fixed
run counts against auto.
"""

from __future__ import annotations

import json
import os

from asyncppo.bench.async_sync import print_table
from asyncppo.bench.launches import Launch, run_once
from asyncppo.bench.window_sweep import AGAIN, AUTO, per_launch, versus_fixed


def labels(cadences: list[int], control: int) -> list[tuple[str, int | str]]:
    """(label, sync_every) of each launch: ``s<s>`` per fixed cadence, ``auto``, then the control again."""
    if control not in cadences:
        raise ValueError(f"the control cadence {control} is not one of the sweep's cadences {cadences}")
    return [*((f"s{s}", s) for s in cadences), (AUTO, AUTO), (f"s{control}{AGAIN}", control)]


def cadence_used(run_dir: str) -> dict:
    """The fewest, most and mean steps between pushes an auto run used (``sync/every``), and the summary's pushes."""
    every = []
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "sync/every" in rec:
                every.append(rec["sync/every"])
    return {"min": min(every), "max": max(every), "mean": sum(every) / len(every)} if every else {}


def loads(run_dir: str) -> float:
    """Weight loads the engines made over the run (summary.json's ``rollout.weight_loads``)."""
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as f:
        return float(json.load(f).get("rollout", {}).get("weight_loads", float("nan")))


def compare(results: list[dict]) -> tuple[dict, dict]:
    """The figures of one seed: per launch, and auto against the best and worst fixed cadence."""
    figures, units, put = per_launch(results, [("learner s", "train_s", "s"), ("lag mean", "lag_mean", "versions"),
                                               ("loads", "loads", "pushes"),
                                               ("held-out after", "eval_after", "accuracy")])
    auto, _, best = versus_fixed(results, put)
    put("best fixed s", float(best["label"][1:]), "steps")
    if auto.get("cadence"):
        put("auto cadence mean", auto["cadence"]["mean"], "steps")
    return figures, units


def run(opts: dict, seed: int, work: str) -> dict:
    results = []
    for label, s in labels(opts["cadences"], opts["control"]):
        launch = Launch(steps=opts["steps"], staleness=opts["staleness"], lookahead=opts["lookahead"],
                        rollout_cpus=opts["rollout_cpus"], learner_cpus=opts["learner_cpus"],
                        preset=list(opts["preset"]),
                        overrides=[*opts["overrides"], f"rollout.sync_every={s}", f"trainer.seed={seed}"])
        r = run_once(label, launch, work, mode="async-cont-lookahead")
        r["loads"] = loads(r["run_dir"])
        if label == AUTO:
            r["cadence"] = cadence_used(r["run_dir"])
            print(f"[bench] auto's cadence: {json.dumps(r['cadence'])}", flush=True)
        results.append(r)
    print_table(results)
    figures, units = compare(results)
    for name in ("auto / best fixed", "worst fixed / auto", "best fixed s", "control / best fixed"):
        if name in figures:
            print(f"[bench] {name}: {figures[name]:.3f}", flush=True)
    return {"figures": figures, "units": units, "detail": {"launches": results}}
