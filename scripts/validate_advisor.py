#!/usr/bin/env python
"""Check the advisor's simulator against real CPU runs: calibrate on one run, predict others, run them, compare.

One calibration run of ``asyncppo launch`` (the long-tailed ``data=reverse`` task, one vLLM CPU worker, ``k=2``)
gives the measured rates (:func:`asyncppo.report.rates.measure`). From those rates alone the simulator predicts the
trained samples per second of configurations that differ in ``max_staleness``, response-length cap and worker count;
each is then run for real and measured the same way (steady part: steps after the first ``--skip``). The learner is
pinned to core 0 and every rollout worker to core 1, as disjoint GPU pools would be; two workers therefore share one
core, which the prediction states explicitly (``core_share=2``: each engine's step time doubles when both decode).

    .venv/bin/python scripts/validate_advisor.py --steps 40
    .venv/bin/python scripts/validate_advisor.py --reuse /tmp/advisor-val      # re-predict existing runs
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncppo.report.rates import measure  # noqa: E402
from asyncppo.report.simulator import simulate  # noqa: E402

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
    out = os.path.join(root, name.replace(" ", "_").replace(",", "").replace("=", "").replace("(", "").replace(")", ""))
    if os.path.isfile(os.path.join(out, "summary.json")):
        return out
    cmd = [sys.executable, "-m", "asyncppo", "launch", *BASE, *overrides, f"trainer.total_steps={steps}",
           f"trainer.output_dir={out}"]
    env = dict(os.environ, ASYNCPPO_LEARNER_CPUS="0", ASYNCPPO_ROLLOUT_CPUS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-3000:])
        raise SystemExit(f"[validate] {name} failed ({proc.returncode})")
    print(f"[validate] ran {name} in {time.perf_counter() - t0:.0f}s -> {out}", flush=True)
    return out


def predict(rates, changes: dict, core_share: int, steps: int, skip: int):
    r = rates
    if "response_length" in changes:
        r = r.with_response_length(changes["response_length"])
    if core_share > 1:
        r = dataclasses.replace(r, gen=dataclasses.replace(r.gen, base_s=r.gen.base_s * core_share,
                                                           per_seq_s=r.gen.per_seq_s * core_share))
    setup = r.setup(steps=steps, warmup_steps=skip, **{k: v for k, v in changes.items() if k != "response_length"})
    return simulate(setup, r.gen, r.train, r.lengths)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="steps left out of every measurement (start-up)")
    p.add_argument("--reuse", default="/tmp/advisor-val", help="run root; finished runs there are reused")
    args = p.parse_args()
    os.makedirs(args.reuse, exist_ok=True)
    dirs = {name: launch(name, ov, args.reuse, args.steps) for name, (ov, _, _) in CONFIGS.items()}
    calib = measure(dirs["calib k=2"], skip=args.skip)
    print(f"calibration rates: decode step = {calib.gen.base_s * 1e3:.2f} ms + {calib.gen.per_seq_s * 1e3:.3f} ms/seq; "
          f"learner step = {calib.train.base_s:.3f} s + {calib.train.per_token_s * 1e3:.3f} ms/token; "
          f"load {calib.load_s:.3f} s; mean length {calib.lengths.mean:.1f}")
    for note in calib.notes:
        print(f"  note: {note}")
    print(f"\n{'configuration':28s} {'measured':>9s} {'predicted':>9s} {'error':>7s} | {'own-rates':>9s} {'error':>7s} "
          f"| pred lag  pred busy gen/train")
    worst = 0.0
    for name, (_, changes, share) in CONFIGS.items():
        own = measure(dirs[name], skip=args.skip)
        res = predict(calib, changes, share, 3 * args.steps, 2 * args.skip)
        own_res = predict(own, {}, 1, 3 * args.steps, 2 * args.skip)  # its own rates already include any sharing
        err = res.samples_per_s / own.measured_samples_per_s - 1
        own_err = own_res.samples_per_s / own.measured_samples_per_s - 1
        worst = max(worst, abs(err))
        print(f"{name:28s} {own.measured_samples_per_s:9.1f} {res.samples_per_s:9.1f} {err:+7.1%} | "
              f"{own_res.samples_per_s:9.1f} {own_err:+7.1%} | {res.lag_mean:4.2f}  {res.rollout_busy:4.2f}/{res.train_busy:4.2f}")
    print(f"\nworst error of the calibrated prediction: {worst:.1%} (target: within 20%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
