"""Weight pushes in the window tuner's predictions (asyncppo/pipeline/tuner.py, pipeline/fit.py: push_rates): the
engines' pause per push and, under ``rollout.sync_every=auto``, the cadence the learner logged, capped at each
candidate's lookahead as the learner caps it."""

from __future__ import annotations

import random

import pytest

import asyncppo.pipeline.tuner as tuner_module
from asyncppo.pipeline.fit import push_rates
from asyncppo.pipeline.tuner import WindowTuner


def test_push_rates_reads_the_logged_cadence_and_the_engines_load():
    recs = [{"sync/every": 2, "sync/load_s": 0.1, "sync/push_s": 0.9},  # the load alone, not the push's latency
            {"sync/every": 3, "sync/load_s": 0.0, "sync/push_s": 0.3},  # no load measured this step
            {"sync/every": 2, "sync/push_s": 0.3},  # a run before sync/load_s: the latency stands in
            {"sync/every": 4, "sync/load_s": 0.5}]
    assert push_rates(recs, 1) == (2, pytest.approx(0.3))  # median of 2, 3, 2, 4 -> 2.5 -> 2; of 0.1, 0.3, 0.5
    assert push_rates([{"time/step_s": 1.0}], 3) == (3, 0.0)  # a fixed cadence, nothing measured


def _fed(sync_auto: bool, every: int, load_s: float = 0.05) -> WindowTuner:
    t = WindowTuner(k=8, j=3, cap=12, tune_k=True, tune_j=True, batch_groups=2, group_size=4, max_num_seqs=64,
                    every=3, sim_steps=20, sync_auto=sync_auto)
    rng = random.Random(0)
    for _ in range(9):
        rec = {"rollout/decode_step_s": 0.004 * 40, "rollout/running_mean": 40 * rng.uniform(0.6, 1.4),
               "response_length/mean": 30.0, "time/step_s": 0.5, "time/wait_s": 0.0, "actor/mismatch_kl": 0.0,
               "sync/every": every, "sync/load_s": load_s}
        groups = [[max(2, int(rng.lognormvariate(3.0, 1.0))) for _ in range(4)] for _ in range(2)]
        t.record(rec, groups)
    return t


def test_the_simulated_pushes_follow_the_measured_cadence_capped_at_each_lookahead(monkeypatch):
    seen = []
    real = tuner_module.simulate
    monkeypatch.setattr(tuner_module, "simulate", lambda setup, *a: seen.append(setup) or real(setup, *a))
    auto = _fed(sync_auto=True, every=3)
    auto.predict(8, 3)
    auto.predict(8, 2)
    auto.predict(8, 0)
    assert [(s.lookahead, s.sync_every, s.load_s) for s in seen[::auto.seeds]] == [(3, 3, 0.05), (2, 2, 0.05),
                                                                                  (0, 1, 0.05)]
    seen.clear()
    _fed(sync_auto=False, every=3).predict(8, 3)  # a fixed cadence: the config's (1), whatever a record says
    assert {(s.sync_every, s.load_s) for s in seen} == {(1, 0.05)}


def test_pushes_less_often_predict_younger_samples_and_no_more_throughput():
    """A push every third version: a ticket whose weights are not out yet waits for the next push, so groups start
    later and are trained younger, and nothing is trained sooner. The direction measured on data=reverse at k = 8,
    j = 3 (asyncppo bench push-cadence: mean lag 2.9, 2.5, 2.0 at cadences 1, 2, 3). Before, the tuner simulated a
    push every version whatever the run did, and predicted the same lag for both."""
    got = {every: _fed(sync_auto=True, every=every).predict(8, 3) for every in (1, 3)}
    assert got[3].token_lag_mean < got[1].token_lag_mean - 0.2, got
    assert got[3].samples_per_s <= got[1].samples_per_s * 1.02, got


def test_the_advisor_simulates_an_auto_cadence_as_the_learner_runs_it():
    """``asyncppo advise`` on a run whose cadence was auto: every window is simulated at the logged cadence capped
    at its own lookahead (as the tuner does), and no window is left out for a cadence it would never run at."""
    from dataclasses import replace

    from asyncppo.pipeline.lengths import LogNormalLengths
    from asyncppo.pipeline.model import EngineSpeed, TrainSpeed
    from asyncppo.report.advisor import sweep
    from asyncppo.report.rates import Rates

    rates = Rates(gen=EngineSpeed(base_s=0.004, per_seq_s=1e-4, max_num_seqs=64),
                  train=TrainSpeed(base_s=0.05, per_token_s=1e-5), load_s=0.02,
                  lengths=LogNormalLengths(30, 120, 256, within_group=0.5), batch_groups=2, group_size=4,
                  max_staleness=8, sync_every=3, engines=1, train_ranks=1, response_length=256,
                  measured_samples_per_s=0.0, lookahead=3, sync_auto=True)
    assert [rates.setup(max_staleness=8, lookahead=j).sync_every for j in (0, 1, 2, 3, None)] == [1, 1, 2, 3, 3]
    rows = sweep(rates, gpus=2, ks=(0, 1, 4), lookaheads=(1, 3), steps=12, warmup=3)
    assert {(r.max_staleness, r.j) for r in rows if not r.colocated} >= {(0, 0), (1, 1), (4, 1), (4, 3)}
    fixed = replace(rates, sync_auto=False)  # a fixed cadence of 3: k and j below 2 are refused, as the config does
    assert all(r.max_staleness >= 2 for r in sweep(fixed, gpus=2, ks=(0, 1, 4), lookaheads=(1, 3), steps=12,
                                                   warmup=3) if not r.colocated)
