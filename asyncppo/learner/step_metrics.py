"""The learner's per-step throughput, utilisation and buffer metrics, and the metrics logger it writes them to.

Why a module of its own: the training loop should read as "take a batch, update, push, log"; the meters behind
``throughput/*``, ``util/*``, ``buffer/*``, ``waste/*`` and ``stream/*`` (docs/metrics.md) are bookkeeping that
spans the whole step and the whole run, so they live here, in one object the loop feeds once per step.
"""

from __future__ import annotations

import dataclasses
import time

from asyncppo.metrics import BusyMeter, EngineTotals, MetricsLogger, RateMeter


def make_logger(cfg, output_dir: str) -> MetricsLogger:
    """The run's metrics sinks (console, JSONL, wandb) as ``trainer.logger`` configures them."""
    tr = cfg.trainer
    return MetricsLogger(
        output_dir,
        console=tr.logger.console,
        jsonl=tr.logger.jsonl,
        wandb=tr.logger.wandb,
        wandb_mode=tr.logger.wandb_mode,
        wandb_project=tr.logger.wandb_project,
        wandb_run_name=tr.logger.wandb_run_name,
        total_steps=tr.total_steps,
        config=dataclasses.asdict(cfg),
        log_every=tr.logger.log_every,
    )


class StepMeters:
    """Rates and busy fractions per logged step, plus the run totals they need.

    Engine throughput is over the run so far: one engine step can finish several groups, and only the first carries
    that step's busy time, so a per-step ratio divides by ~0 for a batch of the others.
    """

    def __init__(self, num_workers: int, max_num_seqs: int, t_train0: float):
        self.num_workers = num_workers
        self.t_train0 = t_train0  # time/wall_s: the x axis of the run report's wall-time panels
        self.train_tokens, self.rollout_busy, self.train_busy = RateMeter(), BusyMeter(), BusyMeter()
        self.gen_tokens_total, self.gen_seconds_total = 0, 0.0
        self.engine_totals = EngineTotals(max_num_seqs)

    def record(self, groups, batch, train_s: float) -> None:
        """One step's work: ``train_s`` seconds of learner time on ``batch`` (made of ``groups``)."""
        self.train_busy.add(train_s)
        n_tokens = int(batch.response_mask.sum())
        self.gen_tokens_total += n_tokens
        self.gen_seconds_total += sum(g.timings.get("gen_s", 0.0) for g in groups)
        self.train_tokens.add(n_tokens)
        self.rollout_busy.add(sum(g.timings.get("busy_s", 0.0) for g in groups))

    def step_metrics(self, *, version: int, t_step: float, t_work: float, groups, batch, samples_trained: int,
                     buffer_stats: dict, stream_rejected: int, content_rejected: int, membership: dict) -> dict:
        """The step's metrics record (after :meth:`record`); restarts the per-step meters."""
        stats = buffer_stats
        gen_s = self.gen_seconds_total
        out = {
            "policy_version": version,
            "time/wall_s": time.perf_counter() - self.t_train0,
            # engine throughput while generating, trained tokens per engine-second over the run so far
            "throughput/gen_tokens_per_s": self.gen_tokens_total / gen_s if gen_s else 0.0,
            "throughput/train_tokens_per_s": self.train_tokens.rate(),
            "util/rollout_busy": self.rollout_busy.fraction(self.num_workers),
            "util/train_busy": self.train_busy.fraction(),
            "time/step_s": time.perf_counter() - t_step,
            "time/wait_s": t_work - t_step,
            "buffer/size": stats.get("size", 0),
            "buffer/dropped_stale": stats.get("dropped_stale", 0),
            "buffer/rejected_ticket": stats.get("rejected_ticket", 0),
            "buffer/deferred": stats.get("deferred", 0),  # trained ahead of a missing lower ticket (lookahead)
            "staleness/version_spread_max": stats.get("version_spread_max", 0),
            "waste/tokens_frac": stats.get("dropped_tokens", 0)
            / max(1, stats.get("dropped_tokens", 0) + self.engine_totals.trained_tokens),
            "stream/rejected": stream_rejected,
            "stream/rejected_content": content_rejected,
            "samples_trained": samples_trained,
            "reward/failed_frac": sum(f for g in groups for f in g.sample_reward_failed()) / batch.size,
            **membership,
        }
        for meter in (self.train_tokens, self.rollout_busy, self.train_busy):
            meter.reset()
        return out
