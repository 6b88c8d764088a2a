"""An agent program as a text environment: its calls are the model turns, what it adds between them is the
environment's turn.

Why an adapter and not a second episode loop: :class:`asyncppo.envs.episodes.EpisodeEngine` already keeps the
sampled ids, renders only new messages, stamps versions, bounds turns and tokens, and the runner
(:mod:`asyncppo.envs.env_runner`) already puts a deadline on every wait and turns faults into outcomes per
``env.on_error``. Seen from there, an agent is an environment whose

* ``init`` waits for the agent's first call and answers with its messages (the prompt, rendered once with the
  call's ``tools``);
* model turn is handed to the waiting call as soon as it ends (:meth:`AgentEpisode.on_model_turn`, on the worker's
  thread: the reply never waits for an environment-call thread);
* ``step`` waits for what the agent does next: another call (its new messages are the observation), its return
  (the reward; the episode ends) or its exception (a fault);
* ``close`` ends the session (a call still waiting gets 410) and cancels the agent's run.

An agent that never calls, hangs between calls or raises costs its episode what any environment fault costs
(``env.step_timeout_s``, ``env.on_error``); the others go on.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from asyncppo.agents.openai_format import Reply, completion_body, make_reply, text_completion_body
from asyncppo.agents.server import AgentServer
from asyncppo.envs.text_env import MalformedStep, check_reward


class AgentError(RuntimeError):
    """The agent program failed; the message names how."""


def agent_reward(value: Any, transcript: Callable[[], list], row: dict,
                 reward_fn: Optional[Callable]) -> tuple[float, dict]:
    """``(reward, info)`` from what the agent returned: a number, or a dict with ``reward`` (its other keys are
    kept as the episode's info); ``None`` asks ``env.reward_fn(transcript, row)``. A bool counts as 0/1."""
    info: dict = {}
    if isinstance(value, dict):
        info = {k: v for k, v in value.items() if k != "reward"}
        value = value.get("reward")
    if value is None and reward_fn is not None:
        value = reward_fn(transcript(), row)
    if value is None:
        raise MalformedStep("malformed", "the agent returned no reward (a number, or a dict with 'reward') and "
                                         "env.reward_fn is not set")
    if isinstance(value, bool):
        value = float(value)
    return check_reward(value, "the agent's reward"), info


class AgentEpisode:
    """One episode of an agent program through ``server`` (module docstring). ``row``: the dataset row as the agent
    sees it; ``wait_s``: how long a blocked wait lasts before it gives its thread back (the runner's deadline,
    ``env.step_timeout_s``, has already ended the episode by then)."""

    def __init__(self, server: AgentServer, row: dict, *, wait_s: float, tokenizer: Any,
                 reward_fn: Optional[Callable] = None):
        self.server, self.row, self.wait_s, self.tokenizer = server, row, wait_s, tokenizer
        self.reward_fn = reward_fn
        self.session = None
        self.tools: Optional[list] = None
        self._call = None

    # ---------------------------------------------------------------------------------------- the env protocol
    def init(self, prompt_messages: list):
        self.session = self.server.open_session(self.row)
        kind, payload = self.session.next_event(self.wait_s)
        if kind == "call":
            self._call = payload
            self.tools = payload.request.tools
            if payload.raw is not None:  # /v1/completions: the prompt is the call's own text (or ids), no template
                return [], {"prompt_ids": self._ids(payload.raw, first=True)}
            return _template_messages(payload.new_messages), {}
        raise self._failure(kind, payload, "before its first model call")

    def step(self, action_text: str):
        kind, payload = self.session.next_event(self.wait_s)
        if kind == "call" and payload.raw is not None:  # /v1/completions: what the prompt adds, as it tokenizes
            self._call = payload
            return [], 0.0, False, {"env_ids": self._ids(payload.raw)}
        if kind == "call":  # a branch: the rewritten conversation after the first messages (envs/episodes.py)
            self._call = payload
            info = {"branch": self.server.branches} if payload.branch else {}  # final | all: drop or keep the old
            return _template_messages(payload.new_messages), 0.0, False, info
        if kind == "end":
            reward, info = agent_reward(payload, lambda: self.session.transcript(self.tokenizer.decode), self.row,
                                        self.reward_fn)
            return [], reward, True, info
        if kind == "closed":  # the episode already ended (its outcome is not read): nothing to count
            return [], 0.0, True, {"closed": payload}
        raise self._failure(kind, payload, "")

    def close(self) -> None:
        if self.session is not None:
            self.server.end_session(self.session, "closed")

    # ---------------------------------------------------------------------------------------- the engine's hooks
    def next_turn(self) -> tuple[Optional[int], tuple]:
        """The pending call's own limits on the turn about to start: ``max_tokens`` and its stop token ids."""
        request = self._call.request if self._call is not None else None
        return (None, ()) if request is None else (request.max_tokens, tuple(request.stop))

    def on_model_turn(self, *, token_ids: list, logprobs: list, versions: list, finish_reason: str, text: str,
                      prompt_tokens: int) -> None:
        """The model's turn for the pending call: the reply goes out now (worker thread, never blocks)."""
        call, self._call = self._call, None
        if call is None or self.session is None:
            return
        request = call.request
        texts = [self.tokenizer.decode([t]) for t in token_ids] if request.logprobs else None
        if call.raw is not None:
            call_id = f"cmpl-{self.session.sid[:12]}-{call.number}"
            held = self.session.held
            body = text_completion_body(text, finish_reason, call_id=call_id, model=self.server.model_name,
                                        created=int(time.time()), prompt_tokens=prompt_tokens, token_ids=token_ids,
                                        logprobs=logprobs if request.logprobs else None, token_texts=texts,
                                        versions=versions, text_offset=len(held) if isinstance(held, str) else 0)
            self.session.reply(Reply(text, [], finish_reason), body)
            return
        call_id = f"chatcmpl-{self.session.sid[:12]}-{call.number}"
        reply = make_reply(text, finish_reason, request, call_id)
        body = completion_body(reply, call_id=call_id, model=self.server.model_name, created=int(time.time()),
                               prompt_tokens=prompt_tokens, token_ids=token_ids,
                               logprobs=logprobs if request.logprobs else None, token_texts=texts,
                               versions=versions)
        self.session.reply(reply, body)

    def _ids(self, raw: dict, first: bool = False) -> list:
        """A text call's addition as token ids: as sent, or its text tokenized alone (never with what came before:
        the past stays the ids it was). The first prompt gets the tokenizer's special tokens (a BOS where the model
        has one), as vLLM's own ``/v1/completions`` tokenizes a prompt; additions get none."""
        return list(raw["ids"]) if "ids" in raw else self.tokenizer.encode(raw["text"], add_special_tokens=first)

    # ---------------------------------------------------------------------------------------------------------
    def _failure(self, kind: str, payload: Any, when: str) -> Exception:
        if kind == "end":
            return AgentError(f"the agent returned {when} (an episode is at least one model call)")
        if kind == "closed":
            return AgentError(f"the session closed {when} ({payload})")
        return AgentError(f"the agent failed{' ' + when if when else ''}: {payload}")


def _template_messages(messages: list) -> list:
    """What the chat template renders of a message: its role and text, and an assistant message's calls."""
    return [{"role": m["role"], "content": m["content"], **({"tool_calls": m["tool_calls"]} if m.get("tool_calls")
                                                             else {})} for m in messages]
