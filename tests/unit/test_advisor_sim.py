"""The advisor's discrete-event simulator on cases solvable by hand, plus the invariants of the staleness rule.

Fixed response lengths make every case exact: an engine running ``n`` sequences of length ``L`` at ``s`` seconds per
decode step finishes them all after ``L * s`` seconds.
"""

from __future__ import annotations

import math
import random
import sys

import pytest

from asyncppo.report.lengths import EmpiricalGroups, FixedLengths, LogNormalLengths, capped, parse_groups
from asyncppo.report.simulator import EngineSpeed, Setup, TrainSpeed, simulate


def test_simulator_is_pure():
    """No Ray, sockets or torch behind the simulator (it must run anywhere, e.g. on a laptop planning a cluster)."""
    import subprocess

    code = ("import sys; import asyncppo.report.simulator, asyncppo.report.lengths, asyncppo.report.advisor, "
            "asyncppo.report.workloads; bad = [m for m in ('ray', 'zmq', 'torch', 'vllm') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pure_generation_bound():
    """Training is free: throughput is what the engines generate. 2 engines x 8 slots, sequences of 10 tokens at
    0.1 s per step: each engine delivers 8 samples per second, 16 in all; engines never idle, lag is k-bounded."""
    r = simulate(Setup(engines=2, train_ranks=1, batch_groups=4, group_size=4, max_staleness=4, steps=30,
                       warmup_steps=5), EngineSpeed(0.1, 0.0, 0.0, 8), TrainSpeed(0.0, 0.0), FixedLengths(10))
    assert r.samples_per_s == pytest.approx(16.0, rel=1e-9)
    assert r.tokens_per_s == pytest.approx(160.0, rel=1e-9)
    assert r.rollout_busy == pytest.approx(1.0) and r.occupancy == pytest.approx(1.0)
    assert r.train_busy == 0.0


def test_generation_speed_depends_on_occupancy():
    """step = 0.05 + 0.01 * running: 8 running -> 0.13 s per step; one engine, L = 10: 8 samples per 1.3 s."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=2, group_size=4, max_staleness=4, steps=30,
                       warmup_steps=5), EngineSpeed(0.05, 0.01, 0.0, 8), TrainSpeed(0.0, 0.0), FixedLengths(10))
    assert r.samples_per_s == pytest.approx(8 / 1.3, rel=1e-9)


def test_per_kv_token_cost_is_integrated_exactly():
    """One group of 2 sequences, prompt 100, L = 10, k = 0, step = 1e-3 s per context token: the context grows from
    200 to 220 tokens, and the model integrates progress continuously: 1e-3 * integral of (200 + 2p) dp over
    [0, 10] = 2.1 s of generation; training takes 0.9 s: period 3.0 s."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=1, group_size=2, max_staleness=0, prompt_tokens=100,
                       steps=12, warmup_steps=2), EngineSpeed(0.0, 0.0, 1e-3, 2), TrainSpeed(0.9, 0.0),
                 FixedLengths(10))
    assert r.step_s == pytest.approx(3.0, rel=1e-9)


def test_pure_training_bound():
    """Generation is (almost) free: one step per 2 s of training, 16 samples per step -> 8 samples/s; with k = 1
    every sample was generated one version before it is trained."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=4, group_size=4, max_staleness=1, steps=30,
                       warmup_steps=5), EngineSpeed(1e-9, 0.0, 0.0, 64), TrainSpeed(2.0, 0.0), FixedLengths(10))
    assert r.samples_per_s == pytest.approx(8.0, rel=1e-6)
    assert r.train_busy == pytest.approx(1.0)
    assert r.lag_mean == 1.0 and r.lag_max == 1


def test_training_scales_with_ranks():
    """1e-3 s per token on one rank, 16 samples x 10 tokens: 0.16 s on one rank, 0.04 s on four."""
    lengths, gen = FixedLengths(10), EngineSpeed(1e-9, 0.0, 0.0, 64)
    one = simulate(Setup(1, 1, 4, 4, 1, steps=20, warmup_steps=4), gen, TrainSpeed(0.0, 1e-3), lengths)
    four = simulate(Setup(1, 4, 4, 4, 1, steps=20, warmup_steps=4), gen, TrainSpeed(0.0, 1e-3), lengths)
    assert one.step_s == pytest.approx(0.16, rel=1e-6)
    assert four.step_s == pytest.approx(0.04, rel=1e-6)


def test_k0_alternation():
    """k = 0 alternates: generate the batch (10 steps x 0.1 s = 1 s), train (0.5 s), load weights (0.2 s), repeat.
    Period 1.7 s, 16 samples per step; the engine decodes 1 s of every 1.7 s, the learner trains 0.5 s; lag 0."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=4, group_size=4, max_staleness=0, load_s=0.2,
                       steps=30, warmup_steps=5), EngineSpeed(0.1, 0.0, 0.0, 16), TrainSpeed(0.5, 0.0),
                 FixedLengths(10))
    assert r.step_s == pytest.approx(1.7, rel=1e-9)
    assert r.samples_per_s == pytest.approx(16 / 1.7, rel=1e-9)
    assert r.rollout_busy == pytest.approx(1.0 / 1.7, rel=1e-9)
    assert r.train_busy == pytest.approx(0.5 / 1.7, rel=1e-9)
    assert r.lag_mean == 0.0 and r.lag_max == 0 and r.token_lag_mean == 0.0


def test_overlap_turns_the_sum_into_a_max():
    """The same pipeline with k = 1: generation (1 s + 0.2 s load) overlaps training (0.5 s), so the period is the
    engine's 1.2 s instead of 1.7 s. This is the speed-up asynchrony buys, predicted exactly."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=4, group_size=4, max_staleness=1, load_s=0.2,
                       steps=30, warmup_steps=5), EngineSpeed(0.1, 0.0, 0.0, 16), TrainSpeed(0.5, 0.0),
                 FixedLengths(10))
    assert r.step_s == pytest.approx(1.2, rel=1e-9)
    assert 0 < r.lag_mean <= 1


def test_colocated_sync_adds_the_switch():
    """Colocated: the same GPU generates then trains; 2 GPUs -> 2 engines and 2 ranks. One group of 4 per engine
    per step (B = 2): generation 1 s, training 0.4 s / 2 ranks = 0.2 s, switch 0.3 s: period 1.5 s."""
    r = simulate(Setup(engines=2, train_ranks=2, batch_groups=2, group_size=4, max_staleness=0, steps=20,
                       warmup_steps=4, colocated=True, switch_s=0.3), EngineSpeed(0.1, 0.0, 0.0, 4),
                 TrainSpeed(0.0, 0.4 / 80), FixedLengths(10))
    assert r.step_s == pytest.approx(1.5, rel=1e-9)


@pytest.mark.parametrize("k", [0, 1, 2, 4])
def test_lag_never_exceeds_k_on_long_tails(k):
    """The staleness rule holds in the model as in the system: every sample's lag (and token lag) is <= k."""
    r = simulate(Setup(engines=3, train_ranks=1, batch_groups=8, group_size=4, max_staleness=k, load_s=0.05,
                       steps=40, warmup_steps=5, seed=k), EngineSpeed(0.01, 0.001, 0.0, 32), TrainSpeed(0.1, 1e-4),
                 LogNormalLengths(20, 150, 200, within_group=0.3))
    assert r.lag_max <= k and r.token_lag_mean <= r.lag_mean + 1e-9
    assert 0 < r.rollout_busy <= 1 and 0 < r.train_busy <= 1 + 1e-9
    if k == 0:
        assert r.lag_mean == 0


def test_staleness_helps_a_long_tail_and_is_monotone():
    """On a long tail, a bigger window never hurts throughput (same seed, same lengths)."""
    args = dict(engines=2, train_ranks=1, batch_groups=8, group_size=4, load_s=0.02, steps=50, warmup_steps=10)
    rates = [simulate(Setup(max_staleness=k, **args), EngineSpeed(0.01, 0.0005, 0.0, 32), TrainSpeed(0.2, 0.0),
                      LogNormalLengths(15, 120, 160, 0.3)).samples_per_s for k in (0, 1, 4)]
    assert rates[0] < rates[1] <= rates[2] * 1.02


def test_deterministic_for_a_seed():
    s = Setup(engines=2, train_ranks=1, batch_groups=4, group_size=4, max_staleness=2, steps=20, warmup_steps=4)
    a = simulate(s, EngineSpeed(0.01, 0.001), TrainSpeed(0.05, 1e-4), LogNormalLengths(20, 100, 128))
    b = simulate(s, EngineSpeed(0.01, 0.001), TrainSpeed(0.05, 1e-4), LogNormalLengths(20, 100, 128))
    assert a.step_times == b.step_times


def test_bad_setups_are_refused():
    with pytest.raises(ValueError, match="max_staleness must be >= sync_every - 1"):
        Setup(1, 1, 1, 1, max_staleness=0, sync_every=2)
    with pytest.raises(ValueError, match="colocated"):
        Setup(1, 1, 1, 1, max_staleness=1, colocated=True)
    with pytest.raises(ValueError, match="does not fit"):
        simulate(Setup(1, 1, 1, 8, 1), EngineSpeed(0.1, 0, 0, 4), TrainSpeed(0, 0), FixedLengths(3))


def test_lognormal_matches_its_mean_and_p99():
    m = LogNormalLengths(4096, 28672, 10 ** 9, within_group=0.5)
    # mean = exp(mu + s^2/2) and p99 = exp(mu + 2.326 s) by construction
    assert math.exp(m.mu + m.sigma ** 2 / 2) == pytest.approx(4096)
    assert math.exp(m.mu + 2.3263478740408408 * m.sigma) == pytest.approx(28672)
    rng = random.Random(0)
    xs = sorted(x for _ in range(20000) for x in m.sample_group(rng, 4))
    assert sum(xs) / len(xs) == pytest.approx(4096, rel=0.05)
    assert xs[int(0.99 * len(xs))] == pytest.approx(28672, rel=0.1)


def test_empirical_groups_replay_and_cap():
    model = parse_groups(["3 4 3 3", "30 31 29 30"])
    assert isinstance(model, EmpiricalGroups) and model.mean == pytest.approx(133 / 8)
    rng = random.Random(0)
    seen = {tuple(model.sample_group(rng, 4)) for _ in range(50)}
    assert seen == {(3, 4, 3, 3), (30, 31, 29, 30)}
    assert capped(model, 10).groups == ((3, 4, 3, 3), (10, 10, 10, 10))


@pytest.mark.parametrize("unit, samples_per_s, occupancy", [("group", 4.0, 4 / 6), ("slot", 6.0, 1.0)])
def test_admission_unit_decides_how_many_slots_decode(unit, samples_per_s, occupancy):
    """6 slots, groups of 4, every sample 10 tokens at 0.1 s per step, free training, tickets plentiful. Per group,
    a second group never fits beside the first (8 > 6): one group per second, 4 samples/s, 4 of 6 slots busy.
    Per slot, the queue refills every freed slot at once: 6 samples/s, every slot busy."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=3, group_size=4, max_staleness=8, steps=60,
                       warmup_steps=12, admission_unit=unit),
                 EngineSpeed(0.1, 0.0, 0.0, 6), TrainSpeed(0.0, 0.0), FixedLengths(10))
    assert r.occupancy == pytest.approx(occupancy, rel=1e-6)
    assert r.samples_per_s == pytest.approx(samples_per_s, rel=0.02)
    assert r.lag_max <= 8


def test_admission_units_agree_for_groups_of_one():
    """With n = 1 a free slot is a whole group's room: both units admit alike, so the runs are identical."""
    lengths = LogNormalLengths(20.0, 80.0, 200, within_group=0.5)
    runs = [simulate(Setup(engines=2, train_ranks=1, batch_groups=8, group_size=1, max_staleness=2, steps=40,
                           warmup_steps=8, admission_unit=unit, seed=3),
                     EngineSpeed(0.02, 0.001, 0.0, 5), TrainSpeed(0.05, 1e-4), lengths) for unit in ("group", "slot")]
    assert runs[0] == runs[1]


@pytest.mark.parametrize("j", [0, 1, 2, 4])
def test_training_bound_lag_is_exactly_the_lookahead(j):
    """Generation is (almost) free and training takes 2 s a step, k = 4. Ticket ``i`` is granted once the learner
    reaches version ``i // B - j`` (the lookahead's window), generated at once with those weights, and trained at
    version ``i // B``: every sample's lag is exactly ``j``. With ``j >= 1`` the next batch is always ready (period
    2 s); with ``j = 0`` the learner waits for each batch's 10 decode steps of 1e-4 s."""
    r = simulate(Setup(engines=1, train_ranks=1, batch_groups=4, group_size=2, max_staleness=4, lookahead=j,
                       steps=20, warmup_steps=4), EngineSpeed(1e-4, 0.0, 0.0, 64), TrainSpeed(2.0, 0.0),
                 FixedLengths(10))
    assert r.lag_mean == j and r.lag_max == j
    assert r.step_s == pytest.approx(2.0 + (1e-3 if j == 0 else 0.0), rel=1e-9)


def test_a_lookahead_equal_to_k_is_ticket_order():
    """``lookahead = k`` is no lookahead: the same run, event for event, as leaving it unset."""
    args = dict(engines=2, train_ranks=1, batch_groups=6, group_size=4, max_staleness=3, load_s=0.02, steps=30,
                warmup_steps=5, seed=4, admission_unit="slot")
    runs = [simulate(Setup(lookahead=j, **args), EngineSpeed(0.01, 0.0005, 0.0, 24), TrainSpeed(0.1, 1e-4),
                     LogNormalLengths(20, 150, 200, within_group=0.3)) for j in (None, 3)]
    assert runs[0] == runs[1]


def test_deferral_keeps_the_bound_and_beats_a_tight_window_on_long_tails():
    """k = 4, j = 1 against k = j = 1 on a heavy tail: both grant one batch ahead, but with slack the learner trains
    the groups that arrived ahead of a straggler (the buffer's rule, staleness/order.py: next_batch) instead of
    waiting for it. Every lag stays <= k, the mean stays near j, and the learner waits less."""
    args = dict(engines=1, train_ranks=1, batch_groups=8, group_size=4, load_s=0.01, steps=60, warmup_steps=10,
                seed=1, admission_unit="slot")
    speed, train, lengths = EngineSpeed(0.01, 0.0002, 0.0, 64), TrainSpeed(0.3, 0.0), LogNormalLengths(15, 150, 300)
    tight = simulate(Setup(max_staleness=1, **args), speed, train, lengths)
    slack = simulate(Setup(max_staleness=4, lookahead=1, **args), speed, train, lengths)
    assert tight.lag_max <= 1 and slack.lag_max <= 4
    assert slack.lag_mean < 1.5
    assert slack.samples_per_s > 1.3 * tight.samples_per_s, (slack.samples_per_s, tight.samples_per_s)  # 1.57-1.69 at seeds 0-3


def test_a_lookahead_above_k_is_refused():
    with pytest.raises(ValueError, match="lookahead must be in"):
        Setup(1, 1, 1, 1, max_staleness=2, lookahead=3)


def test_a_lookahead_below_the_push_period_is_refused():
    """``j < sync_every - 1`` would stall: a ticket at version ``v`` needs weights ``v - j``, which the engines get
    only at the next push (the real run would hang the same way, and the config refuses it by name)."""
    with pytest.raises(ValueError, match="lookahead must be >= sync_every - 1 = 1"):
        Setup(1, 1, 1, 1, max_staleness=4, sync_every=2, lookahead=0)
    Setup(1, 1, 1, 1, max_staleness=4, sync_every=2, lookahead=1)
