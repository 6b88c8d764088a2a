"""The pieces every group of checks shares: the error that lists all problems, the collector that words them, and
the two derived quantities (mini-batch size, whether a critic is trained) that several groups test against.

Apart from :mod:`asyncppo.config.validate` so that the per-group modules (``validate_algorithm``,
``validate_cluster``) can use them without importing the module that calls them.
"""

from __future__ import annotations

from typing import Any, Iterable

from asyncppo.config.schema import AsyncPPOConfig


class ConfigError(ValueError):
    """One or more invalid options; ``problems`` holds one line per option, the message lists them all."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"invalid configuration ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class Checks:
    """Accumulates errors and warnings; each helper states the rule in the message it records."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, key: str, value: Any, allowed: str) -> None:
        self.errors.append(f"{key}={value!r}: {allowed}")

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def choice(self, key: str, value: Any, allowed: tuple) -> None:
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            self.error(key, value, f"unknown value; allowed: {shown}")

    def positive(self, key: str, value: Any) -> None:
        if value is None or value <= 0:
            self.error(key, value, "must be > 0")

    def non_negative(self, key: str, value: Any) -> None:
        if value is None or value < 0:
            self.error(key, value, "must be >= 0")

    def optional_positive(self, key: str, value: Any, meaning: str = "") -> None:
        if value is not None and value <= 0:
            self.error(key, value, f"must be null{meaning} or > 0")

    def in_range(self, key: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
        if not ok:
            self.error(key, value, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")

    def non_empty(self, key: str, value: Any) -> None:
        if not value or not str(value).strip():
            self.error(key, value, "must be a non-empty string")


def mini_batch_prompts(cfg: AsyncPPOConfig) -> int:
    """Prompts per mini-batch: ``ppo_mini_batch_size``, else the batch split into ``ppo_num_mini_batches``."""
    a, B = cfg.algorithm, cfg.rollout.rollout_batch_size
    if a.ppo_mini_batch_size:
        return a.ppo_mini_batch_size
    n = min(a.ppo_num_mini_batches, B)  # a batch smaller than the count: one prompt per mini-batch
    if n > 0 and B % n == 0:
        return B // n
    return B


def uses_critic(cfg: AsyncPPOConfig) -> bool:
    """Whether the run trains a value model: ``use_critic``, or GAE when that is null."""
    a = cfg.algorithm
    return (a.adv_estimator == "gae") if a.use_critic is None else bool(a.use_critic)


def uses_reference(cfg: AsyncPPOConfig) -> bool:
    """Whether the run keeps a frozen reference policy: a KL term, in the loss or in the reward."""
    return bool(cfg.algorithm.use_kl_loss or cfg.algorithm.add_token_level_kl)


def samples_per_group(cfg: AsyncPPOConfig) -> int:
    """The most samples one group's record may hold: the ``n`` answers or episodes of a prompt, and under
    ``env.agent_branches=all`` each episode's earlier branches too (a branch starts at a model call: at most
    ``env.max_turns`` branches an episode)."""
    n, e = cfg.rollout.num_return_sequences_in_group, cfg.env
    return n * max(1, e.max_turns) if e.agent and e.agent_branches == "all" else n
