"""Fitting a straight line to logged timings: how ``asyncppo advise`` (report/rates.py) and the in-run window tuner
(:mod:`asyncppo.pipeline.tuner`) both turn per-step metrics into the model's engine and learner speeds, so that the
two never disagree about what a run measured."""

from __future__ import annotations


def fit_line(xs: list[float], ys: list[float], ws: list[float], what: str, notes: list[str]) -> tuple[float, float]:
    """(intercept, slope) of y against x by least squares weighted by ``ws`` (how many events each point averages),
    so the fitted line reproduces the *total* time, disturbed steps included: on a shared machine the run's own
    throughput paid for them too. Proportional (ratio of sums) when x hardly varies or the line is unphysical."""
    pts = [(x, y, w) for x, y, w in zip(xs, ys, ws) if w > 0 and x > 0]
    if not pts:
        raise ValueError(f"the run logged nothing to measure {what} from")
    sw = sum(w for _, _, w in pts)
    ratio = sum(w * y for _, y, w in pts) / sum(w * x for x, _, w in pts)
    lo, hi = min(p[0] for p in pts), max(p[0] for p in pts)
    if hi / lo < 1.5:
        notes.append(f"{what}: x varied only from {lo:.3g} to {hi:.3g}; fitted as proportional (no fixed cost)")
        return 0.0, ratio
    xbar = sum(w * x for x, _, w in pts) / sw
    ybar = sum(w * y for _, y, w in pts) / sw
    sxx = sum(w * (x - xbar) ** 2 for x, _, w in pts)
    slope = sum(w * (x - xbar) * (y - ybar) for x, y, w in pts) / sxx
    intercept = ybar - slope * xbar
    if slope < 0 or intercept < 0:  # noise: fall back to the proportional fit, which is never negative
        notes.append(f"{what}: the line fit was not physical (intercept {intercept:.3g}, slope {slope:.3g}); "
                     "fitted as proportional")
        return 0.0, ratio
    return intercept, slope


def engine_speed(recs: list[dict], B: int, n: int, max_seqs: int, notes: list[str], where: str = "the run"
                 ) -> tuple[float, float]:
    """(base_s, per_seq_s) of a decode step from per-step metrics records: ``rollout/decode_step_s`` against
    ``rollout/running_mean`` (older runs: occupancy and tokens/s), each step weighted by its decode steps, plus the
    worker's own loop between steps (``rollout/step_gap_s``), which the engine waits through."""
    running, step_s, steps = [], [], []  # per record: sequences per decode step, seconds per step, decode steps
    gaps: list[tuple[float, float]] = []  # (the worker's seconds between two steps, decode steps) per record
    for r in recs:
        tokens = float(r.get("response_length/mean") or 0.0) * B * n
        if isinstance(r.get("rollout/decode_step_s"), (int, float)) and r.get("rollout/running_mean"):
            run_mean, dss = float(r["rollout/running_mean"]), float(r["rollout/decode_step_s"])
        elif r.get("rollout/occupancy") and r.get("throughput/gen_tokens_per_s"):
            run_mean = float(r["rollout/occupancy"]) * max_seqs
            dss = run_mean / float(r["throughput/gen_tokens_per_s"])
        else:
            continue
        running.append(run_mean)
        step_s.append(dss)
        steps.append(tokens / run_mean)  # every running sequence decodes a token per step
        if isinstance(r.get("rollout/step_gap_s"), (int, float)):
            gaps.append((float(r["rollout/step_gap_s"]), steps[-1]))
    if not running:
        raise ValueError(f"{where}: no generation timing logged (rollout/decode_step_s or rollout/occupancy)")
    base, per_seq = fit_line(running, step_s, steps, "decode step time vs running sequences", notes)
    # the worker's own time between two steps (admission, groups sent): the engine does not step meanwhile, so it
    # is part of every step's cost (runs before rollout/step_gap_s: none)
    if gaps and sum(w for _, w in gaps) > 0:
        gap = sum(g * w for g, w in gaps) / sum(w for _, w in gaps)
        base += gap
        notes.append(f"the worker's loop between decode steps: {gap * 1e3:.2f} ms a step, added to the step time")
    return base, per_seq


def learner_speed(recs: list[dict], B: int, n: int, model_frac: float, notes: list[str], where: str = "the run"
                  ) -> tuple[float, float]:
    """(base_s, per_token_s) of a learner step on its ranks: ``time/step_s - time/wait_s`` against the batch's
    response tokens (the environment's included in a multi-turn run, which the learner trains on too)."""
    tokens_l, work = [], []
    for r in recs:
        if all(isinstance(r.get(k), (int, float)) for k in ("time/step_s", "time/wait_s", "response_length/mean")):
            decoded = model_frac if not isinstance(r.get("episodes/env_token_frac"), (int, float)) \
                else max(0.01, 1.0 - float(r["episodes/env_token_frac"]))
            tokens_l.append(float(r["response_length/mean"]) / decoded * B * n)  # with the environment's
            work.append(float(r["time/step_s"]) - float(r["time/wait_s"]))
    if not tokens_l:
        raise ValueError(f"{where}: no learner timing logged (time/step_s, time/wait_s)")
    t_base, t_tok = fit_line(tokens_l, work, [1.0] * len(work), "learner step time vs response tokens", notes)
    return t_base, t_tok
