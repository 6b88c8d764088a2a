"""Synthetic tasks with verifiable answers, generated locally so that a run needs no downloaded data.

``addition``: zero-padded two-digit addition (``07+45=`` -> ``52``). Zero padding makes every prompt the same
length (six characters, six tokens with the char-level tokenizer), so batches need no padding and a tiny model
can learn the task in a few minutes on two CPU cores: a task where a PPO run *visibly* improves the policy is
the cheapest end-to-end check that the whole system works. Its answers are ~3.5 tokens long.

``reverse``: string reversal (``cabd>`` -> ``dbac``) with a heavy-tailed (discretised lognormal) string
length, so response lengths are long-tailed like the generations asyncppo is built for: most responses are a
few tokens, a few percent run to ``max_len``. See :class:`ReverseTask`.

Every task has a deterministic train/eval split by ``seed``; held-out eval prompts never appear in the train
split, so eval accuracy measures generalisation rather than memorisation. A task also says how many tokens a
complete response can take (``max_response_tokens``, the answer plus eos and slack), which bounds generation
in the accuracy probes.
"""

from __future__ import annotations

import math
import random
from typing import Callable

from .calculator import CalculatorTask
from .guess import GuessTask
from .splits import TaskSplits  # noqa: F401 (re-exported: the tasks' split type is named here too)


def truncated_lognormal_int(rng: random.Random, median: float, sigma: float, high: int) -> int:
    """``round(exp(N(log(median), sigma)))`` redrawn until it lies in ``[1, high]``: the heavy-tailed size of the
    long-tailed tasks (most draws near the median, a few near ``high``)."""
    mu = math.log(median)
    while True:
        n = int(round(math.exp(rng.gauss(mu, sigma))))
        if 1 <= n <= high:
            return n


class AdditionTask:
    """``a+b=`` with zero-padded ``digits``-digit operands; the answer is the decimal sum without padding."""

    name = "addition"
    default_reward = "exact_match"

    def __init__(self, digits: int = 2, seed: int = 0, num_eval: int = 256):
        if digits < 1 or digits > 4:
            raise ValueError(f"addition task: digits={digits!r} not allowed (1..4)")
        total = (10**digits) ** 2
        if not 0 <= num_eval < total:
            raise ValueError(f"addition task: num_eval={num_eval!r} must be in [0, {total})")
        self.digits = digits
        self.seed = seed
        self.num_eval = num_eval

    def format_prompt(self, a: int, b: int) -> str:
        return f"{a:0{self.digits}d}+{b:0{self.digits}d}="

    @staticmethod
    def format_answer(a: int, b: int) -> str:
        return str(a + b)

    def row(self, a: int, b: int) -> dict:
        return {"prompt": self.format_prompt(a, b), "answer": self.format_answer(a, b)}

    def splits(self) -> TaskSplits:
        """All operand pairs, shuffled by ``seed``; the first ``num_eval`` are held out for evaluation."""
        n = 10**self.digits
        pairs = [(a, b) for a in range(n) for b in range(n)]
        random.Random(self.seed).shuffle(pairs)
        rows = [self.row(a, b) for a, b in pairs]
        return TaskSplits(train=rows[self.num_eval :], eval=rows[: self.num_eval])

    def alphabet(self) -> str:
        """Every character a prompt or answer can contain (the char-level tokenizer's vocabulary)."""
        return "0123456789+="

    @property
    def max_response_tokens(self) -> int:
        """Tokens a probe generates at most: the longest sum (``digits + 1``), eos, and one spare (5 for 2 digits,
        the value the accuracy probe always used)."""
        return self.digits + 3


class ReverseTask:
    """``<s>>`` -> ``<s reversed>`` for a string ``s`` over ``letters`` whose length is heavy-tailed.

    Length: ``round(exp(N(log(median_len), sigma)))`` redrawn until it lies in ``[1, max_len]`` (a truncated,
    discretised lognormal). The defaults (median 5, sigma 0.9, max_len 48) give, over the train split: mean ~7.2,
    p50 5, p90 16, p99 ~35, max 48: most responses are a few tokens, one in a hundred is 5-10x the median. The
    response is ``len(s) + 1`` tokens with eos, the prompt ``len(s) + 1``: ``rollout.response_length`` must be at
    least ``max_len + 1`` for every answer to fit.

    Splits (deterministic by ``seed``): ``num_eval`` held-out rows and ``num_train`` train rows, both drawn from
    the same length distribution, and no held-out string is ever a train prompt. Long strings are drawn at random
    (the space, ``len(letters) ** L``, is huge; a repeat is redrawn). Short lengths have too few strings for that
    (16 of length 1): for every length with at most ``4096`` strings, a seeded eighth of them is reserved for
    eval and the rest for train, and rows of that length are drawn from their side with replacement. So both
    splits follow the length distribution exactly, short prompts may repeat (as they would in any sample of the
    task), and the model never trains on a held-out string.
    """

    name = "reverse"
    default_reward = "exact_match"
    SEPARATOR = ">"
    _SMALL_SPACE = 4096  # lengths with at most this many strings are partitioned explicitly
    _EVAL_SHARE = 8  # 1/8 of a small length's strings are held out

    def __init__(
        self,
        seed: int = 0,
        num_eval: int = 256,
        max_len: int = 48,
        num_train: int = 20000,
        median_len: float = 5.0,
        sigma: float = 0.9,
        letters: str = "abcdefghijklmnop",
    ):
        if max_len < 1:
            raise ValueError(f"reverse task: max_len={max_len!r} must be >= 1")
        if num_eval < 0 or num_train < 1:
            raise ValueError(f"reverse task: num_eval={num_eval!r} must be >= 0 and num_train={num_train!r} >= 1")
        if median_len <= 0 or sigma <= 0:
            raise ValueError(f"reverse task: median_len={median_len!r} and sigma={sigma!r} must be > 0")
        if len(set(letters)) != len(letters) or len(letters) < 2 or self.SEPARATOR in letters:
            raise ValueError(f"reverse task: letters={letters!r} must be >= 2 distinct characters without "
                             f"{self.SEPARATOR!r}")
        self.seed, self.num_eval, self.num_train, self.max_len = seed, num_eval, num_train, max_len
        self.median_len, self.sigma, self.letters = median_len, sigma, letters

    @property
    def max_response_tokens(self) -> int:
        """The longest answer plus eos."""
        return self.max_len + 1

    def row(self, s: str) -> dict:
        return {"prompt": s + self.SEPARATOR, "answer": s[::-1]}

    def sample_length(self, rng: random.Random) -> int:
        return truncated_lognormal_int(rng, self.median_len, self.sigma, self.max_len)

    def splits(self) -> TaskSplits:
        k = len(self.letters)
        rng = random.Random(f"reverse-{self.seed}")
        # explicit held-out / train partition of every length whose string space is small
        small: dict[int, tuple[list[str], list[str]]] = {}
        n = 1
        while n <= self.max_len and k**n <= self._SMALL_SPACE:
            space = [""]
            for _ in range(n):
                space = [p + c for p in space for c in self.letters]
            rng.shuffle(space)
            cut = max(1, len(space) // self._EVAL_SHARE)
            small[n] = (space[:cut], space[cut:])
            n += 1

        def draw(side: int, avoid: set[str]) -> str:
            n = self.sample_length(rng)
            if n in small:
                return rng.choice(small[n][side])
            while True:
                s = "".join(rng.choice(self.letters) for _ in range(n))
                if s not in avoid:
                    return s

        held: set[str] = set()
        eval_strings = []
        for _ in range(self.num_eval):
            s = draw(0, held)
            held.add(s)
            eval_strings.append(s)
        train_strings = [draw(1, held) for _ in range(self.num_train)]
        return TaskSplits(train=[self.row(s) for s in train_strings], eval=[self.row(s) for s in eval_strings])

    def alphabet(self) -> str:
        return self.letters + self.SEPARATOR


_TASKS: dict[str, Callable[..., object]] = {"addition": AdditionTask, "reverse": ReverseTask,
                                            "calculator": CalculatorTask, "guess": GuessTask}


def register_task(name: str, factory: Callable[..., object]) -> None:
    _TASKS[name] = factory


def get_task(name: str, **kwargs):
    """Build a registered task by name (``kwargs`` go to its constructor, e.g. ``seed``, ``num_eval``)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; registered tasks: {sorted(_TASKS)}")
    return _TASKS[name](**kwargs)


def available_tasks() -> list[str]:
    return sorted(_TASKS)
