"""Drawing SkyRL-format rows (:mod:`asyncppo.data.text_rows`) in the run's prompt order.

Why a dataset of its own: a text-environment run on ``data.train_files`` in SkyRL's format (``prompt`` a list of
chat messages) starts each episode from a row, not from tokenised text: the environment's ``init`` gets the row's
messages and the episode loop renders what it returns. Everything else must match the prompt datasets exactly, so
that restarts, resumes and replaced workers keep working: the same shards (every ``num_workers``-th row), the same
endless per-epoch shuffle (:func:`asyncppo.data.datasets.endless_draws`), hence the same draw numbers
(:mod:`asyncppo.data.position`). :func:`text_env_rows_in` tells the two formats apart by the first readable row.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence

from .datasets import DatasetStats, endless_draws, iter_file_rows, shard_items
from .text_rows import TextEnvRow, read_text_env_rows


class TextRowDataset:
    """SkyRL-format rows, shardable across workers, drawn endlessly like :class:`~asyncppo.data.datasets.PromptDataset`."""

    def __init__(self, rows: Sequence[TextEnvRow], stats: Optional[DatasetStats] = None):
        self.items = list(rows)
        self.stats = stats if stats is not None else DatasetStats()

    @classmethod
    def from_files(cls, paths: Sequence[str], prompt_key: str = "prompt") -> "TextRowDataset":
        stats = DatasetStats()
        return cls(read_text_env_rows(paths, prompt_key=prompt_key, stats=stats), stats)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> TextEnvRow:
        return self.items[i]

    def shard(self, worker_id: int, num_workers: int) -> "TextRowDataset":
        """Every ``num_workers``-th row starting at ``worker_id``, as prompt datasets shard."""
        return TextRowDataset(shard_items(self.items, worker_id, num_workers), self.stats)

    def iterate(self, seed: int = 0, shuffle: bool = True) -> Iterator[TextEnvRow]:
        yield from endless_draws(self.items, seed, shuffle)


def _first_prompt(path: str, prompt_key: str):
    """The ``prompt_key`` value of the first row of ``path`` that is an object holding it (None: no such row)."""
    for _, row in iter_file_rows(path, DatasetStats()):
        if isinstance(row, dict) and prompt_key in row:
            return row[prompt_key]
    return None


def text_env_rows_in(paths: Sequence[str], prompt_key: str = "prompt", option: str = "data.train_files") -> bool:
    """Whether ``paths`` hold SkyRL-format rows (the first usable row's prompt is a list of chat messages) rather
    than ``{prompt, answer}`` text rows. ValueError naming ``option`` when the files disagree: one run draws one
    kind of row."""
    kinds = {p: isinstance(_first_prompt(p, prompt_key), list) for p in paths}
    if len(set(kinds.values())) > 1:
        chat = sorted(p for p, k in kinds.items() if k)
        text = sorted(p for p, k in kinds.items() if not k)
        raise ValueError(f"{option}: {chat} hold SkyRL-format rows ({prompt_key!r} a list of chat messages) but "
                         f"{text} hold text prompts; one run reads one format")
    return bool(paths) and all(kinds.values())


def draws_text_env_rows(cfg) -> bool:
    """Whether a text-environment run (an ``AsyncPPOConfig``) draws SkyRL-format rows from ``data.train_files``
    (else the task's or ``{prompt, answer}`` rows). ValueError naming the option when its files are of both formats.
    (SkyRL-format ``data.eval_files`` are evaluated as episodes: :func:`asyncppo.data.heldout.eval_file_sets`.)"""
    d = cfg.data
    return bool(d.train_files) and text_env_rows_in(list(d.train_files), d.prompt_key, "data.train_files")
