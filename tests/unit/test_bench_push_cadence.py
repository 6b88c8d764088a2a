"""``asyncppo bench push-cadence``'s launches and figures (asyncppo/bench/push_cadence.py), hand-computed: auto
against the best and the worst fixed cadence of the same seed, and the control's noise floor."""

from __future__ import annotations

import json

import pytest

from asyncppo.bench.push_cadence import cadence_used, compare, labels


def _launch(label: str, train_s: float, held_out: float, **more) -> dict:
    return {"label": label, "train_s": train_s, "lag_mean": 2.0, "loads": 100.0, "eval_after": held_out, **more}


def test_each_fixed_cadence_then_auto_then_the_control_again():
    assert labels([1, 2, 3], 2) == [("s1", 1), ("s2", 2), ("s3", 3), ("auto", "auto"), ("s2-again", 2)]
    with pytest.raises(ValueError, match="control cadence 4"):
        labels([1, 2, 3], 4)


def test_auto_is_judged_against_the_best_fixed_cadence_and_the_control_against_it_too():
    figures, units = compare([_launch("s1", 30.0, 0.50), _launch("s2", 27.0, 0.52), _launch("s3", 28.0, 0.48),
                              _launch("auto", 27.9, 0.51, cadence={"min": 1, "max": 3, "mean": 2.2}),
                              _launch("s2-again", 26.1, 0.49)])
    assert figures["auto / best fixed"] == pytest.approx(27.9 / 27.0)  # s2; its twin is not a fixed launch
    assert figures["worst fixed / auto"] == pytest.approx(30.0 / 27.9)
    assert figures["best fixed s"] == 2.0 and units["best fixed s"] == "steps"
    assert figures["control / best fixed"] == pytest.approx(26.1 / 27.0)
    assert figures["held-out auto - best fixed"] == pytest.approx(0.51 - 0.52)
    assert figures["auto cadence mean"] == 2.2 and figures["loads s1"] == 100.0


def test_the_cadence_an_auto_run_used_is_read_from_its_records(tmp_path):
    rows = [{"step": 1, "sync/every": 1}, {"step": 2, "sync/every": 2}, {"eval/accuracy": 0.5},
            {"step": 3, "sync/every": 3}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert cadence_used(str(tmp_path)) == {"min": 1, "max": 3, "mean": 2.0}
