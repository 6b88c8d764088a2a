"""The result schema (asyncppo/bench/result.py): statistics computed from the per-seed values, verdicts computed
from the figures and the target, and a file whose numbers disagree with themselves refused by name."""

from __future__ import annotations

import json
import math

import pytest

from asyncppo.bench.result import Figure, Machine, Result, SchemaError, Target, load, validate


def test_a_figure_computes_its_mean_and_spread_from_the_seeds_that_measured_it():
    f = Figure.of("eff", {0: 0.94, 1: 0.92, 2: None, 3: float("nan")}, unit="ratio")
    assert f.per_seed == {"0": 0.94, "1": 0.92, "2": None, "3": None}  # NaN: not measured
    assert (f.n, f.mean, f.min, f.max) == (2, pytest.approx(0.93), 0.92, 0.94)
    assert f.std == pytest.approx(math.sqrt(2) * 0.01)  # sample standard deviation
    one = Figure.of("x", {0: 2.08})
    assert (one.n, one.std) == (1, 0.0)
    assert Figure.of("x", {0: None}).mean is None


@pytest.mark.parametrize("values, target, verdict", [
    ({0: 0.94, 1: 0.92, 2: 0.93}, Target("f", ">=", 0.9, over="every seed", min_seeds=3), "met"),
    ({0: 0.908, 1: 0.906, 2: 0.884}, Target("f", ">=", 0.9, over="every seed", min_seeds=3), "missed"),
    ({0: 0.908, 1: 0.906, 2: 0.884}, Target("f", ">=", 0.9), "missed"),  # the mean, 0.8993
    ({0: 0.95, 1: None, 2: 0.96}, Target("f", ">=", 0.9, over="every seed"), "not measured"),  # a seed is silent
    ({0: 0.5, 1: None}, Target("f", ">=", 0.9, over="every seed"), "missed"),  # a failed seed fails it anyway
    ({0: 2.08}, Target("f", ">=", 3.0, min_seeds=3), "not measured"),  # too few seeds to say
    ({0: 0.0}, Target("f", "<=", 0.05), "met"),
    ({0: None}, Target("f", "<=", 0.05), "not measured"),
    ({0: 1.0}, Target("other", ">=", 0.5), "not measured"),  # the target's figure is not there
])
def test_verdicts(values, target, verdict):
    figure = Figure.of("f", values)
    assert target.verdict({"f": figure}) == verdict


def test_a_target_refuses_what_it_cannot_compare():
    with pytest.raises(ValueError, match="op '=>'"):
        Target("f", "=>", 1.0)
    with pytest.raises(ValueError, match="over 'median'"):
        Target("f", ">=", 1.0, over="median")
    assert Target("f", ">=", 0.9, over="every seed", min_seeds=3).describe() == "f >= 0.9 (at every seed, >= 3 seeds)"


def _result(**kw) -> Result:
    args = dict(name="demo", question="Does it?", command="asyncppo bench demo", config={"n": 1}, seeds=[0, 1],
                git={"commit": "abc", "dirty": False},
                machine=Machine(cores=2, cpu_model="cpu", load_before=0.5, load_after=0.7, gpu="none"),
                figures=[Figure.of("f", {0: 1.0, 1: 3.0}, unit="x")], target=Target("f", ">=", 1.5),
                date="2026-11-29T10:00:00", headline="f")
    args.update(kw)
    return Result.build(**args)


def test_a_result_round_trips_through_its_file(tmp_path):
    r = _result()
    assert r.verdict == "met"  # mean 2.0
    path = tmp_path / "demo.json"
    r.save(str(path))
    back = load(str(path))
    assert back == r
    assert _result(target=None).verdict == "no target"


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(verdict="missed"), "verdict: stored 'missed'"),
    (lambda d: d["figures"][0].update(mean=2.5), "figure f: mean disagree"),
    (lambda d: d["figures"][0]["per_seed"].update({"1": 9.0}), "figure f: mean, std, max disagree"),
    (lambda d: d.pop("machine"), "machine: missing"),
    (lambda d: d.update(schema=0), "schema: 0"),
    (lambda d: d.update(date="yesterday"), "date: 'yesterday'"),
    (lambda d: d.update(headline="g"), "headline: no figure 'g'"),
    (lambda d: d.update(extra=1), "extra: unknown field"),
    (lambda d: d["git"].update(dirty="maybe"), "git:"),
    (lambda d: d["figures"].append(dict(d["figures"][0])), "figure f: twice"),
])
def test_a_file_that_disagrees_with_itself_is_refused_by_name(tmp_path, edit, message):
    doc = _result().to_dict()
    edit(doc)
    assert any(message in p for p in validate(doc)), validate(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(SchemaError, match="bad.json"):
        load(str(path))


def test_transcribed_fields_may_say_not_recorded():
    r = _result(machine=Machine(note="the 2-core box"), git={"commit": "not recorded", "dirty": "not recorded"},
                seeds=["not recorded"], figures=[Figure.of("f", {"not recorded": 2.0})],
                source="transcribed from docs/x.md (a section)")
    assert validate(r.to_dict()) == []
    assert r.machine.describe() == "the 2-core box"
