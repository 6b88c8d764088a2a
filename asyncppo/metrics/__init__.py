"""Metric sinks (console, JSONL, wandb) and the accounting that feeds them."""

from asyncppo.metrics.logger import MetricsLogger
from asyncppo.metrics.meters import BusyMeter, RateMeter, lag_stats
from asyncppo.metrics.rollout import EngineTotals, batch_token_lag_stats, token_lag_stats

__all__ = ["MetricsLogger", "BusyMeter", "EngineTotals", "RateMeter", "lag_stats", "token_lag_stats",
           "batch_token_lag_stats"]
