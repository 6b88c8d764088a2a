"""Dataset rows for text environments, in SkyRL's format.

A row is one episode's start: ``prompt`` (a list of chat messages, ``{"role": ..., "content": ...}``), optionally
``env_class`` (the environment's name in skyrl-gym's registry; informative here, ``env.text_env`` names the class),
and whatever the environment reads from it: usually ``reward_spec`` (e.g. ``{"method": "rule", "ground_truth":
"72"}``), ``extra_info`` and ``data_source``. skyrl-train hands an environment every field of its row except the
prompt and the environment class, as ``extras``; so does this reader (:attr:`TextEnvRow.extras`), so that an
environment written for skyrl-gym finds what it expects. The prompt messages go to the environment's ``init``,
which returns the conversation the model starts from; that conversation is rendered with the chat template by the
episode loop, after ``init``, so the rows are not tokenised here.

As with prompt datasets (:mod:`asyncppo.data.datasets`), a bad row (not an object, no prompt, a prompt that is not a
list of chat messages, a ``reward_spec`` or ``extra_info`` that is not an object) is skipped, counted in the
stats and reported with its file and line; a file with no usable row at all is an error naming it.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from .datasets import DatasetStats, iter_good_rows

OBJECT_FIELDS = ("reward_spec", "extra_info")  # SkyRL's fields that environments read as mappings


@dataclass(frozen=True)
class TextEnvRow:
    index: int  # position among the usable rows of all files: stable across workers
    prompt_messages: list  # chat messages handed to the environment's init
    env_class: Optional[str]  # the row's env_class, if any (skyrl-gym's registry name)
    extras: dict = field(default_factory=dict)  # every other field of the row, as skyrl-train passes them
    source: str = ""  # "file:line", for messages about this row

    def episode_extras(self) -> dict:
        """A private deep copy of :attr:`extras` per environment: an environment that edits its extras (or the
        nested ``reward_spec``) cannot change what its group's other episodes, or the row's next epoch, read."""
        return copy.deepcopy(self.extras)


def text_row_problem(row: Any, prompt_key: str = "prompt", env_class_key: str = "env_class") -> Optional[str]:
    """Why ``row`` cannot start an episode, or None."""
    if isinstance(row, Exception):
        return f"invalid JSON ({row})"
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    if prompt_key not in row:
        return f"missing key {prompt_key!r} (keys: {sorted(row)[:8]})"
    prompt = row[prompt_key]
    if not isinstance(prompt, list) or not prompt:
        return (f"key {prompt_key!r} must be a non-empty list of chat messages "
                f"[{{\"role\": ..., \"content\": ...}}], got {type(prompt).__name__}")
    for i, m in enumerate(prompt):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            return f"{prompt_key}[{i}] must be an object with string 'role' and 'content', got {m!r:.80}"
    env_class = row.get(env_class_key)
    if env_class is not None and not isinstance(env_class, str):
        return f"key {env_class_key!r} must be a string, got {type(env_class).__name__}"
    for key in OBJECT_FIELDS:
        if row.get(key) is not None and not isinstance(row[key], dict):
            return f"key {key!r} must be an object, got {type(row[key]).__name__}"
    return None


def read_text_env_rows(paths: Sequence[str], *, prompt_key: str = "prompt", env_class_key: str = "env_class",
                       stats: Optional[DatasetStats] = None) -> list[TextEnvRow]:
    """The usable rows of JSONL / JSON / Parquet files in SkyRL's format; bad rows skipped and counted. ValueError
    naming the files when none is usable (training on nothing is worse than stopping)."""
    if not paths:
        raise ValueError("text environment rows: no dataset files given (data.train_files)")
    stats = stats if stats is not None else DatasetStats()
    rows: list[TextEnvRow] = []
    for p, where, row in iter_good_rows(paths, lambda r: text_row_problem(r, prompt_key, env_class_key), stats):
        extras = {k: v for k, v in row.items() if k not in (prompt_key, env_class_key)}
        rows.append(TextEnvRow(index=len(rows), prompt_messages=[dict(m) for m in row[prompt_key]],
                               env_class=row.get(env_class_key), extras=extras, source=f"{p}:{where}"))
    if not rows:
        raise ValueError(f"text environment rows: no usable row in {list(paths)} ({stats.rows_read} read, "
                         f"{stats.bad_rows} bad; first: {stats.bad_examples[:3]})")
    return rows


def build_text_env_rows(cfg, split: str = "train") -> list[TextEnvRow]:
    """The rows a text-environment run trains on (``data.train_files``) or evaluates on (``data.eval_files``),
    from an ``AsyncPPOConfig`` (``data.prompt_key`` names the prompt field)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} not allowed; allowed: 'train', 'eval'")
    files = list(cfg.data.train_files if split == "train" else cfg.data.eval_files)
    if not files:
        raise ValueError(f"data.{split}_files is empty: a text environment run reads its rows from files "
                         "(SkyRL's format: prompt as chat messages, reward_spec, extra_info)")
    return read_text_env_rows(files, prompt_key=cfg.data.prompt_key)
