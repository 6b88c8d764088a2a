"""``asyncppo bench auto-window`` (and ``auto-window-reverse``): the self-tuning window against every fixed window a
user might pick, on the same work.

One seed launches the task once per fixed window (``k`` from ``windows``, the lookahead ``j = min(lookahead, k)``)
and once with ``rollout.max_staleness=auto rollout.admission_lookahead=auto`` (started where the launch's own
config starts it: docs/staleness.md, "A window that moves"), all in the ``async-cont-lookahead`` schedule, pinned as
every schedule benchmark is (asyncppo/bench/launches.py). The figures compare learner time to the same trained
samples:

* ``auto / best fixed``: auto's time over the fastest fixed window's, this seed (the target: at most 1.05);
* ``worst fixed / auto``: how much a user who picked the slowest window of the sweep loses against auto;
* ``auto / best fixed, past the first tenth``: the same ratio over the steps after the run's first tenth (a
  diagnostic, no target): how much of auto's gap is its start, which a run longer than the sweep's weighs less;
* each launch's time, occupancy, lag max and held-out accuracy after, and the range auto's window took;
* ``control / best fixed`` (where the sweep names a ``control`` window): a second launch of that fixed window,
  after auto, judged as auto is, against the best of the fixed windows (its twin among them). The noise floor of
  the target: what a window known to be among the best gets against the luckiest fixed launch of its seed. On
  these boxes two launches of one window differ by several percent, so a ratio near this one is noise, not auto.

Why the comparison is per seed: the best fixed window is the best *of that seed's launches*, so a lucky fixed run
counts against auto, never for it (the conservative side).
"""

from __future__ import annotations

import json
import os
from typing import Callable

from asyncppo.bench.async_sync import print_table
from asyncppo.bench.launches import Launch, run_once

AUTO = "auto"
AGAIN = "-again"  # the control's label: its fixed window's, with this after it


def labels(windows: list[int], lookahead: int, control: int | None = None) -> list[tuple[str, int | str, int | str]]:
    """(label, k, j) of each launch: ``k<k>`` per fixed window, then ``auto`` (both knobs ``auto``: the schedule
    then says ``auto`` where it says a number for a fixed window, so the run starts where a user's launch with
    ``rollout.max_staleness=auto rollout.admission_lookahead=auto`` starts, at the preset's own window; a number
    before the ``auto`` would be taken as that start), then the ``control`` window again, if any."""
    if control is not None and control not in windows:
        raise ValueError(f"the control window k = {control} is not one of the sweep's windows {windows}")
    again = [] if control is None else [(f"k{control}{AGAIN}", control, min(lookahead, control))]
    return [*((f"k{k}", k, min(lookahead, k)) for k in windows), (AUTO, AUTO, AUTO), *again]


def window_range(run_dir: str) -> dict:
    """The smallest and largest ``k`` and ``j`` an auto run trained under, and how many times the window moved."""
    ks, js, moves = [], [], 0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "tune/k" in rec:
                ks.append(rec["tune/k"])
                js.append(rec["tune/j"])
            moves += "tune/reason" in rec
    if not ks:
        return {}
    return {"k_min": min(ks), "k_max": max(ks), "k_last": ks[-1], "j_min": min(js), "j_max": max(js),
            "moves": moves}


def compare(results: list[dict]) -> tuple[dict, dict]:
    """The sweep's figures from its launches (each with ``label`` and ``train_s``, ``occupancy``, ``lag_max``,
    ``eval_after``): per launch, and auto against the best and the worst fixed window."""
    figures, units, put = per_launch(results, [("learner s", "train_s", "s"), ("occupancy", "occupancy", "fraction"),
                                               ("lag max", "lag_max", "versions"),
                                               ("held-out after", "eval_after", "accuracy")])
    auto, fixed, best = versus_fixed(results, put)
    put("best fixed k", float(best["label"][1:]), "versions")
    if all("train_s_late" in r for r in results):
        put("auto / best fixed, past the first tenth",
            auto["train_s_late"] / min(r["train_s_late"] for r in fixed), "ratio")
    return figures, units


def per_launch(results: list[dict], rows: list[tuple[str, str, str]]) -> tuple[dict, dict, Callable]:
    """The figures ``"<name> <label>"`` of each launch, one per ``(name, key, unit)`` of ``rows``, their units, and
    the ``put(name, value, unit)`` that adds more."""
    figures, units = {}, {}

    def put(name: str, value, unit: str) -> None:
        figures[name], units[name] = value, unit

    for r in results:
        for name, key, unit in rows:
            put(f"{name} {r['label']}", r[key], unit)
    return figures, units, put


def versus_fixed(results: list[dict], put) -> tuple[dict, list[dict], dict]:
    """``put`` the figures that judge the ``auto`` launch against the fixed ones of the same seed (the control's
    twin, labelled ``...-again``, is not one of them): ``auto / best fixed``, ``worst fixed / auto``, ``held-out
    auto - best fixed`` and ``control / best fixed`` (the noise floor: a fixed launch judged as auto is; module
    docstring); auto's launch, the fixed ones and the best of them back."""
    auto = next(r for r in results if r["label"] == AUTO)
    fixed = [r for r in results if r["label"] != AUTO and not r["label"].endswith(AGAIN)]
    best, worst = min(fixed, key=lambda r: r["train_s"]), max(fixed, key=lambda r: r["train_s"])
    put("auto / best fixed", auto["train_s"] / best["train_s"], "ratio")
    put("worst fixed / auto", worst["train_s"] / auto["train_s"], "x")
    put("held-out auto - best fixed", auto["eval_after"] - best["eval_after"], "accuracy")
    for r in results:
        if r["label"].endswith(AGAIN):
            put("control / best fixed", r["train_s"] / best["train_s"], "ratio")
    return auto, fixed, best


def run(opts: dict, seed: int, work: str) -> dict:
    preset = list(opts["preset"])
    results = []
    for label, k, j in labels(opts["windows"], opts["lookahead"], opts["control"]):
        launch = Launch(steps=opts["steps"], staleness=k, lookahead=j, rollout_cpus=opts["rollout_cpus"],
                        learner_cpus=opts["learner_cpus"], preset=preset,
                        overrides=[*opts["overrides"], f"trainer.seed={seed}"])
        r = run_once(label, launch, work, mode="async-cont-lookahead")
        if label == AUTO:
            r["window"] = window_range(r["run_dir"])
            print(f"[bench] auto's window: {json.dumps(r['window'])}", flush=True)
        results.append(r)
    print_table(results)
    figures, units = compare(results)
    for name in ("auto / best fixed", "worst fixed / auto", "best fixed k", "auto / best fixed, past the first tenth",
                 "control / best fixed"):
        if name in figures:
            print(f"[bench] {name}: {figures[name]:.3f}", flush=True)
    return {"figures": figures, "units": units, "detail": {"launches": results}}
