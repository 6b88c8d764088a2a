"""Prompt datasets: rows of ``{prompt, answer}`` from a synthetic task or from JSONL / Parquet files.

Prompts are tokenised once, up front, so that rollout workers only hand token ids to the engine and every
worker sees identical ids for the same prompt. Problems in the data are never fatal row by row: an unreadable
row (bad JSON, missing key, wrong type) is skipped, counted in :attr:`PromptDataset.stats` and reported with
its file and line; a missing or unreadable *file* is an error, because silently training on nothing is worse.
"""

from __future__ import annotations

import json
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

from .tasks import get_task

log = logging.getLogger(__name__)

MAX_WARNINGS_PER_FILE = 5  # then one summary line per file


@dataclass
class DatasetStats:
    rows_read: int = 0  # rows seen in the sources (valid or not)
    bad_rows: int = 0  # unreadable rows skipped
    truncated: int = 0  # prompts cut (from the left) to prompt_length tokens
    skipped_overlong: int = 0  # prompts longer than prompt_length dropped (overlong="skip")
    templated: int = 0  # prompts formatted with the tokenizer's chat template (data.apply_chat_template)
    bad_examples: list[str] = field(default_factory=list)  # first few "file:line: reason" messages

    def as_dict(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "bad_examples"}


@dataclass(frozen=True)
class PromptItem:
    index: int  # position in the full (unsharded) dataset: stable across workers
    prompt: str  # the text given to the model (after the chat template, if applied)
    prompt_ids: list[int]
    answer: str


def extract_final_answer(answer: str) -> str:
    """GSM8K-style answers end in ``#### 42``: keep what follows the last ``####`` (commas removed)."""
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip().replace(",", "")
    return answer.strip()


def _read_jsonl(path: Path, stats: DatasetStats) -> Iterator[tuple[int, object]]:
    with path.open("r", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            stats.rows_read += 1
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as exc:
                yield lineno, exc


def _read_parquet(path: Path, stats: DatasetStats) -> Iterator[tuple[int, object]]:
    import pyarrow.parquet as pq  # heavy/optional: pyarrow, only for parquet files

    table = pq.read_table(str(path))
    for i, row in enumerate(table.to_pylist(), start=1):
        stats.rows_read += 1
        yield i, row


def _read_json_array(path: Path, stats: DatasetStats) -> Iterator[tuple[int, object]]:
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list):
        raise ValueError(f"{path}: a .json dataset must hold a list of objects (or use .jsonl)")
    for i, row in enumerate(data, start=1):
        stats.rows_read += 1
        yield i, row


def iter_file_rows(p: str, stats: DatasetStats) -> Iterator[tuple[int, object]]:
    """``(line or row number, row)`` of one JSONL / JSON / Parquet file; a row that is not valid JSON comes as the
    exception. A missing, unreadable or corrupt *file* is an error naming it (never a silent empty dataset)."""
    path = Path(p)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {p!r}")
    suffix = path.suffix.lower()
    reader = {".jsonl": _read_jsonl, ".parquet": _read_parquet, ".json": _read_json_array}.get(suffix)
    if reader is None:
        raise ValueError(f"dataset file {p!r}: unsupported extension {suffix!r}; allowed: .jsonl .json .parquet")
    try:
        yield from reader(path, stats)
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ValueError) and "a .json dataset" in str(exc):
            raise
        raise ValueError(f"dataset file {p!r} could not be read: {exc}") from exc
    except Exception as exc:  # pyarrow raises its own error types for corrupt files
        raise ValueError(f"dataset file {p!r} could not be read: {exc}") from exc


def iter_good_rows(
    paths: Sequence[str], problem: Callable[[object], Optional[str]], stats: DatasetStats
) -> Iterator[tuple[str, object, dict]]:
    """``(file, line or row number, row)`` of each row in which ``problem(row)`` finds nothing wrong (None); every
    other row is skipped, counted in ``stats`` and logged with its file, line and reason (the first few of a file,
    then a total; the first 20 kept in ``stats.bad_examples``)."""
    for p in paths:
        bad_here = 0
        for where, row in iter_file_rows(p, stats):
            reason = problem(row)
            if reason is None:
                yield p, where, row
                continue
            bad_here += 1
            stats.bad_rows += 1
            msg = f"{p}:{where}: {reason}; row skipped"
            if len(stats.bad_examples) < 20:
                stats.bad_examples.append(msg)
            if bad_here <= MAX_WARNINGS_PER_FILE:
                log.warning(msg)
        if bad_here > MAX_WARNINGS_PER_FILE:
            log.warning("%s: %d unreadable rows skipped in total", p, bad_here)


def read_rows(
    paths: Sequence[str], prompt_key: str = "prompt", answer_key: str = "answer", stats: Optional[DatasetStats] = None
) -> list[dict]:
    """Read ``{prompt, answer}`` rows from JSONL / JSON / Parquet files, skipping (and counting) bad rows."""
    stats = stats if stats is not None else DatasetStats()
    rows: list[dict] = []
    for _, _, row in iter_good_rows(paths, lambda r: _row_problem(r, prompt_key, answer_key), stats):
        ans = row[answer_key]
        ans = ans if isinstance(ans, str) else str(ans)
        rows.append({"prompt": row[prompt_key], "answer": extract_final_answer(ans)})
    return rows


def _row_problem(row, prompt_key: str, answer_key: str) -> Optional[str]:
    if isinstance(row, Exception):
        return f"invalid JSON ({row})"
    if not isinstance(row, dict):
        return f"expected an object, got {type(row).__name__}"
    for key in (prompt_key, answer_key):
        if key not in row:
            return f"missing key {key!r} (keys: {sorted(row)[:8]})"
    if not isinstance(row[prompt_key], str) or not row[prompt_key].strip():
        return f"key {prompt_key!r} must be a non-empty string, got {type(row[prompt_key]).__name__}"
    ans = row[answer_key]
    if isinstance(ans, bool) or not isinstance(ans, (str, int, float)):
        return f"key {answer_key!r} must be a string or number, got {type(ans).__name__}"
    return None


class PromptDataset:
    """Tokenised prompts with reference answers; shardable across workers; infinite shuffled iteration."""

    def __init__(
        self,
        rows: Sequence[dict],
        tokenizer,
        *,
        prompt_length: Optional[int] = None,
        overlong: str = "truncate",
        apply_chat_template: bool = False,
        stats: Optional[DatasetStats] = None,
        _items: Optional[list[PromptItem]] = None,
    ):
        if overlong not in ("truncate", "skip"):
            raise ValueError(f"overlong={overlong!r} not allowed; allowed: 'truncate', 'skip'")
        if prompt_length is not None and prompt_length < 1:
            raise ValueError(f"prompt_length={prompt_length!r} must be >= 1")
        self.tokenizer = tokenizer
        self.prompt_length = prompt_length
        self.overlong = overlong
        self.stats = stats if stats is not None else DatasetStats()
        if _items is not None:
            self.items = _items
            return
        use_template = bool(apply_chat_template and getattr(tokenizer, "chat_template", None))
        self.items = []
        for i, row in enumerate(rows):
            text = row["prompt"]
            if use_template:
                text = tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
                )
                ids = tokenizer.encode(text, add_special_tokens=False)  # the template holds the specials
                self.stats.templated += 1
            else:
                ids = tokenizer.encode(text)
            if prompt_length is not None and len(ids) > prompt_length:
                if overlong == "skip":
                    self.stats.skipped_overlong += 1
                    continue
                ids = ids[-prompt_length:]  # keep the end: the question and the generation prompt
                self.stats.truncated += 1
            self.items.append(PromptItem(index=i, prompt=text, prompt_ids=list(ids), answer=str(row["answer"])))
        if self.stats.truncated or self.stats.skipped_overlong:
            log.warning(
                "prompts longer than prompt_length=%s: %d truncated (left), %d skipped",
                prompt_length, self.stats.truncated, self.stats.skipped_overlong,
            )

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_task(cls, task, tokenizer, split: str = "train", **kwargs) -> "PromptDataset":
        splits = task.splits()
        if split not in ("train", "eval"):
            raise ValueError(f"split={split!r} not allowed; allowed: 'train', 'eval'")
        return cls(getattr(splits, split), tokenizer, **kwargs)

    @classmethod
    def from_files(
        cls, paths: Sequence[str], tokenizer, *, prompt_key: str = "prompt", answer_key: str = "answer", **kwargs
    ) -> "PromptDataset":
        if not paths:
            raise ValueError("from_files: no dataset files given")
        stats = DatasetStats()
        rows = read_rows(paths, prompt_key, answer_key, stats)
        return cls(rows, tokenizer, stats=stats, **kwargs)

    # ---------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> PromptItem:
        return self.items[i]

    def shard(self, worker_id: int, num_workers: int) -> "PromptDataset":
        """Every ``num_workers``-th item starting at ``worker_id``: shards are disjoint and cover the dataset."""
        return PromptDataset(
            (), self.tokenizer, prompt_length=self.prompt_length, overlong=self.overlong, stats=self.stats,
            _items=shard_items(self.items, worker_id, num_workers),
        )

    def iterate(self, seed: int = 0, shuffle: bool = True) -> Iterator[PromptItem]:
        """Endless pass over the items, reshuffled each epoch from ``seed`` (deterministic)."""
        yield from endless_draws(self.items, seed, shuffle)


def shard_items(items: Sequence, worker_id: int, num_workers: int) -> list:
    """Worker ``worker_id``'s share of ``items``: every ``num_workers``-th one from ``worker_id`` (shards are disjoint
    and cover the items; the rule every dataset kind shards by)."""
    if num_workers < 1 or not 0 <= worker_id < num_workers:
        raise ValueError(f"shard: worker_id={worker_id!r} must be in [0, num_workers={num_workers!r})")
    return list(items[worker_id::num_workers])


def endless_draws(items: Sequence, seed: int = 0, shuffle: bool = True) -> Iterator:
    """The run's prompt order over ``items``: endless epochs, each reshuffled from ``seed`` (deterministic), shared
    by every row format so that draw numbers (data/position.py) mean the same thing whatever the rows are."""
    if not items:
        raise ValueError("cannot iterate an empty dataset (all rows bad, skipped or sharded away?)")
    epoch = 0
    while True:
        order = list(range(len(items)))
        if shuffle:
            random.Random(seed * 1_000_003 + epoch).shuffle(order)
        for i in order:
            yield items[i]
        epoch += 1


def build_prompt_dataset(cfg, model_path: str, split: str = "train", tokenizer=None) -> PromptDataset:
    """The dataset a run trains (``split="train"``) or evaluates (``"eval"``) on, from an ``AsyncPPOConfig``.

    ``data.train_files`` / ``data.eval_files`` when given, else the built-in ``data.task`` (its held-out split
    has ``data.num_eval_prompts`` rows, disjoint from training). Prompts are tokenised with the tokenizer in
    ``model_path`` and limited to ``rollout.prompt_length`` tokens per ``rollout.overlong_prompt``.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split={split!r} not allowed; allowed: 'train', 'eval'")
    if tokenizer is None:
        from transformers import AutoTokenizer  # heavy: transformers

        tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    d, ro = cfg.data, cfg.rollout
    common = dict(
        prompt_length=ro.prompt_length, overlong=ro.overlong_prompt, apply_chat_template=d.apply_chat_template
    )
    if d.train_files:
        files = list(d.train_files if split == "train" else d.eval_files)
        if not files:
            raise ValueError("data.eval_files is empty: evaluation on file datasets needs eval files")
        return PromptDataset.from_files(files, tokenizer, prompt_key=d.prompt_key, answer_key=d.answer_key, **common)
    task = get_task(d.task, seed=d.seed, num_eval=d.num_eval_prompts)
    return PromptDataset.from_task(task, tokenizer, split=split, **common)
