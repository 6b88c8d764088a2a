"""Read a run directory (metrics.jsonl, summary.json, config.yaml) into plain columns, tolerating whatever is missing.

Why tolerant: the report and the advisor must work on runs from older versions (fewer keys), on GRPO runs (no
critic), on runs that crashed half-way (a truncated last line, no summary.json) and on runs still in progress.
A key that no record has is simply absent from :attr:`Run.series`; readers ask with :meth:`Run.get`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import OmegaConf


def surviving_steps(records: list[dict]) -> list[dict]:
    """The per-step records (of ``metrics.jsonl`` or ``trained_groups.jsonl``) that count after learner restarts: a
    restarted learner logs again from its checkpoint's step + 1, and what the dead one logged from there on was lost
    with its weights (launch/learner_restart.py)."""
    kept: list[dict] = []
    for record in records:
        step = record.get("step")
        while isinstance(step, int) and kept and isinstance(kept[-1].get("step"), int) and kept[-1]["step"] >= step:
            kept.pop()
        kept.append(record)
    return kept


class RunDirError(ValueError):
    """The directory is not a run directory (no metrics.jsonl), or its files cannot be read."""


@dataclass
class Run:
    path: str
    name: str
    records: list[dict]  # training records (one per learner step), in file order
    evals: list[dict]  # records holding eval/ keys (step 0, every eval_every, the end)
    summary: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)

    def get(self, key: str, records: Optional[list[dict]] = None) -> tuple[list[float], list[float]]:
        """(steps, values) for every record that has a finite number under ``key``."""
        xs, ys = [], []
        for r in self.records if records is None else records:
            v = r.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
                xs.append(float(r["step"]))
                ys.append(float(v))
        return xs, ys

    def has(self, key: str) -> bool:
        return any(key in r for r in self.records) or any(key in r for r in self.evals)

    def wall_of_step(self) -> dict[float, float]:
        """Seconds since training started at the end of each step: ``time/wall_s`` when logged, else the running
        sum of ``time/step_s`` (older runs), else the step number itself (then the axis is labelled steps)."""
        out: dict[float, float] = {0.0: 0.0}
        total = 0.0
        for r in self.records:
            step = float(r["step"])
            wall = r.get("time/wall_s")
            if isinstance(wall, (int, float)):
                out[step] = float(wall)
                total = float(wall)
            elif isinstance(r.get("time/step_s"), (int, float)):
                total += float(r["time/step_s"])
                out[step] = total
        return out

    def eval_keys(self) -> list[str]:
        """Every held-out metric, old (``eval/accuracy_sampled``) and per-file (``eval/<file>/accuracy_greedy``)."""
        keys = sorted({k for r in self.evals for k in r if k.startswith("eval/")})
        return [k for k in keys if any(isinstance(r.get(k), (int, float)) for r in self.evals)]

    def cfg(self, dotted: str, default: Any = None) -> Any:
        node: Any = self.config
        for part in dotted.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        return node


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a run killed mid-write leaves a partial last line
            if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
                rows.append(row)
    return rows


def _read_yaml(path: str) -> dict:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
    except Exception:
        return {}


def load_run(path: str, name: Optional[str] = None) -> Run:
    path = os.path.abspath(path)
    metrics = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(metrics):
        raise RunDirError(f"{path!r} is not a run directory: it has no metrics.jsonl")
    rows = _read_jsonl(metrics)
    # A record is a training step when the learner wrote it (it carries policy_version or any non-eval key).
    records = surviving_steps([r for r in rows if any(not k.startswith("eval/") and k != "step" for k in r)])
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    summary: dict = {}
    summary_path = os.path.join(path, "summary.json")
    if os.path.isfile(summary_path):
        try:
            with open(summary_path, encoding="utf-8") as f:
                summary = json.load(f)
        except (OSError, json.JSONDecodeError):
            summary = {}
    config = _read_yaml(os.path.join(path, "config.yaml")) if os.path.isfile(os.path.join(path, "config.yaml")) else {}
    return Run(path=path, name=name or os.path.basename(path.rstrip("/")), records=records, evals=evals,
               summary=summary if isinstance(summary, dict) else {}, config=config)
