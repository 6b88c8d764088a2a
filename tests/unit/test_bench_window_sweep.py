"""``asyncppo bench auto-window*``'s figures (asyncppo/bench/window_sweep.py), hand-computed: auto against the best
and the worst fixed window of the same seed, over the whole run and past its first tenth."""

from __future__ import annotations

import pytest

from asyncppo.bench.window_sweep import compare


def _launch(label: str, train_s: float, late_s: float, held_out: float) -> dict:
    return {"label": label, "train_s": train_s, "train_s_late": late_s, "occupancy": 0.5, "lag_max": 2.0,
            "eval_after": held_out}


def test_auto_is_compared_with_the_best_and_the_worst_fixed_window_and_past_the_start_with_the_best_there():
    figures, units = compare([_launch("k2", 35.0, 31.0, 0.27), _launch("k8", 19.4, 16.6, 0.30),
                              _launch("k16", 18.0, 16.2, 0.25), _launch("auto", 21.8, 16.5, 0.29)])
    assert figures["auto / best fixed"] == pytest.approx(21.8 / 18.0)  # k16 is the best over the whole run
    assert figures["worst fixed / auto"] == pytest.approx(35.0 / 21.8)
    assert figures["best fixed k"] == 16.0
    assert figures["held-out auto - best fixed"] == pytest.approx(0.29 - 0.25)
    # past the first tenth the best fixed is the fastest there (k16's 16.2), whichever was best over the whole run
    assert figures["auto / best fixed, past the first tenth"] == pytest.approx(16.5 / 16.2)
    assert units["auto / best fixed, past the first tenth"] == "ratio"


def test_results_recorded_before_the_late_time_existed_still_compare():
    old = [{k: v for k, v in r.items() if k != "train_s_late"}
           for r in (_launch("k4", 20.0, 0, 0.3), _launch("auto", 22.0, 0, 0.3))]
    figures, _ = compare(old)
    assert figures["auto / best fixed"] == pytest.approx(1.1)
    assert "auto / best fixed, past the first tenth" not in figures


def test_the_phases_split_learner_time_and_wait_at_the_cuts_and_list_the_moves():
    from asyncppo.bench.window_phases import moves, spans

    recs = [{"step": s, "time/step_s": 1.0 + s, "time/wait_s": 0.5, "time/tune_s": 0.01} for s in range(1, 8)]
    recs[0].update({"tune/reason": "opening: ...", "tune/k": 7, "tune/j": 7})
    recs.append({"eval/mean": 0.3})  # a record that is no step: left out
    got = spans(recs, [2, 5])
    assert [(g["from"], g["to"]) for g in got] == [(1, 2), (3, 5), (6, 7)]
    assert got[0]["learner_s"] == pytest.approx(2.0 + 3.0 + 0.02) and got[0]["wait_s"] == pytest.approx(1.0)
    assert got[1]["learner_s"] == pytest.approx(4.0 + 5.0 + 6.0 + 0.03)
    assert got[2]["learner_s"] == pytest.approx(7.0 + 8.0 + 0.02)
    assert sum(g["learner_s"] for g in got) == pytest.approx(spans(recs, [])[0]["learner_s"])
    assert moves(recs) == [(1, 7, 7)]


def test_the_control_is_judged_as_auto_is_and_never_counts_as_a_fixed_window():
    """A second launch of a fixed window (the control) is compared with the best fixed window as auto is (its twin
    among them), and is itself never the best or the worst fixed window: the noise floor of auto's target."""
    from asyncppo.bench.window_sweep import labels

    assert labels([2, 16], 16, control=16) == [("k2", 2, 2), ("k16", 16, 16), ("auto", "auto", "auto"),
                                               ("k16-again", 16, 16)]
    assert labels([1, 8], 3) == [("k1", 1, 1), ("k8", 8, 3), ("auto", "auto", "auto")]
    with pytest.raises(ValueError, match="control window k = 4"):
        labels([2, 16], 16, control=4)
    figures, _ = compare([_launch("k2", 35.0, 31.0, 0.27), _launch("k16", 18.0, 16.2, 0.25),
                          _launch("auto", 21.8, 16.5, 0.29), _launch("k16-again", 17.0, 15.0, 0.3)])
    assert figures["control / best fixed"] == pytest.approx(17.0 / 18.0)  # faster than its twin: below 1
    assert figures["auto / best fixed"] == pytest.approx(21.8 / 18.0) and figures["best fixed k"] == 16.0
    assert figures["auto / best fixed, past the first tenth"] == pytest.approx(16.5 / 16.2)
    figures, _ = compare([_launch("k2", 35.0, 31.0, 0.27), _launch("auto", 21.8, 16.5, 0.29),
                          _launch("k2-again", 40.0, 35.0, 0.3)])
    assert figures["worst fixed / auto"] == pytest.approx(35.0 / 21.8)
    assert figures["control / best fixed"] == pytest.approx(40.0 / 35.0)
