"""``long``: a built-in task whose responses are long because the working is long (``data=long``).

The task: the remainder of ``n`` divided by a digit ``d``, found by repeated subtraction with every step written
out. ``7:2400,`` asks for ``42 mod 7`` (numbers are four digits, least-significant digit first, zero padded) and the
reference response is ``5300,8200,1200,4100,7000,0000=0``: ``n - d``, ``n - 2d``, ... down to the first value
below ``d``, then ``=`` and that value. The response is ``5m + 1`` tokens for ``m = n // d`` steps, so its length
follows the operands, and a model can only answer by doing the working: nothing in the prompt gives the remainder
of a four-digit number away.

Why this shape: a tiny model (two layers, 128 wide) can learn every step from a fixed window: each digit is the
digit five tokens back (the same place of the previous value) less a borrow that the previous digit pair shows
(a borrow happened exactly when the new digit exceeds the old one), and the units less ``d`` (the prompt's first
token). Little-endian digits are what make the borrow visible before it is needed. Each step is therefore easy,
but an answer is exact only if all ``m`` steps are: long responses are where a warm-started policy still fails
and where RL has room, which is the regime the trainer is built for.

Length: ``m`` follows a truncated, discretised lognormal on ``[1, max_steps]`` (median ``median_steps``, spread
``sigma``), so most responses are short and a few run to ``5 * max_steps + 1`` tokens. The defaults give, over
the train split (seed 0): mean ~158 tokens, p50 106, p99 801 (~5.1x the mean), max 1,026 (eos not counted);
``tests/unit/test_data_long.py`` pins them. The reward is the exact match of the whole response (the working is
deterministic, so a wrong step is a wrong answer), as the held-out probe counts it. A partial-credit reward,
``rollout.reward_fn=long_working`` (:func:`long_working`), is registered too but is not the default: in the one run
measured with it (lr 2e-4) responses grew from ~110 to ~270 tokens and the training reward fell in 13 steps,
because a working that never stops still earns up to half credit.

Splits: every step count ``m`` has the same 44 ``(d, r)`` pairs (``d`` in 2..9, remainder ``r < d``); a seeded
eighth of them is held out for each ``m`` and rows are drawn from their side with replacement, so both splits
follow the length distribution and no held-out problem is ever a train prompt.
"""

from __future__ import annotations

import random

from .rewards import register_reward
from .tasks import TaskSplits, register_task, truncated_lognormal_int

WIDTH = 4  # digits of every number: n <= 9 * max_steps + 8 must fit


def little_endian(value: int) -> str:
    """``value`` as ``WIDTH`` digits, least-significant first (``42`` -> ``2400``)."""
    return f"{value:0{WIDTH}d}"[::-1]


class LongTask:
    """``d:<n little-endian>,`` -> the repeated-subtraction working of ``n mod d`` and ``=<remainder>``."""

    name = "long"
    default_reward = "exact_match"
    DIVISORS = range(2, 10)
    _EVAL_SHARE = 8  # 1/8 of each step count's (d, r) pairs are held out

    def __init__(self, seed: int = 0, num_eval: int = 256, num_train: int = 20000, max_steps: int = 205,
                 median_steps: float = 21.0, sigma: float = 1.0):
        if not 1 <= max_steps <= (10**WIDTH - 9) // 9:
            raise ValueError(f"long task: max_steps={max_steps!r} must be in [1, {(10**WIDTH - 9) // 9}]")
        if num_eval < 0 or num_train < 1:
            raise ValueError(f"long task: num_eval={num_eval!r} must be >= 0 and num_train={num_train!r} >= 1")
        if median_steps <= 0 or sigma <= 0:
            raise ValueError(f"long task: median_steps={median_steps!r} and sigma={sigma!r} must be > 0")
        self.seed, self.num_eval, self.num_train, self.max_steps = seed, num_eval, num_train, max_steps
        self.median_steps, self.sigma = median_steps, sigma

    @property
    def max_response_tokens(self) -> int:
        """The longest response (``5 * max_steps + 1`` tokens) plus eos."""
        return 5 * self.max_steps + 2

    @staticmethod
    def row(n: int, d: int) -> dict:
        """The prompt and the reference response of ``n mod d`` (``n >= d``)."""
        values = list(range(n - d, -1, -d))
        return {"prompt": f"{d}:{little_endian(n)},",
                "answer": ",".join(little_endian(v) for v in values) + f"={values[-1]}"}

    def sample_steps(self, rng: random.Random) -> int:
        return truncated_lognormal_int(rng, self.median_steps, self.sigma, self.max_steps)

    def splits(self) -> TaskSplits:
        rng = random.Random(f"long-{self.seed}")
        pairs = [(d, r) for d in self.DIVISORS for r in range(d)]
        sides: dict[int, tuple[list, list]] = {}
        for m in range(1, self.max_steps + 1):
            shuffled = pairs[:]
            rng.shuffle(shuffled)
            cut = len(shuffled) // self._EVAL_SHARE
            sides[m] = (shuffled[:cut], shuffled[cut:])

        def draw(side: int) -> dict:
            m = self.sample_steps(rng)
            d, r = rng.choice(sides[m][side])
            return self.row(m * d + r, d)

        held = [draw(0) for _ in range(self.num_eval)]
        return TaskSplits(train=[draw(1) for _ in range(self.num_train)], eval=held)

    def alphabet(self) -> str:
        return "0123456789:,="


def long_working(response_text: str, answer: str, **kw) -> float:
    """1.0 for the exact response; otherwise half the fraction of the reference's steps written correctly before
    the first wrong one (0.0 .. 0.5); opt in with ``rollout.reward_fn=long_working``. Why partial credit: an exact-match reward gives a 600-token working with one
    slip the same 0 as no working at all, so a group's advantages barely tell a long answer that nearly made it
    from one that went wrong at once; the prefix credit ranks them, and only an exact answer reaches 1.0."""
    got, ref = response_text.strip(), str(answer).strip()
    if got == ref:
        return 1.0
    want = ref.split("=")[0].split(",")
    wrote = got.split("=")[0].split(",")
    right = 0
    for a, b in zip(wrote, want):
        if a != b:
            break
        right += 1
    return 0.5 * right / len(want)


register_reward("long_working", long_working)
register_task("long", LongTask)
