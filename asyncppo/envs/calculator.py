"""The calculator environment of ``data=calculator``: a ``calc`` tool the model may call, then its final answer.

Why an environment and not a reward function: the tool's result must reach the model *within* the episode, as a
tool turn it reads before answering. The task's rows, the tool's JSON schema and the safe evaluator of its
expression live in :mod:`asyncppo.data.calculator` (shared with the warm start); this class only plays the turns:

* a turn with tool calls: each call is answered with a tool message (the value, or ``error: ...`` for an
  expression the evaluator refuses); a malformed call, or a call of another tool, gets an error observation; the
  episode goes on (reward 0) until ``max_turns``;
* a turn without a call is the final answer: reward 1 when it is exactly the row's answer, else 0; the episode ends.
"""

from __future__ import annotations

from typing import Mapping, Optional

from asyncppo.data.calculator import CALC_TOOL, evaluate_expression
from asyncppo.envs.text_env import TextEnv
from asyncppo.envs.tools import error_observation, parse_tool_calls, tool_message


def _reference_answer(extras: Mapping) -> str:
    """The row's answer: a task row's ``answer``, or a SkyRL row's ``reward_spec.ground_truth``."""
    if extras.get("answer") not in (None, ""):
        return str(extras["answer"]).strip()
    truth = (extras.get("reward_spec") or {}).get("ground_truth")
    if truth is None:
        raise ValueError("the calculator environment needs the row's 'answer' or reward_spec.ground_truth")
    return str(truth).strip()


class CalculatorEnv(TextEnv):
    """One episode of ``data=calculator`` (module docstring). ``extras["max_turns"]`` (``env.max_turns``) bounds
    the model turns; a turn that still calls the tool at the limit ends the episode unsolved."""

    tools = [CALC_TOOL]

    def __init__(self, env_config: Optional[Mapping] = None, extras: Optional[Mapping] = None):
        super().__init__(env_config, extras)
        self.answer = _reference_answer(self.extras)
        self.max_turns = int(self.extras.get("max_turns", 3))
        self.turns = 0
        self.tool_calls = 0  # calls read (well-formed), over the episode: the evaluation's tool-use rate

    def step(self, action_text: str):
        self.turns += 1
        parsed = parse_tool_calls(action_text, known_tools={"calc"})
        if not parsed.calls and not parsed.errors:
            solved = parsed.text.strip() == self.answer
            return [], float(solved), True, {"solved": solved}
        self.tool_calls += len(parsed.calls)
        replies = error_observation(parsed.errors)
        for call in parsed.calls:
            try:
                replies.append(tool_message(str(evaluate_expression(call.arguments.get("expr")))))
            except ValueError as e:
                replies.append(tool_message(f"error: {e}"))
        done = self.turns >= self.max_turns
        return ([] if done else replies), 0.0, done, {"solved": False, "tool_calls": len(parsed.calls)}
