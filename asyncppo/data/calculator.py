"""The calculator task (``data=calculator``): 3-digit x 2-digit products, with a ``calc`` tool the model may call.

Why this task: a tiny model cannot multiply ``347*86`` in its head, but it can learn to copy the expression into a
tool call and the tool's result into its answer. Whether it calls the tool is one decision, at the first token of
its first turn, and the reward (exact match on the final answer) tells the two paths apart sharply: a task where
reinforcement learning on multi-turn episodes visibly pays within minutes on two CPU cores.

What lives here (data/, importable by the warm start and by the environment in envs/): the rows and their split,
the tool's JSON schema, the safe evaluator of the tool's expression (:func:`evaluate_expression`: digits and
``+ - *`` only, never ``eval``), and the supervised transcripts of the warm start (:func:`transcript_segments`).
The environment that runs the episodes is :class:`asyncppo.envs.calculator.CalculatorEnv`.
"""

from __future__ import annotations

import json
import random
import re
from typing import Optional

from .chat_tokenizer import IM_END
from .splits import TaskSplits

CALC_TOOL = {"type": "function", "function": {
    "name": "calc", "description": "Evaluate integers with + - *",
    "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]}}}

MAX_EXPR_CHARS = 64  # a longer expression is refused: the product of a row needs 6
MAX_LITERAL_DIGITS = 12  # bounds the result's size: no runaway big-integer work from a sampled expression
_TOKEN = re.compile(r"\s*(\d+|[-+*])")


def evaluate_expression(expr: str) -> int:
    """The integer value of ``expr``: non-negative integer literals joined by ``+``, ``-`` and ``*`` (``*`` binds
    tighter), optional spaces, an optional leading minus. ValueError with the reason for anything else: no
    parentheses, names, calls or other characters are read, so the tool cannot run code."""
    if not isinstance(expr, str):
        raise ValueError(f"expr must be a string, got {type(expr).__name__}")
    if len(expr) > MAX_EXPR_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPR_CHARS} characters")
    tokens, pos, text = [], 0, expr.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if m is None:
            raise ValueError(f"unexpected character {text[pos:].lstrip()[:1]!r}: only digits and + - * are allowed")
        tokens.append(m.group(1))
        pos = m.end()
    if not tokens:
        raise ValueError("empty expression")
    sign = 1
    if tokens[0] == "-":
        sign, tokens = -1, tokens[1:]
    if len(tokens) % 2 == 0:
        raise ValueError("an operator must stand between two numbers")
    numbers, ops = tokens[0::2], tokens[1::2]
    for n in numbers:
        if not n.isdigit():
            raise ValueError(f"expected a number, got {n!r}")
        if len(n) > MAX_LITERAL_DIGITS:
            raise ValueError(f"a number has more than {MAX_LITERAL_DIGITS} digits")
    if any(op.isdigit() for op in ops):
        raise ValueError("two numbers without an operator between them")
    total, term = 0, sign * int(numbers[0])
    for op, n in zip(ops, numbers[1:]):
        if op == "*":
            term *= int(n)
        else:
            total += term
            term = int(n) if op == "+" else -int(n)
    return total + term


def tool_call_text(expr: str) -> str:
    """The model's turn that calls the tool, in the template's syntax (compact JSON, as the warm start writes it)."""
    return "<tool_call>" + json.dumps({"name": "calc", "arguments": {"expr": expr}}) + "</tool_call>"


class CalculatorTask:
    """Rows ``{"prompt": "What is 347*86?", "answer": "29842"}`` over every pair of a 3-digit and a 2-digit number.

    Split (deterministic by ``seed``): all 81,000 pairs shuffled; the first ``HELD_OUT_POOL`` are held out whatever
    ``num_eval`` is (the eval split is the pool's first ``num_eval``), the rest are the train split. So a run never
    trains on a held-out pair, whatever ``data.num_eval_prompts`` says (``data=calculator`` evaluates the first 100
    as whole episodes in the run; :mod:`asyncppo.envs.calculator_eval` measures any saved weights on the pool).
    """

    name = "calculator"
    default_reward = "exact_match"
    HELD_OUT_POOL = 1024
    multi_turn = True  # rows start episodes of asyncppo.envs.calculator.CalculatorEnv, not single answers

    def __init__(self, seed: int = 0, num_eval: int = 256):
        if not 0 <= num_eval <= self.HELD_OUT_POOL:
            raise ValueError(f"calculator task: num_eval={num_eval!r} must be in [0, {self.HELD_OUT_POOL}]")
        self.seed, self.num_eval = seed, num_eval

    @staticmethod
    def row(a: int, b: int) -> dict:
        return {"prompt": f"What is {a}*{b}?", "answer": str(a * b), "expr": f"{a}*{b}"}

    def held_out(self) -> list[dict]:
        """The whole held-out pool (never trained on), for evaluations larger than ``num_eval``."""
        return self._rows()[: self.HELD_OUT_POOL]

    def splits(self) -> TaskSplits:
        rows = self._rows()
        return TaskSplits(train=rows[self.HELD_OUT_POOL:], eval=rows[: self.num_eval])

    def _rows(self) -> list[dict]:
        pairs = [(a, b) for a in range(100, 1000) for b in range(10, 100)]
        random.Random(f"calculator-{self.seed}").shuffle(pairs)
        return [self.row(a, b) for a, b in pairs]

    def alphabet(self) -> str:
        """Every character a transcript can contain: the chat tokenizer's printable ASCII and newline."""
        return "\n" + "".join(map(chr, range(32, 127)))

    @property
    def max_response_tokens(self) -> int:
        return 6  # a single-turn answer: at most 5 digits + eos (the episodes' budget is rollout.response_length)

    def transcript_messages(self, row: dict, use_tool: bool) -> list[dict]:
        """One supervised episode: the tool path (call, the tool's result, the result as the answer) or the
        in-head path (the right product at once, which the tiny model learns only loosely)."""
        user = {"role": "user", "content": row["prompt"]}
        if not use_tool:
            return [user, {"role": "assistant", "content": row["answer"]}]
        return [user, {"role": "assistant", "content": tool_call_text(row["expr"])},
                {"role": "tool", "content": row["answer"]}, {"role": "assistant", "content": row["answer"]}]

    def warmstart_transcripts(self, tokenizer, count: int, rng: random.Random, tool_share: float,
                              with_tools: bool = True) -> list[list[tuple[str, bool]]]:
        """``count`` train transcripts, a ``tool_share`` of them on the tool path, as (text, trained) segments;
        ``with_tools=False`` leaves the tools' system turn out (the short transcripts of the copy phase)."""
        if not 0.0 <= tool_share <= 1.0:
            raise ValueError(f"calculator warm start: tool_share={tool_share!r} must be in [0, 1]")
        train = self.splits().train
        return [transcript_segments(tokenizer, self.transcript_messages(rng.choice(train), rng.random() < tool_share),
                                    [CALC_TOOL] if with_tools else None) for _ in range(count)]


def transcript_segments(tokenizer, messages: list[dict], tools: Optional[list]) -> list[tuple[str, bool]]:
    """``messages`` rendered by the tokenizer's chat template as ``(text, trained)`` segments: each assistant
    message's content and the ``<|im_end|>`` that closes it are trained (what the model generates in an episode,
    its stop token included); everything else (system, user, tool turns, headers) is context. Rendering prefixes
    keeps the segments exactly the full render's text."""
    segments, done = [], ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:k], tools=tools, tokenize=False, add_generation_prompt=True)
        if not prefix.startswith(done):
            raise ValueError("the chat template is not prefix-stable")
        segments += [(prefix[len(done):], False), (message["content"] + IM_END, True)]
        done = prefix + message["content"] + IM_END
    return segments
