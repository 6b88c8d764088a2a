"""``asyncppo bench advisor``: the advisor's simulator against real CPU runs: calibrate on one run, predict others,
run them, compare.

One calibration run of ``asyncppo launch`` (the long-tailed ``data=reverse`` task, one vLLM CPU worker, ``k=2``)
gives the measured rates (:func:`asyncppo.report.rates.measure`). From those rates alone the simulator predicts the
trained samples per second of configurations that differ in ``max_staleness``, response-length cap and worker count;
each is then run for real and measured the same way (steady part: steps after the first ``skip``). Each run is also
predicted from its own rates, which separates the pipeline model (own rates) from the transfer between runs
(calibrated). The learner is pinned to core 0 and every rollout worker to core 1, as disjoint GPU pools would be;
two workers therefore share one core, which the prediction states explicitly (``core_share=2``: each engine's step
time doubles when both decode). ``reuse`` names a run root whose finished runs are read again, not relaunched.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

from asyncppo.report.rates import measure
from asyncppo.report.simulator import simulate

BASE = ["data=reverse", "algorithm=grpo", "algorithm.use_kl_loss=false", "rollout.rollout_batch_size=4",
        "rollout.max_num_seqs=64", "trainer.eval_every=0", "trainer.logger.wandb=false"]
# name -> (overrides, simulator changes relative to the calibration run, engines sharing one core)
CONFIGS = {
    "calib k=2": (["rollout.max_staleness=2"], {}, 1),
    "k=0 (sync)": (["rollout.max_staleness=0"], {"max_staleness": 0}, 1),
    "k=4, response_length=16": (["rollout.max_staleness=4", "rollout.response_length=16"],
                                {"max_staleness": 4, "response_length": 16}, 1),
    "2 workers, k=1": (["rollout.max_staleness=1", "cluster.rollout_workers=2", "cluster.cpus_per_worker=0.5"],
                       {"max_staleness": 1, "engines": 2}, 2),
}


def launch(name: str, overrides: list[str], root: str, steps: int) -> str:
    """One configuration's launch (learner on core 0, workers on core 1), its run directory."""
    out = os.path.join(root, name.replace(" ", "_").replace(",", "").replace("=", "").replace("(", "").replace(")", ""))
    if os.path.isfile(os.path.join(out, "summary.json")):  # a finished run of an earlier invocation is reused
        return out
    cmd = [sys.executable, "-m", "asyncppo", "launch", *BASE, *overrides, f"trainer.total_steps={steps}",
           f"trainer.output_dir={out}"]
    env = dict(os.environ, ASYNCPPO_LEARNER_CPUS="0", ASYNCPPO_ROLLOUT_CPUS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-3000:])
        raise RuntimeError(f"[advisor] {name} failed ({proc.returncode})")
    print(f"[advisor] ran {name} in {time.perf_counter() - t0:.0f}s -> {out}", flush=True)
    return out


def predict(rates, changes: dict, core_share: int, steps: int, skip: int):
    """The simulator's result for ``rates`` changed as a configuration differs from the calibration run."""
    r = rates
    if "response_length" in changes:
        r = r.with_response_length(changes["response_length"])
    if core_share > 1:
        r = dataclasses.replace(r, gen=dataclasses.replace(r.gen, base_s=r.gen.base_s * core_share,
                                                           per_seq_s=r.gen.per_seq_s * core_share))
    setup = r.setup(steps=steps, warmup_steps=skip, **{k: v for k, v in changes.items() if k != "response_length"})
    return simulate(setup, r.gen, r.train, r.lengths)


def run(opts: dict, seed: int, work: str) -> dict:
    root = opts["reuse"] or work
    os.makedirs(root, exist_ok=True)
    steps, skip = opts["steps"], opts["skip"]
    dirs = {name: launch(name, [*ov, *opts["overrides"], f"trainer.seed={seed}"], root, steps)
            for name, (ov, _, _) in CONFIGS.items()}
    calib = measure(dirs["calib k=2"], skip=skip)
    print(f"[advisor] calibration rates: decode step = {calib.gen.base_s * 1e3:.2f} ms + "
          f"{calib.gen.per_seq_s * 1e3:.3f} ms/seq; learner step = {calib.train.base_s:.3f} s + "
          f"{calib.train.per_token_s * 1e3:.3f} ms/token; load {calib.load_s:.3f} s", flush=True)
    figures, units, rows = {}, {}, []
    for name, (_, changes, share) in CONFIGS.items():
        own = measure(dirs[name], skip=skip)
        res = predict(calib, changes, share, 3 * steps, 2 * skip)
        own_res = predict(own, {}, 1, 3 * steps, 2 * skip)  # its own rates already include any sharing
        err = res.samples_per_s / own.measured_samples_per_s - 1
        own_err = own_res.samples_per_s / own.measured_samples_per_s - 1
        rows.append({"configuration": name, "measured": own.measured_samples_per_s,
                     "calibrated": res.samples_per_s, "own_rates": own_res.samples_per_s})
        for key, value, unit in ((f"measured samples/s {name}", own.measured_samples_per_s, "samples/s"),
                                 (f"calibrated error {name}", err, "fraction"),
                                 (f"own-rates error {name}", own_err, "fraction")):
            figures[key], units[key] = value, unit
        print(f"[advisor] {name:28s} measured {own.measured_samples_per_s:9.1f}, calibrated {res.samples_per_s:9.1f} "
              f"({err:+.1%}), own rates {own_res.samples_per_s:9.1f} ({own_err:+.1%})", flush=True)
    for kind in ("calibrated", "own-rates"):
        worst = max(abs(figures[f"{kind} error {name}"]) for name in CONFIGS)
        figures[f"worst {kind} error"], units[f"worst {kind} error"] = worst, "fraction"
    return {"figures": figures, "units": units, "detail": {"rows": rows, "run_root": root}}
