"""The auto window's opening move (asyncppo/pipeline/opening.py): one jump by Little's law on the run's first
records, hand-computed; none where the pipeline is near the learner's pace or the engine is full; once per run. The
first step (the fill from empty) is read alone only where the engine sat idle through it, so the tests of the later
readings start with a fill the engine was busy through (:data:`BUSY_FILL`)."""

from __future__ import annotations

import random
import time

import pytest

from asyncppo.config.loader import load_config
from asyncppo.learner.window import window_hook
from asyncppo.pipeline.opening import FILL_USE, MAX_FACTOR, OPEN_READS, opening, read, scaled
from asyncppo.pipeline.tuner import Move, WindowTuner
from asyncppo.staleness.controller import AdmissionController


def _rec(step_s: float, wait_s: float, busy: float | None = 0.2, occ: float | None = 0.35) -> dict:
    rec = {"time/step_s": step_s, "time/wait_s": wait_s, "response_length/mean": 30.0, "actor/mismatch_kl": 0.0,
           "rollout/decode_step_s": 0.01, "rollout/running_mean": 10.0}
    if busy is not None:
        rec["util/rollout_busy"] = busy
    if occ is not None:
        rec["rollout/occupancy"] = occ
    return rec


#: a first step that waited for the whole first generation with the engine 72% used: no opening on it alone
BUSY_FILL = _rec(3.0, 2.9, busy=0.9, occ=0.8)


def test_the_reading_is_time_weighted_and_the_factor_is_the_tighter_of_wait_and_engine():
    # the guess game at k = 1 alternates a long wait and a short step (measured pattern, rounded)
    recs = [_rec(1.2, 1.0), _rec(0.2, 0.0), _rec(1.2, 1.0), _rec(0.2, 0.0)]
    got = read(recs)
    assert got.wait == pytest.approx(2.0 / 2.8)  # 0.714: by time, not the mean of the per-step shares (0.417)
    assert got.use == pytest.approx(0.07)
    assert got.factor == pytest.approx(1.0 / (1.0 - 2.0 / 2.8))  # 3.5: the wait's, under the engine's 1 / 0.07
    full = read([_rec(1.0, 0.6, busy=0.9, occ=0.8)] * 4)  # the engine 72% used: room for 1.39x, not 2.5x
    assert full.factor == pytest.approx(1.0 / 0.72)
    assert read([_rec(1.0, 0.9, busy=None)] * 4).factor == pytest.approx(MAX_FACTOR)  # no meter: the wait's, capped
    assert read([{"loss": 1.0}]) is None


@pytest.mark.parametrize("k, j, f, kw, want", [
    (1, 1, 3.5, dict(tune_k=True, tune_j=True, tie_j=False), (6, 6)),  # 2 * 3.5 = 7 in flight: k = j = 6
    (1, 1, 3.7, dict(tune_k=True, tune_j=True, tie_j=False), (7, 7)),  # 7.4, rounded up to 8
    (2, 2, 2.3, dict(tune_k=True, tune_j=False, tie_j=True), (6, 6)),  # 6.9 -> 7: data=long at k = 2, measured
    (4, 1, 3.0, dict(tune_k=True, tune_j=True, tie_j=False), (14, 5)),  # each knob's own in-flight count
    (4, 1, 3.0, dict(tune_k=False, tune_j=True, tie_j=False), (4, 4)),  # k pinned: j up to it, never past
    (4, 1, 3.0, dict(tune_k=True, tune_j=False, tie_j=False), (14, 1)),  # j pinned: k alone
    (6, 6, 4.0, dict(tune_k=True, tune_j=False, tie_j=True), (16, 16)),  # 28 in flight, held at the cap
])
def test_the_window_scales_its_work_in_flight_by_the_factor_within_the_cap(k, j, f, kw, want):
    assert scaled(k, j, f, cap=16, **kw) == want


def _tuner(**kw) -> WindowTuner:
    base = dict(k=1, j=1, cap=16, tune_k=True, tune_j=False, tie_j=True, batch_groups=2, group_size=4,
                max_num_seqs=64, every=5, sim_steps=20)
    base.update(kw)
    return WindowTuner(**base)


def _groups(rng: random.Random) -> list[list[int]]:
    return [[rng.randint(5, 60) for _ in range(4)] for _ in range(2)]


def test_a_run_that_waits_on_latency_opens_once_at_its_third_step_and_the_model_decides_after():
    rng = random.Random(0)
    t = _tuner()
    fill = BUSY_FILL  # the first step waits for the whole first generation, the engine busy: not read alone
    steady = [_rec(1.2, 1.0), _rec(0.2, 0.0)]
    moves = [t.observe(fill, _groups(rng))]
    for i in range(OPEN_READS[0]):
        moves.append(t.observe(steady[i % 2], _groups(rng)))
    assert OPEN_READS[0] == 2 and moves[:-1] == [None, None]  # nothing before the third step
    m = moves[-1]
    assert (m.k, m.j) == (6, 6) and (t.k, t.j) == (6, 6)  # f = 3.5 (the test above): 2 * 3.5 = 7 in flight
    assert m.reason == "opening: learner waiting 71% of its steps, engine 7% used; work in flight x3.5 (Little's law)"
    assert t.k_range == [1, 6] and not t.opening
    for _ in range(30):  # the same waiting again: the model's to judge from here on, never a second opening
        m = t.observe(steady[0], _groups(rng))
        assert m is None or not m.reason.startswith("opening")


@pytest.mark.parametrize("recs, why", [
    ([_rec(2.3, 0.4, busy=0.94, occ=1.0)] * 5, "data=long at its preset k = 12: the learner waits 17%"),
    ([_rec(1.0, 0.5, busy=0.95, occ=0.9)] * 5, "waits half its steps, but the engine is 86% used: f = 1.17"),
    ([_rec(1.0, 0.0)] * 5, "a learner-bound run never waits"),
])
def test_no_opening_near_the_learners_pace_or_where_the_engine_is_full(recs, why):
    rng = random.Random(1)
    t = _tuner(k=12, j=3, tune_j=True, tie_j=False, open_up=True)
    for r in recs:
        m = t.observe(r, _groups(rng))
        assert m is None or not m.reason.startswith("opening"), why
    assert not t.opening  # judged once, and it stayed


def test_no_opening_over_half_the_drift_budget_nor_for_pinned_knobs_nor_past_the_cap():
    rng = random.Random(2)
    drifting = _tuner(budget=0.01)
    for _ in range(1 + max(OPEN_READS)):
        rec = _rec(1.2, 1.0)
        rec["actor/mismatch_kl"] = 0.006  # over half the budget, under it
        m = drifting.observe(rec, _groups(rng))
        assert m is None or not m.reason.startswith("opening")
    assert not drifting.opening  # judged, and it stayed (the model's own decision at step 5 may move a step)
    pinned = _tuner(tune_k=False, tune_j=False, tie_j=False)
    assert not pinned.opening
    capped = _tuner(k=3, j=3, cap=4)
    moves = [capped.observe(r, _groups(rng)) for r in [BUSY_FILL, *[_rec(1.0, 0.9)] * OPEN_READS[0]]]
    assert (moves[-1].k, capped.k) == (4, 4)  # 4 * 4 = 16 in flight wanted, held at the cap
    assert opening([_rec(1.0, 0.9)] * 5, 4, 4, cap=4, tune_k=True, tune_j=False, tie_j=True,
                   valid=lambda k, j: True) is None  # already at the cap: nothing to open


def test_the_hook_puts_the_opening_in_force_says_why_and_a_resumed_run_does_not_open_again():
    cfg = load_config(["rollout.max_staleness=auto", "rollout.rollout_batch_size=2", "rollout.max_staleness_cap=8"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append, background=False)
    metrics = [dict(BUSY_FILL), *(_rec(1.0, 0.8) for _ in range(max(OPEN_READS)))]  # f = min(5, 1/0.07, 4) = 4
    for m in metrics:
        hook.after_step(m, [])
    assert (adm.k, adm.j) == (7, 7)  # 2 * 4 = 8 in flight
    opened = metrics[OPEN_READS[0]]  # the third step's record says why; no later one repeats it
    assert opened["tune/reason"].startswith("opening: learner waiting 80%")
    assert not any(m.get("tune/reason", "").startswith("opening") for m in metrics[OPEN_READS[0] + 1:])
    assert said == [f"window k 1 -> 7, j 1 -> 7: {opened['tune/reason']}"]

    resumed = window_hook(cfg, AdmissionController(2, 1, lookahead=None), said.append, background=False)
    resumed.restore({"k": 1, "j": 1})  # a checkpoint at the start window: the run opened before it
    for m in [_rec(3.0, 2.9), *(_rec(1.0, 0.8) for _ in range(max(OPEN_READS)))]:  # the fill's reading too
        resumed.after_step(m, [])
        assert "tune/reason" not in m or not m["tune/reason"].startswith("opening")


def test_a_bursty_start_opens_at_the_fifth_step_on_four_records_and_a_move_before_ends_the_opening():
    """A long tail's first steps: two that waited nothing, then two long waits (data=long at k = 2, measured):
    nothing at the third step, the opening at the fifth on all four records."""
    rng = random.Random(3)
    t = _tuner(k=2, j=2, every=50)
    recs = [_rec(17.0, 13.5, busy=0.9, occ=0.5), _rec(2.4, 0.0, busy=0.95, occ=0.3), _rec(2.8, 0.0, busy=0.95, occ=0.3),
            _rec(14.0, 11.9, busy=0.9, occ=0.28), _rec(4.0, 2.2, busy=0.85, occ=0.3)]
    moves = [t.observe(r, _groups(rng)) for r in recs]
    assert moves[:4] == [None] * 4
    # w = 14.1 / 23.2 = 0.608: 1 / (1 - w) = 2.55; u = mean(0.285, 0.285, 0.252, 0.255) = 0.269: 1 / u = 3.71
    assert (moves[4].k, moves[4].j) == (7, 7)  # 3 * 2.55 = 7.65 in flight, rounded up to 8: k = 7
    assert moves[4].reason.startswith("opening: learner waiting 61% of its steps, engine 27% used")

    moved = _tuner(k=2, j=2, every=50)
    moved.observe(recs[0], _groups(rng))
    moved.apply(Move(3, 3, "restored"))  # any move before the opening ends it: its records span two windows
    assert not moved.opening
    assert all(moved.observe(r, _groups(rng)) is None for r in recs[1:])


def test_the_opening_scales_k_no_further_than_the_drift_allows_and_not_at_all_with_the_lookahead_pinned():
    rng = random.Random(4)
    t = _tuner(budget=0.01)
    for rec in [dict(BUSY_FILL), *(_rec(1.0, 0.9) for _ in range(OPEN_READS[0]))]:  # f = 4: k = 1 -> 7 unbudgeted
        rec["actor/mismatch_kl"] = 0.004  # under half the budget
        m = t.observe(rec, _groups(rng))
    # drift x k_new / k <= budget: k_new <= 0.01 * 1 / 0.004 = 2.5, so k = 2 (j follows it)
    assert (m.k, m.j) == (2, 2) and m.reason.startswith("opening")
    pinned_j = _tuner(k=4, j=1, tune_j=False, tie_j=False)
    for _ in range(1 + max(OPEN_READS)):
        m = pinned_j.observe(_rec(1.0, 0.9), _groups(rng))
        assert m is None or not m.reason.startswith("opening")  # a wider k alone admits no group sooner
    assert opening([_rec(1.0, 0.9)] * 4, 4, 1, cap=16, tune_k=True, tune_j=False, tie_j=False,
                   valid=lambda k, j: True) is None


def test_with_the_decision_process_the_opening_moves_at_once_and_later_decisions_are_asked_in_the_idle_class():
    cfg = load_config(["rollout.max_staleness=auto", "rollout.rollout_batch_size=2", "rollout.max_staleness_cap=8",
                       "rollout.tune_every=2", "rollout.num_return_sequences_in_group=4"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    hook = window_hook(cfg, adm, lambda _l: None)
    asked: list[bool] = []
    submit = hook.host.submit
    hook.host.submit = lambda state, **kw: (asked.append(kw.get("idle", False)), submit(state, **kw))
    rng = random.Random(5)
    try:
        for step in range(1, 9):
            m = dict(BUSY_FILL) if step == 1 else _rec(1.0, 0.8)
            hook.after_step(m, [_Lengths(g) for g in _groups(rng)])
            if step == 1 + OPEN_READS[0]:
                assert (adm.k, adm.j) == (7, 7) and m["tune/reason"].startswith("opening")
            time.sleep(0.05)
        # due at step 2, before the opening: the first judgement, niced only; every one after the opening: idle
        assert hook.host is not None and len(asked) >= 2 and asked[0] is False and all(asked[1:]), asked
    finally:
        hook.close()


class _Lengths:
    def __init__(self, lengths):
        self._lengths = lengths

    def sample_lengths(self):
        return self._lengths


@pytest.mark.parametrize("first, want, why", [  # j follows k here (an unset lookahead): both scale by the factor
    (_rec(1.67, 1.4, busy=0.24, occ=0.46), (7, 7),
     "the guess game at k = 1 (measured): w = 0.84, u = 0.11; f = min(6.2, 9.1, 4) = 4: 2 * 4 = 8 in flight"),
    (_rec(0.37, 0.27, busy=0.45, occ=0.3), (7, 7),
     "data=reverse at k = 1 (measured): w = 0.73, u = 0.135; f = 3.7: 7.4 in flight, rounded up to 8"),
    (_rec(3.11, 0.77, busy=0.23, occ=0.8), None, "the default task at k = 1 (measured): waits 25%, f = 1.33"),
    (_rec(0.36, 0.22, busy=0.95, occ=0.6), None, "data=reverse at k = 8 (measured): the engine 57% used"),
    (_rec(1.0, 0.9, busy=None), None, "no engine meter: the fill alone says nothing about the window"),
])
def test_the_first_step_alone_opens_only_where_the_engine_sat_idle_through_the_fill(first, want, why):
    rng = random.Random(6)
    t = _tuner(every=50)
    m = t.observe(dict(first), _groups(rng))
    if want is None:
        assert m is None and t.opening, why  # still to be judged on the later readings
        return
    assert (m.k, m.j) == want and t.k_range == [1, want[0]], why
    assert m.reason.startswith("opening: learner waiting") and "of its first step (the fill)" in m.reason
    assert not t.opening  # the move ends the opening: the later readings span two windows
    for _ in range(max(OPEN_READS) + 2):
        assert t.observe(_rec(1.2, 1.0), _groups(rng)) is None


def test_the_fill_gate_is_the_room_for_the_whole_largest_factor():
    assert FILL_USE == pytest.approx(1.0 / MAX_FACTOR)
    base = dict(cap=16, tune_k=True, tune_j=False, tie_j=True, valid=lambda k, j: True, fill=True)
    # the same fill, its engine just under and just over the gate: u = 0.25 * 0.99 and 0.25 * 1.01
    assert opening([_rec(1.0, 0.8, busy=0.99, occ=0.25)], 1, 1, **base) is not None
    assert opening([_rec(1.0, 0.8, busy=1.0, occ=0.2525)], 1, 1, **base) is None
    # not the fill: the same record is read by the factor alone (min(5, 1 / 0.2525) = 3.96)
    assert opening([_rec(1.0, 0.8, busy=1.0, occ=0.2525)], 1, 1, **{**base, "fill": False})[:2] == (7, 7)


@pytest.mark.parametrize("first, want, why", [
    (_rec(0.37, 0.27, busy=0.45, occ=0.3), (7, 3),
     "data=reverse at k = j = 1: 1 / (1 - 0.73) = 3.7 batches in flight, j + 1 = 4; k + 1 = 2 * 3.7, rounded up"),
    (_rec(1.67, 1.4, busy=0.24, occ=0.46), (7, 6),
     "the guess game: 1 / (1 - 0.84) = 6.2 batches, j + 1 = 7; k + 1 = 2 * 4 (the largest factor)"),
    (_rec(1.0, 0.9, busy=0.5, occ=0.3), (7, 7),
     "ten batches' worth of waiting: j + 1 at most 4 times the 2 in flight (the engine's 1 / u >= 4 at the fill)"),
])
def test_with_the_lookahead_free_the_fill_sets_the_batches_in_flight_and_scales_the_age_limit(first, want, why):
    rng = random.Random(7)
    t = _tuner(every=50, tune_j=True, tie_j=False)
    m = t.observe(dict(first), _groups(rng))
    assert (m.k, m.j) == want, why
    assert m.reason.endswith(f"{want[1] + 1} batches in flight (Little's law)")
    # a later reading scales j + 1 by the same factor as k + 1 (its wait was shared by the j + 1 in flight)
    assert opening([dict(first)] * 2, 1, 1, cap=16, tune_k=True, tune_j=True, tie_j=False,
                   valid=lambda k, j: True)[:2] == (want[0], want[0])
    # the fill's count never lowers a j already wider than it, and where j already holds it nothing moves: the
    # learner's steps will not shorten, so k's age in steps need not grow (k alone would add lag, not work)
    wide = opening([dict(first)], 5, 5, cap=16, tune_k=True, tune_j=True, tie_j=False, valid=lambda k, j: True,
                   fill=True)
    assert wide is None or wide[1] > 5
    assert opening([dict(first)], 12, 9, cap=16, tune_k=True, tune_j=True, tie_j=False, valid=lambda k, j: True,
                   fill=True) is None  # the count is at most 10 batches here: j = 9 holds it


def test_a_fill_move_on_the_decision_process_path_is_in_force_from_the_first_step_and_said_once():
    cfg = load_config(["rollout.max_staleness=auto", "rollout.admission_lookahead=auto", "rollout.rollout_batch_size=2",
                       "rollout.max_staleness_cap=16", "rollout.tune_every=1", "rollout.num_return_sequences_in_group=4"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append)
    asked: list[bool] = []
    submit = hook.host.submit
    hook.host.submit = lambda state, **kw: (asked.append(kw.get("idle", False)), submit(state, **kw))
    rng = random.Random(8)
    try:
        first = _rec(0.37, 0.27, busy=0.45, occ=0.3)  # data=reverse's fill: (7, 3) with both knobs auto
        hook.after_step(first, [_Lengths(g) for g in _groups(rng)])
        assert (adm.k, adm.j) == (7, 3) and first["tune/k"] == 7 and first["tune/j"] == 3
        assert first["tune/reason"].endswith("4 batches in flight (Little's law)")
        assert asked == [True]  # due at once (tune_every=1), on the new window, in the idle class
        for _ in range(4):
            m = _rec(1.0, 0.8)
            hook.after_step(m, [_Lengths(g) for g in _groups(rng)])
            assert not m.get("tune/reason", "").startswith("opening")  # the later readings do not open again
        assert len([x for x in said if "opening" in x]) == 1
    finally:
        hook.close()
