"""Tool calls in the model's text: the Qwen/Hermes syntax ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Why a pure parser that never raises: the text is whatever the policy sampled, and early in training most of it is
not a valid call. A malformed or unknown call must become an *error observation* the model can learn from (and a
counter the user can watch), never an exception that ends the episode or the worker. :func:`parse_tool_calls`
returns the calls it could read and one error string per call it could not; :func:`error_observation` turns the
errors into the tool message the environment answers with.
"""

from __future__ import annotations

import collections
import json
import re
from dataclasses import dataclass, field
from typing import Collection, Optional

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: Longest error text quoted back to the model (a runaway generation must not become a runaway observation).
MAX_QUOTE = 120


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedAction:
    """The model's turn: its text outside the calls, the calls read, and an error per call that was not."""

    text: str
    calls: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    unknown: int = 0  # how many of the errors name a tool that does not exist


def _read_call(body: str, known: Optional[Collection[str]]) -> tuple[Optional[ToolCall], Optional[str], bool]:
    """``(call, error, unknown)`` of one ``<tool_call>`` body."""
    quoted = body.strip()[:MAX_QUOTE]
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as e:
        return None, f"malformed tool call (not JSON: {e.__class__.__name__}): {quoted}", False
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None, f"malformed tool call (needs a JSON object with a string 'name'): {quoted}", False
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some templates and models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None, f"malformed tool call (arguments are not JSON): {quoted}", False
    if not isinstance(args, dict):
        return None, f"malformed tool call ('arguments' must be an object): {quoted}", False
    if known is not None and obj["name"] not in known:
        return None, f"unknown tool {obj['name'][:MAX_QUOTE]!r}; available: {sorted(known)}", True
    return ToolCall(obj["name"], args), None, False


def parse_tool_calls(text: str, known_tools: Optional[Collection[str]] = None) -> ParsedAction:
    """Every ``<tool_call>...</tool_call>`` in ``text``; with ``known_tools``, calls of other names are errors.
    An opening tag without its closing tag (a generation cut short) is one error. Never raises."""
    parsed = ParsedAction(text="")
    outside, pos = [], 0
    for m in _CALL.finditer(text):
        outside.append(text[pos:m.start()])
        pos = m.end()
        call, error, unknown = _read_call(m.group(1), known_tools)
        if call is not None:
            parsed.calls.append(call)
        else:
            parsed.errors.append(error)
            parsed.unknown += unknown
    rest = text[pos:]
    if OPEN in rest:
        parsed.errors.append(f"malformed tool call (no closing {CLOSE}): {rest[rest.index(OPEN):][:MAX_QUOTE]}")
        rest = rest[:rest.index(OPEN)]
    outside.append(rest)
    parsed.text = "".join(outside).strip()
    return parsed


def declared_tool_names(tools) -> list:
    """The names of declared tools (JSON schemas, OpenAI's nested form or flat): an environment's ``tools`` or an
    agent's request's."""
    names = []
    for tool in tools or []:
        if isinstance(tool, dict):
            name = (tool.get("function") or {}).get("name") or tool.get("name")
            if name:
                names.append(str(name))
    return names


def tool_message(content: str) -> dict:
    """The chat message that carries a tool's result back to the model."""
    return {"role": "tool", "content": content}


def error_observation(errors: list) -> list:
    """The tool messages answering calls that could not be run: one per error, prefixed ``error:``."""
    return [tool_message(f"error: {e}") for e in errors]


class ToolCallCounter:
    """Tool-call counts of a worker (for metrics): calls read, malformed calls, calls of unknown tools."""

    def __init__(self) -> None:
        self.counts = collections.Counter({"calls": 0, "malformed": 0, "unknown": 0})

    def add(self, parsed: ParsedAction) -> None:
        self.counts["calls"] += len(parsed.calls)
        self.counts["unknown"] += parsed.unknown
        self.counts["malformed"] += len(parsed.errors) - parsed.unknown
