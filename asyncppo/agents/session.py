"""One episode's session: the conversation the agent built, checked call by call against what the model said.

Why a session per episode: the trainer must know which call continues which conversation, and the agent's own
record of the past is text, which is not what was sampled. The session keeps the conversation as it stands
(messages the agent sent, replies the model gave) and admits a call only when its ``messages`` *extend* it: the
earlier messages unchanged, the model's last reply where it was (recognised by its tool-call ids, or its text), then
only new non-assistant messages (tool results, user turns). Those new messages are all the episode renders
(:func:`asyncppo.envs.chat.turn_ids`); the past assistant turns stay the sampled ids.

A call that rewrites the past (an agent that truncates or summarises its context, edits a reply, changes its tools)
is refused with 409 and counted: one session trains one conversation (docs/agents.md, "Limits").

Threads: :meth:`Session.accept` runs on the server's event loop, :meth:`Session.reply` on the rollout worker's
thread, :meth:`Session.next_event` on an environment-call thread; a lock orders them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from asyncppo.agents.openai_format import ChatRequest, Reply, RequestError


@dataclass
class Call:
    """A call admitted to the episode: the request, the messages it adds, and the reply's future (on the loop)."""

    request: ChatRequest
    new_messages: list
    future: asyncio.Future
    number: int


def _same(sent: dict, kept: dict) -> bool:
    """Whether a message the agent sent again is the one the conversation holds."""
    if sent["role"] != kept["role"]:
        return False
    if kept["role"] == "assistant" and kept.get("tool_call_ids"):
        return sent.get("tool_call_ids") == kept["tool_call_ids"]  # frameworks drop or reformat the text of a call
    return sent["content"].strip() == kept["content"].strip()


class Session:
    """The record of one episode's calls (module docstring). ``events`` yields ``("call", Call)``, ``("end",
    value)`` (the agent returned) or ``("error", detail)`` (it raised, or its process died)."""

    def __init__(self, sid: str, loop: asyncio.AbstractEventLoop):
        self.sid, self.loop = sid, loop
        self.events: queue.Queue = queue.Queue()
        self.conversation: Optional[list] = None  # normalized messages so far, replies included
        self.tools: Optional[list] = None
        self.pending: Optional[Call] = None  # the call whose reply the model is writing
        self.closed: Optional[str] = None  # why the session ended (None: open)
        self.calls = 0
        self.replied: list = []  # the token ids of each reply, in order (what the episode trains as model turns)
        self.cancel: Optional[Callable[[], None]] = None  # stops the agent's run (the agent host's cancel)
        self._lock = threading.Lock()

    # ------------------------------------------------------------------------------------------------ server side
    def accept(self, request: ChatRequest, future: asyncio.Future) -> Call:
        """Admit a call, or :class:`RequestError`: 410 (the episode ended), 409 (a call in flight, or messages that
        do not extend the conversation)."""
        with self._lock:
            if self.closed is not None:
                raise RequestError(410, f"session closed: the episode ended ({self.closed})", "session_closed")
            if self.pending is not None:
                raise RequestError(409, "a call on this session is already in flight: an episode is one "
                                        "conversation, one call at a time", "concurrent_call")
            new = self._extension(request)
            self.conversation = list(request.messages)
            self.tools = request.tools
            self.calls += 1
            self.pending = Call(request, new, future, self.calls)
        self.events.put(("call", self.pending))
        return self.pending

    def _extension(self, request: ChatRequest) -> list:
        if self.conversation is None:
            return list(request.messages)
        held, sent = self.conversation, request.messages
        if request.tools != self.tools:
            raise RequestError(409, "the call's tools differ from the session's first call (the tools are part of "
                                    "the rendered prompt, which is never re-rendered)", "history_rewritten")
        if len(sent) < len(held) or not all(_same(a, b) for a, b in zip(sent, held)):
            first = next((i for i, (a, b) in enumerate(zip(sent, held)) if not _same(a, b)), min(len(sent),
                                                                                                 len(held)))
            raise RequestError(409, f"the messages do not extend the session's conversation (message {first} differs "
                                    f"or is missing; {len(held)} held): a session trains one conversation, whose past "
                                    "turns are the sampled tokens", "history_rewritten")
        new = sent[len(held):]
        if any(m["role"] == "assistant" for m in new):
            raise RequestError(409, "a new assistant message that the model did not write: the session's assistant "
                                    "turns are the model's own replies", "history_rewritten")
        return new

    # ------------------------------------------------------------------------------------------------ worker side
    def reply(self, reply: Reply, body: dict) -> None:
        """The model's turn for the pending call: kept in the conversation, then handed to the waiting request."""
        with self._lock:
            call, self.pending = self.pending, None
            if call is None or self.closed is not None:
                return
            self.conversation.append({"role": "assistant", "content": reply.content or "",
                                      "tool_call_ids": reply.tool_call_ids})
            self.replied.append(list(body.get("asyncppo", {}).get("token_ids", [])))
        self.loop.call_soon_threadsafe(_settle, call.future, body)

    def close(self, why: str) -> None:
        """End the session: a call in flight is answered 410, later calls too, and the agent's run is cancelled."""
        with self._lock:
            if self.closed is not None:
                return
            self.closed, call, self.pending = why, self.pending, None
        if call is not None:
            self.loop.call_soon_threadsafe(
                _settle, call.future, RequestError(410, f"session closed: the episode ended ({why})",
                                                   "session_closed"))
        if self.cancel is not None:
            self.cancel()
        self.events.put(("closed", why))  # a thread waiting for the agent's next move wakes now

    def next_event(self, timeout_s: float) -> tuple:
        """The next call, the agent's return, or its error; TimeoutError after ``timeout_s``."""
        try:
            return self.events.get(timeout=timeout_s)
        except queue.Empty:
            raise TimeoutError(f"the agent neither called the model nor returned within {timeout_s:g} s") from None

    def transcript(self) -> list:
        """The conversation as chat messages (what ``env.reward_fn`` scores)."""
        with self._lock:
            return [{"role": m["role"], "content": m["content"]} for m in self.conversation or []]


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():  # the client went away: nobody waits for this reply
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
