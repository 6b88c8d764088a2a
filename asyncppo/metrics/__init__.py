"""Metric sinks (console, JSONL, wandb) and the accounting that feeds them."""

from asyncppo.metrics.logger import MetricsLogger
from asyncppo.metrics.meters import BusyMeter, RateMeter, lag_stats

__all__ = ["MetricsLogger", "BusyMeter", "RateMeter", "lag_stats"]
