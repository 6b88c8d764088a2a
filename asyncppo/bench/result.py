"""One benchmark run's result: the JSON file every ``asyncppo bench`` run writes, and the check that a file is one.

docs/benchmarks.md is rendered from these files and ``asyncppo bench --quick`` compares fresh runs with them, so a
figure must mean the same thing in every file. That is why the statistics are never typed: a :class:`Figure` holds
its per-seed values and computes its mean and spread from them, the verdict is computed from the figures and the
:class:`Target` by :meth:`Target.verdict`, and :func:`validate` refuses a file whose stored statistics or verdict
disagree with its own values (a hand edit, or a slip while transcribing an old measurement).

Verdicts: ``met`` / ``missed`` against the target; ``not measured`` when the target's figure has no value (or too
few seeds to say); ``no target`` for a benchmark that measures a cost without a threshold fixed in advance.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
import operator
import statistics
from dataclasses import dataclass, field
from typing import Optional, Union

SCHEMA = 1
NOT_RECORDED = "not recorded"
VERDICTS = ("met", "missed", "not measured", "no target")
OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
OVER = ("mean", "every seed")

Value = Optional[float]


class SchemaError(ValueError):
    """A result file that is not one; the message lists every problem found."""


@dataclass
class Figure:
    """One measured quantity: its value at each seed (None where that seed did not measure it) and the statistics
    over the seeds that did. ``std`` is the sample standard deviation (0 with one seed)."""

    name: str
    per_seed: dict[str, Value]
    unit: str = ""
    about: str = ""
    n: int = 0
    mean: Value = None
    std: Value = None
    min: Value = None
    max: Value = None

    @classmethod
    def of(cls, name: str, per_seed: dict, unit: str = "", about: str = "") -> "Figure":
        values = {str(k): (None if v is None or not math.isfinite(v) else float(v)) for k, v in per_seed.items()}
        return cls(name=name, per_seed=values, unit=unit, about=about, **_stats(values))

    @property
    def values(self) -> list[float]:
        return [v for v in self.per_seed.values() if v is not None]


def _stats(per_seed: dict[str, Value]) -> dict:
    vals = [v for v in per_seed.values() if v is not None]
    if not vals:
        return {"n": 0, "mean": None, "std": None, "min": None, "max": None}
    return {"n": len(vals), "mean": statistics.fmean(vals), "std": statistics.stdev(vals) if len(vals) > 1 else 0.0,
            "min": min(vals), "max": max(vals)}


@dataclass(frozen=True)
class Target:
    """What the benchmark must show, fixed before the run: ``figure op threshold``, over the seeds' mean or at every
    seed, with at least ``min_seeds`` seeds measured. ``why`` says where the threshold comes from."""

    figure: str
    op: str
    threshold: float
    over: str = "mean"
    min_seeds: int = 1
    why: str = ""

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ValueError(f"target op {self.op!r}: one of {list(OPS)}")
        if self.over not in OVER:
            raise ValueError(f"target over {self.over!r}: one of {list(OVER)}")
        if self.min_seeds < 1:
            raise ValueError(f"target min_seeds {self.min_seeds} must be >= 1")

    def describe(self) -> str:
        seeds = f", >= {self.min_seeds} seeds" if self.min_seeds > 1 else ""
        where = "at every seed" if self.over == "every seed" else "mean"
        return f"{self.figure} {self.op} {self.threshold:g} ({where}{seeds})"

    def verdict(self, figures: dict[str, Figure]) -> str:
        """met / missed / not measured. A seed that measured nothing cannot confirm a target, and a failed seed
        fails an every-seed target whatever the others show."""
        fig = figures.get(self.figure)
        if fig is None or not fig.values:
            return "not measured"
        ok = OPS[self.op]
        if self.over == "every seed":
            if any(not ok(v, self.threshold) for v in fig.values):
                return "missed"
            if len(fig.values) < len(fig.per_seed) or len(fig.values) < self.min_seeds:
                return "not measured"
            return "met"
        if len(fig.values) < self.min_seeds:
            return "not measured"
        return "met" if ok(statistics.fmean(fig.values), self.threshold) else "missed"

    @classmethod
    def from_dict(cls, d: dict) -> "Target":
        return cls(**d)


def verdict(target: Optional[Target], figures: dict[str, Figure]) -> str:
    return "no target" if target is None else target.verdict(figures)


@dataclass
class Machine:
    """Where it ran. Transcribed results say ``not recorded`` for what their source does not state."""

    cores: Union[int, str] = NOT_RECORDED
    cpu_model: str = NOT_RECORDED
    load_before: Union[float, str] = NOT_RECORDED  # 1-minute load average
    load_after: Union[float, str] = NOT_RECORDED
    gpu: str = NOT_RECORDED  # "none", or the devices torch.cuda sees
    note: str = ""  # what a transcribed source says about the machine, in its words

    def describe(self) -> str:
        if self.cores == NOT_RECORDED and self.cpu_model == NOT_RECORDED:
            return self.note or NOT_RECORDED
        load = (f"load {self.load_before:.1f} -> {self.load_after:.1f}"
                if all(isinstance(x, (int, float)) for x in (self.load_before, self.load_after)) else "")
        gpu = "" if self.gpu in ("none", NOT_RECORDED) else self.gpu
        parts = [f"{self.cores} cores" if self.cores != NOT_RECORDED else "",
                 self.cpu_model if self.cpu_model != NOT_RECORDED else "", gpu, load, self.note]
        return ", ".join(p for p in parts if p)


@dataclass
class Result:
    """One run of one benchmark (or one transcribed measurement, ``source`` says which)."""

    name: str
    question: str
    command: str
    config: dict
    seeds: list
    git: dict  # commit, dirty
    machine: Machine
    figures: list[Figure]
    target: Optional[Target]
    verdict: str
    date: str  # ISO 8601
    source: str = "measured"
    headline: str = ""  # the figure the at-a-glance table shows
    details: dict = field(default_factory=dict)
    notes: str = ""
    schema: int = SCHEMA

    @classmethod
    def build(cls, **kw) -> "Result":
        """A result whose verdict is computed here from its figures and target (the only way the code makes one)."""
        figures = {f.name: f for f in kw["figures"]}
        return cls(verdict=verdict(kw.get("target"), figures), **kw)

    def figure(self, name: str) -> Optional[Figure]:
        return next((f for f in self.figures if f.name == name), None)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, doc: dict) -> "Result":
        problems = validate(doc)
        if problems:
            raise SchemaError("; ".join(problems))
        d = dict(doc)
        d["machine"] = Machine(**d["machine"])
        d["figures"] = [Figure(**f) for f in d["figures"]]
        d["target"] = None if d.get("target") is None else Target.from_dict(d["target"])
        return cls(**d)

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1, allow_nan=False)
            f.write("\n")


def load(path: str) -> Result:
    with open(path, encoding="utf-8") as f:
        try:
            return Result.from_dict(json.load(f))
        except SchemaError as exc:
            raise SchemaError(f"{path}: {exc}") from None


_REQUIRED = {"name": str, "question": str, "command": str, "config": dict, "seeds": list, "git": dict,
             "machine": dict, "figures": list, "verdict": str, "date": str, "source": str}


def _close(a: Value, b: Value) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def validate(doc: object) -> list[str]:
    """Every problem of ``doc`` as a result file, or an empty list. Checks the fields and their types, that each
    figure's statistics are those of its per-seed values, and that the verdict is the one its target gives."""
    if not isinstance(doc, dict):
        return ["not a JSON object"]
    problems = [f"{k}: missing or not {t.__name__}" for k, t in _REQUIRED.items() if not isinstance(doc.get(k), t)]
    if doc.get("schema") != SCHEMA:
        problems.append(f"schema: {doc.get('schema')!r}, this code reads {SCHEMA}")
    known = {f.name for f in dataclasses.fields(Result)}
    problems += [f"{k}: unknown field" for k in doc if k not in known]
    if problems:
        return problems
    git = doc["git"]
    if set(git) != {"commit", "dirty"} or not isinstance(git["commit"], str) \
            or not (isinstance(git["dirty"], bool) or git["dirty"] == NOT_RECORDED):
        problems.append(f"git: {{commit: str, dirty: bool or {NOT_RECORDED!r}}}, got {git}")
    try:
        Machine(**doc["machine"])
    except TypeError as exc:
        problems.append(f"machine: {exc}")
    try:
        datetime.date.fromisoformat(doc["date"][:10])
    except ValueError:
        problems.append(f"date: {doc['date']!r} is not ISO 8601")
    figures = {}
    for i, f in enumerate(doc["figures"]):
        try:
            fig = Figure(**f)
        except TypeError as exc:
            problems.append(f"figures[{i}]: {exc}")
            continue
        if not isinstance(fig.per_seed, dict) or any(v is not None and not isinstance(v, (int, float))
                                                      for v in fig.per_seed.values()):
            problems.append(f"figure {fig.name}: per_seed must map seed -> number or null")
            continue
        want = _stats(fig.per_seed)
        bad = [k for k, v in want.items() if not _close(getattr(fig, k), v)]
        if bad:
            problems.append(f"figure {fig.name}: {', '.join(bad)} disagree with its per-seed values")
        if fig.name in figures:
            problems.append(f"figure {fig.name}: twice")
        figures[fig.name] = fig
    target = None
    if doc.get("target") is not None:
        try:
            target = Target.from_dict(doc["target"])
        except (TypeError, ValueError) as exc:
            problems.append(f"target: {exc}")
    if doc.get("headline") and doc["headline"] not in figures:
        problems.append(f"headline: no figure {doc['headline']!r}")
    if not problems and doc["verdict"] != verdict(target, figures):
        problems.append(f"verdict: stored {doc['verdict']!r}, its figures and target give "
                        f"{verdict(target, figures)!r}")
    return problems
