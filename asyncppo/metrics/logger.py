"""One ``log(step, metrics)`` call fans out to the console, ``metrics.jsonl`` and wandb.

The JSONL file is the source of truth for tests and scripts: one JSON object per learner step, flushed immediately so a
crashed run still leaves every step it finished. wandb runs offline by default (no network is assumed) and a wandb
failure never kills a run: it is reported once and the sink is dropped.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from typing import Any, Optional

from asyncppo.metrics.eta import StepRate, format_duration

# What the console line shows, in order, with a short label and a format.
_CONSOLE_FIELDS = [
    ("reward/mean", "reward", "{:.3f}"),
    ("staleness/mean", "lag", "{:.2f}"),
    ("staleness/max", "lagmax", "{:.0f}"),
    ("staleness/token_mean", "toklag", "{:.2f}"),
    # how far the engine's sampling policy is from the one the update is taken around (lag and engine/trainer
    # numerics); with one update per batch under the decoupled correction approx_kl and clip are 0 by construction
    ("actor/mismatch_kl", "offkl", "{:.4f}"),
    ("actor/approx_kl", "kl", "{:.4f}"),
    ("actor/clipfrac", "clip", "{:.3f}"),
    ("actor/entropy", "ent", "{:.3f}"),
    ("critic/explained_variance", "ev", "{:.2f}"),
    ("throughput/gen_tokens_per_s", "gen tok/s", "{:.0f}"),
    ("util/rollout_busy", "gen busy", "{:.2f}"),
    ("util/train_busy", "train busy", "{:.2f}"),
    ("rollout/occupancy", "occ", "{:.2f}"),
    ("response_length/mean", "len", "{:.1f}"),
    ("response_length/max", "lenmax", "{:.0f}"),
    ("episodes/turns_mean", "turns", "{:.2f}"),
    ("episodes/turns_max", "turnsmax", "{:.0f}"),
    ("episodes/env_token_frac", "envtok", "{:.2f}"),
    ("episodes/env_s_per_step", "env s", "{:.3f}"),
    ("episodes/tool_calls", "tools", "{:.0f}"),
    ("episodes/tool_errors", "toolerr", "{:.0f}"),
    ("episodes/truncated", "trunc", "{:.0f}"),
    ("waste/tokens_frac", "waste", "{:.3f}"),
    ("sync/push_s", "push s", "{:.2f}"),
    ("time/step_s", "step s", "{:.2f}"),
    ("eval/accuracy_sampled", "eval acc (T)", "{:.3f}"),
    ("eval/accuracy_greedy", "eval acc (greedy)", "{:.3f}"),
    ("eval/success_sampled", "eval success (T)", "{:.3f}"),
    ("eval/success_greedy", "eval success (greedy)", "{:.3f}"),
]


def format_progress(step: int, total_steps: Optional[int], elapsed_s: float, record: dict[str, Any],
                    eta_s: Optional[float] = None) -> str:
    """One console line for one metrics record (the learner's console and the launcher's driver both use it);
    ``eta_s``, the time the run's steps have left (:mod:`asyncppo.metrics.eta`), is shown before the last step."""
    total = f"/{total_steps}" if total_steps else ""
    parts = [f"step {step}{total}", f"{elapsed_s:6.0f}s"]
    if eta_s is not None and total_steps and step < total_steps:
        parts.append(f"eta {format_duration(eta_s)}")
    for key, label, fmt in _CONSOLE_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)):
            parts.append(f"{label} " + fmt.format(value))
    shown = {key for key, _, _ in _CONSOLE_FIELDS}
    for key in sorted(record):  # evaluation of data.eval_files: eval/<file>/<metric>
        value = record[key]
        if key.startswith("eval/") and key not in shown and key.count("/") >= 2 and isinstance(value, (int, float)) \
                and key.rsplit("/", 1)[1] in ("accuracy_greedy", "accuracy_sampled"):
            parts.append(f"{key[len('eval/'):]} {value:.3f}")
    return " | ".join(parts)


def _clean(value: Any) -> Any:
    """JSON-safe scalars: tensors and numpy numbers become floats, NaN/inf become None."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsLogger:
    def __init__(
        self,
        output_dir: str,
        *,
        console: bool = True,
        jsonl: bool = True,
        wandb: bool = False,
        wandb_mode: str = "offline",
        wandb_project: str = "asyncppo",
        wandb_run_name: Optional[str] = None,
        config: Optional[dict] = None,
        total_steps: Optional[int] = None,
        log_every: int = 1,
        stream=None,
    ) -> None:
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir = output_dir
        self.console = console
        self.total_steps = total_steps
        self.log_every = max(1, int(log_every))
        self._stream = stream or sys.stdout
        self._jsonl = open(os.path.join(output_dir, "metrics.jsonl"), "a", encoding="utf-8") if jsonl else None
        self._wandb = None
        self._t0 = time.time()
        self._rate = StepRate()
        if wandb and wandb_mode != "disabled":
            try:
                import wandb as _wandb  # heavy/optional: wandb, only when a run logs to it

                self._wandb = _wandb.init(
                    project=wandb_project,
                    name=wandb_run_name,
                    mode=wandb_mode,
                    dir=output_dir,
                    config=config or {},
                    reinit="finish_previous",
                )
            except Exception as exc:  # a logging backend must never take a run down
                print(f"[asyncppo] wandb disabled: {exc}", file=sys.stderr)
                self._wandb = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        record = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._rate.add(step, record.get("time/wall_s"))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record) + "\n")
            self._jsonl.flush()
        if self._wandb is not None:
            try:
                self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)
            except Exception as exc:
                print(f"[asyncppo] wandb logging failed, sink dropped: {exc}", file=sys.stderr)
                self._wandb = None
        if self.console and (step % self.log_every == 0 or step == self.total_steps):
            self._stream.write(self.format_line(step, record) + "\n")
            self._stream.flush()

    def format_line(self, step: int, record: dict[str, Any]) -> str:
        return format_progress(step, self.total_steps, time.time() - self._t0, record,
                               self._rate.eta_s(self.total_steps))

    def message(self, text: str) -> None:
        if self.console:
            self._stream.write(f"[asyncppo] {text}\n")
            self._stream.flush()

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception:
                pass
            self._wandb = None
