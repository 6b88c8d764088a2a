"""Fitting a straight line to logged timings: how ``asyncppo advise`` (report/rates.py) and the in-run window tuner
(:mod:`asyncppo.pipeline.tuner`) both turn per-step metrics into the model's engine and learner speeds, and a
multi-turn run's episodes into turns and time out of the engine (:func:`episode_rates`), so that the two never
disagree about what a run measured."""

from __future__ import annotations

import statistics


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


def episode_rates(recs: list[dict], samples_per_step: int, workers: int, notes: list[str]
              ) -> tuple[float, float, float]:
    """(turns per episode, seconds out of the engine per turn, decoded share of response tokens) of a multi-turn
    run; (1, 0, 1) for a single-turn one (no ``episodes/turns_mean`` logged).

    The seconds out of the engine are what the model needs, and more than the environment call itself: an answer
    waits for the worker's next turn of its loop to re-enter the engine (~20 ms a turn on the 2-core box). Where
    the run logged where its episodes were (``episodes/at_env_mean``, a mean per worker), they follow from
    Little's law: the workers' episodes at their environment over the turns a second that reach it (samples a
    second x turns); else the calls' own time (``episodes/env_s_per_step``). The environment's ``init`` is spread
    over the turns (the model has no separate term for it)."""
    eps = [r for r in recs if isinstance(r.get("episodes/turns_mean"), (int, float))]
    if not eps:
        return 1.0, 0.0, 1.0
    turns = max(1.0, statistics.fmean(float(r["episodes/turns_mean"]) for r in eps))
    # a step whose groups brought no new call logs 0 (the worker's counters are deltas since its last group)
    per_call = [float(r["episodes/env_s_per_step"]) for r in eps
                if isinstance(r.get("episodes/env_s_per_step"), (int, float)) and r["episodes/env_s_per_step"] > 0]
    call_s = max(0.0, statistics.fmean(per_call)) if per_call else 0.0
    spread = [r for r in eps if isinstance(r.get("episodes/at_env_mean"), (int, float))
              and isinstance(r.get("time/step_s"), (int, float)) and r["time/step_s"] > 0]
    wall = sum(float(r["time/step_s"]) for r in spread)
    env_s, how = call_s, "per environment call"
    if spread and wall > 0:
        at_env = sum(float(r["episodes/at_env_mean"]) * float(r["time/step_s"]) for r in spread) / wall
        out_s = at_env * max(1, workers) / (samples_per_step * len(spread) / wall * turns)
        if out_s > call_s:
            env_s, how = out_s, (f"out of the engine per turn ({call_s * 1e3:.0f} ms per call, the rest waiting to "
                                 "re-enter the engine, and init)")
    env_frac = [float(r["episodes/env_token_frac"]) for r in eps
                if isinstance(r.get("episodes/env_token_frac"), (int, float))]
    model_frac = min(1.0, max(0.01, 1.0 - statistics.fmean(env_frac))) if env_frac else 1.0
    notes.append(f"multi-turn episodes: {turns:.2f} model turns each, {env_s * 1e3:.0f} ms {how}, "
                 f"{model_frac:.0%} of response tokens decoded (the rest written by the environment)")
    return turns, env_s, model_frac


def push_rates(recs: list[dict], sync_every: int) -> tuple[int, float]:
    """(versions between two pushes, the engines' pause per push) as the simulator takes them. The cadence is the
    median of ``sync/every`` where the learner sets it (``rollout.sync_every=auto``: learner/push_cadence.py), else
    ``sync_every``. The pause is the median, over the steps whose records carry a push, of the slowest engine's own
    receive-and-load time (:func:`load_of`: ``sync/load_s``; a run that predates it, the push's latency
    ``sync/push_s``, which also counts the wait to see the announcement); 0 where no push was measured."""
    everies = [r["sync/every"] for r in recs if isinstance(r.get("sync/every"), (int, float)) and r["sync/every"] >= 1]
    every = max(1, round(statistics.median(everies))) if everies else sync_every
    pauses = [v for v in map(load_of, recs) if v is not None]
    return every, statistics.median(pauses) if pauses else 0.0


def cadence_at(every: int, lookahead: int) -> int:
    """The cadence an auto push (``rollout.sync_every=auto``) runs at under lookahead ``lookahead``: the measured
    ``every``, never more than ``max(1, j)``, as the learner caps it (learner/loop.py: ``_lookahead``)."""
    return min(every, max(1, lookahead))


def load_of(record: dict) -> float | None:
    """The engines' load measured in one step's record (``sync/load_s``; a run that predates it: ``sync/push_s``),
    None where the step measured none. The learner's push cadence reads loads by this too (learner/push_cadence.py)."""
    v = record.get("sync/load_s", record.get("sync/push_s"))
    return float(v) if isinstance(v, (int, float)) and v > 0 else None
