"""Measured rates of a run, turned into the simulator's inputs.

What is read, from the run's own metrics (first ``skip`` steps dropped: engine warm-up and start-up waits):

* **generation**: per learner step, ``rollout/decode_step_s`` (engine seconds per decode step) against
  ``rollout/running_mean`` (sequences per decode step); older runs: derived from ``rollout/occupancy`` and
  ``throughput/gen_tokens_per_s``. A line ``step = base + per_seq * running`` is fitted by least squares weighted
  by decode steps, so it reproduces the run's total engine time. When the run's occupancy barely varied the slope
  cannot be told from the intercept; then the whole step time is charged per sequence (``base = 0``), which is
  what a compute-bound CPU engine does, and :attr:`Rates.notes` says so. The worker's own time between two steps
  (``rollout/step_gap_s``: admission, groups scored and sent) is added to the fixed part: the engine does not step
  meanwhile (without it the model over-predicted engine-bound runs by 8-16%).
* **training**: learner work per step (``time/step_s - time/wait_s``: collate, update, starting the push) against
  the step's response tokens, fitted the same way, per rank (times ``cluster.train_gpus``).
* **weight load**: the median of the slowest engine's load per push, ``sync/load_s`` (received and loaded), else of
  ``sync/push_s`` (announcement seen -> weights loaded), as the in-run tuner reads it (pipeline/fit.py: push_rates).
* **lengths**: ``summary.json``'s sampled groups (``rollout.group_lengths``) when present, else a lognormal with the
  run's mean and p99 response length, capped at ``rollout.response_length``.
* **episodes** (multi-turn runs, which log ``episodes/turns_mean``): the mean model turns per episode, the seconds
  an episode spends out of the engine per turn (from ``episodes/at_env_mean`` by Little's law, which counts the
  answer's wait to re-enter the engine; else the calls' own ``episodes/env_s_per_step``) and the share of response
  tokens the model decoded (``1 - episodes/env_token_frac``). Units: ``response_length/mean`` counts the model's tokens (the loss mask),
  which is what the engine decodes; the sampled group lengths and ``response_length/p99`` count the environment's
  tokens too, which the learner trains on, so the learner's fit is per response token including them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace
from typing import Optional

from asyncppo.pipeline.fit import cadence_at, engine_speed, episode_rates, learner_speed, push_rates
from asyncppo.pipeline.lengths import LogNormalLengths, capped, parse_groups
from asyncppo.pipeline.model import EngineSpeed, Setup, TrainSpeed
from asyncppo.report.runs import Run, load_run


@dataclass
class Rates:
    gen: EngineSpeed
    train: TrainSpeed
    load_s: float
    lengths: object
    batch_groups: int
    group_size: int
    max_staleness: int
    sync_every: int
    engines: int
    train_ranks: int
    response_length: int
    measured_samples_per_s: float  # what the run itself achieved (steady part), for comparison
    notes: list[str] = field(default_factory=list)
    prompt_tokens: int = 0  # only the per-KV-token term reads it (0 for runs: CPU engines are fitted without it)
    admission_unit: str = "group"  # rollout.admission_unit of the run (runs before the option admitted per group)
    lookahead: Optional[int] = None  # rollout.admission_lookahead of the run (None: k)
    turns: float = 1.0  # multi-turn episodes: model turns per episode (mean)
    env_s: float = 0.0  # seconds per environment call
    model_frac: float = 1.0  # share of response tokens the model decoded
    # the run's cadence was auto (rollout.sync_every=auto): sync_every is the median it logged, and each window is
    # simulated at that cadence capped at its own lookahead, as the learner caps it (pipeline/fit.py: cadence_at)
    sync_auto: bool = False

    def setup(self, **overrides) -> Setup:
        """The run's own configuration as a simulator setup, with ``overrides`` (engines=, max_staleness=, ...)."""
        if self.sync_auto and "sync_every" not in overrides:
            k = overrides.get("max_staleness", self.max_staleness)
            j = overrides.get("lookahead", self.lookahead)
            overrides["sync_every"] = cadence_at(self.sync_every, k if j is None else j)
        base = Setup(engines=self.engines, train_ranks=self.train_ranks, batch_groups=self.batch_groups,
                     group_size=self.group_size, max_staleness=self.max_staleness, sync_every=self.sync_every,
                     load_s=self.load_s, prompt_tokens=self.prompt_tokens, admission_unit=self.admission_unit,
                     lookahead=self.lookahead, turns=self.turns, env_s=self.env_s, model_frac=self.model_frac)
        return replace(base, **overrides)

    def with_response_length(self, cap: int) -> "Rates":
        return replace(self, lengths=capped(self.lengths, cap), response_length=cap)


def measure(run_dir: str, skip: int = 3) -> Rates:
    run: Run = load_run(run_dir)
    recs = [r for r in run.records if r.get("step", 0) > skip]
    if len(recs) < 3:
        raise ValueError(f"{run_dir}: need at least {skip + 3} logged steps to measure rates, found {len(run.records)}")
    notes: list[str] = []
    max_seqs = int(run.cfg("rollout.max_num_seqs", 256))
    B = int(run.cfg("rollout.rollout_batch_size", 16))
    n = int(run.cfg("rollout.num_return_sequences_in_group", 8))
    gpus = int(run.cfg("cluster.rollout_gpus", 0) or 0)
    per_engine = max(1, int(run.cfg("rollout.tensor_parallel_size", 1) or 1)) * \
        max(1, int(run.cfg("rollout.pipeline_parallel_size", 1) or 1))
    engines = max(1, gpus // per_engine) if gpus > 0 else int(run.cfg("cluster.rollout_workers", 1))
    ranks = max(1, int(run.cfg("cluster.train_gpus", 0) or 0))
    resp_len = int(run.cfg("rollout.response_length", 16))
    turns, env_s, model_frac = episode_rates(recs, B * n, engines, notes)

    base, per_seq = engine_speed(recs, B, n, max_seqs, notes, where=run_dir)
    t_base, t_tok = learner_speed(recs, B, n, model_frac, notes, where=run_dir)

    # the pushes as the in-run tuner reads them (pipeline/fit.py): an auto cadence (rollout.sync_auto) at the median
    # the learner logged, the pause per push measured
    sync_auto = bool(run.cfg("rollout.sync_auto", False))
    every, load_s = push_rates(recs, int(run.cfg("rollout.sync_every", 1)))  # the config's where none was logged
    load_s = load_s or float(run.summary.get("rollout", {}).get("push_s_p50", 0.0))

    ro = run.summary.get("rollout", {}) if isinstance(run.summary.get("rollout"), dict) else {}
    if ro.get("group_lengths"):
        lengths = parse_groups(ro["group_lengths"])
    else:
        _, means = run.get("response_length/mean", recs)
        _, p99s = run.get("response_length/p99", recs)
        mean = ro.get("response_length_mean") or (statistics.fmean(means) / model_frac if means else resp_len / 2)
        p99 = ro.get("response_length_p99") or (statistics.median(p99s) if p99s else resp_len)
        lengths = LogNormalLengths(float(mean), max(float(p99), float(mean) * 1.01), resp_len, within_group=0.5)
        notes.append("no sampled group lengths in summary.json: lognormal lengths from the mean and p99")

    walls = [float(r["time/step_s"]) for r in recs if isinstance(r.get("time/step_s"), (int, float))]
    measured = B * n * len(walls) / sum(walls) if walls and sum(walls) > 0 else 0.0
    k, j = _window(run, recs)
    return Rates(
        gen=EngineSpeed(base_s=base, per_seq_s=per_seq, max_num_seqs=max_seqs),
        train=TrainSpeed(base_s=t_base, per_token_s=t_tok * ranks),
        load_s=load_s, lengths=lengths, batch_groups=B, group_size=n,
        max_staleness=k, sync_every=every if sync_auto else int(run.cfg("rollout.sync_every", 1)),
        engines=engines, train_ranks=ranks, response_length=resp_len, measured_samples_per_s=measured, notes=notes,
        admission_unit=str(run.cfg("rollout.admission_unit", "group")),
        lookahead=None if j is None or int(j) >= k else int(j), turns=turns, env_s=env_s, model_frac=model_frac,
        sync_auto=sync_auto,
    )


def _window(run: Run, recs: list[dict]) -> tuple[int, Optional[int]]:
    """The window the measured steps ran under: an auto window's median ``tune/k`` and ``tune/j`` over them (its
    config holds only where it started), else the config's ``k`` and lookahead. The lookahead the model takes is
    None where there was none: a saved config fills a null ``rollout.admission_lookahead`` with ``max_staleness``
    (config/validate.py), and ``j >= k`` is no lookahead."""
    ks = [int(r["tune/k"]) for r in recs if isinstance(r.get("tune/k"), (int, float))]
    js = [int(r["tune/j"]) for r in recs if isinstance(r.get("tune/j"), (int, float))]
    if ks and js:
        return round(statistics.median(ks)), round(statistics.median(js))
    return int(run.cfg("rollout.max_staleness", 1)), run.cfg("rollout.admission_lookahead", None)

