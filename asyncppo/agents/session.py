"""One episode's session: the conversation the agent built, checked call by call against what the model said.

Why a session per episode: the trainer must know which call continues which conversation, and the agent's own
record of the past is text, which is not what was sampled. The session keeps the conversation as it stands
(messages the agent sent, replies the model gave) and admits a call only when its ``messages`` *extend* it: the
earlier messages unchanged, the model's last reply where it was (recognised by its tool-call ids, or its text), then
only new non-assistant messages (tool results, user turns). Those new messages are all the episode renders
(:func:`asyncppo.envs.chat.turn_ids`); the past assistant turns stay the sampled ids.

A call that rewrites the past (an agent that truncates or summarises its context, edits or inserts an assistant
message) starts a new *branch* under ``env.agent_branches=final`` (the default): the episode's record keeps the first
call's messages as its prompt, the rewritten conversation after them becomes masked environment text, and the model's
turns from there on are what trains; the earlier branch's turns are dropped (counted). The rewrite must keep those
first messages and go on with an assistant message (the prompt ends in the assistant header), and may not change the
tools (part of the prompt). Under ``env.agent_branches=refuse`` every rewrite is refused with 409 (docs/agents.md,
"Branches").

Threads: :meth:`Session.accept` runs on the server's event loop, :meth:`Session.reply` on the rollout worker's
thread, :meth:`Session.next_event` on an environment-call thread; a lock orders them.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

from asyncppo.agents.openai_format import ChatRequest, Reply, RequestError, TextRequest, template_tool_calls
from asyncppo.config.validate_text_env import AGENT_BRANCHES  # what env.agent_branches may be


@dataclass
class Call:
    """A call admitted to the episode: the request, the messages it adds, and the reply's future (on the loop)."""

    request: ChatRequest
    new_messages: list  # a branch: the whole rewritten conversation after the episode's first messages
    future: asyncio.Future
    number: int
    branch: bool = False  # the call rewrote the past: the episode's response restarts after its prompt
    raw: Optional[dict] = None  # /v1/completions: {"text": str} or {"ids": list}, what the call adds to the episode


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

    def __init__(self, sid: str, loop: asyncio.AbstractEventLoop, branches: str = "final"):
        if branches not in AGENT_BRANCHES:
            raise ValueError(f"env.agent_branches={branches!r}: allowed: {', '.join(AGENT_BRANCHES)}")
        self.sid, self.loop, self.branch_policy = sid, loop, branches
        self.events: queue.Queue = queue.Queue()
        self.first: Optional[list] = None  # the first call's messages: the episode's prompt, kept by every branch
        self.branches = 0  # rewrites accepted, each the start of a new branch
        self.conversation: Optional[list] = None  # normalized messages so far, replies included
        self.tools: Optional[list] = None
        self.pending: Optional[Call] = None  # the call whose reply the model is writing
        self.closed: Optional[str] = None  # why the session ended (None: open)
        self.calls = 0
        self.replied: list = []  # the token ids of each reply, in order (what the episode trains as model turns)
        self.cancel: Optional[Callable[[], None]] = None  # stops the agent's run (the agent host's cancel)
        self.api: Optional[str] = None  # "chat" or "text" (/v1/completions): the first call's; never mixed
        self.held: Any = None  # text calls: the episode so far as the agent sees it, a str or a list of token ids
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
            api = "text" if isinstance(request, TextRequest) else "chat"
            if self.api not in (None, api):
                raise RequestError(409, f"this session's calls are {self.api} completions: an episode is one "
                                        "conversation through one API", "mixed_api")
            self.api = api
            if api == "text":
                raw = self._text_extension(request)
                self.calls += 1
                self.pending = Call(request, [], future, self.calls, raw=raw)
                self.events.put(("call", self.pending))
                return self.pending
            new, branch = self._extension(request)
            if self.first is None:
                self.first = list(request.messages)
            if branch:  # the model turns that train are the new branch's
                self.branches += 1
                self.replied = []
            self.conversation = list(request.messages)
            self.tools = request.tools
            self.calls += 1
            self.pending = Call(request, new, future, self.calls, branch)
        self.events.put(("call", self.pending))
        return self.pending

    def _extension(self, request: ChatRequest) -> tuple[list, bool]:
        """``(messages to render, branch)``: the new messages of a call that extends the conversation, or the
        rewritten conversation after the first messages of one that starts a branch; 409 when it may do neither."""
        if self.conversation is None:
            return list(request.messages), False
        held, sent = self.conversation, request.messages
        if request.tools != self.tools:
            raise RequestError(409, "the call's tools differ from the session's first call (the tools are part of "
                                    "the rendered prompt, which is never re-rendered)", "history_rewritten")
        if len(sent) >= len(held) and all(_same(a, b) for a, b in zip(sent, held)):
            new = sent[len(held):]
            if not any(m["role"] == "assistant" for m in new):
                return new, False
            why = "a new assistant message that the model did not write: the session's assistant turns are the " \
                  "model's own replies"
        else:
            first = next((i for i, (a, b) in enumerate(zip(sent, held)) if not _same(a, b)), min(len(sent),
                                                                                                 len(held)))
            why = f"the messages do not extend the session's conversation (message {first} differs or is missing; " \
                  f"{len(held)} held)"
        if self.branch_policy == "refuse":
            raise RequestError(409, f"{why}: a session trains one conversation, whose past turns are the sampled "
                                    "tokens (env.agent_branches=refuse)", "history_rewritten")
        keep = len(self.first)
        if len(sent) < keep or not all(_same(a, b) for a, b in zip(sent, self.first)):
            raise RequestError(409, f"{why}, and a new branch must keep the episode's first {keep} message(s) "
                                    "unchanged: they are the prompt of its trained record", "history_rewritten")
        rest = sent[keep:]
        if rest and rest[0]["role"] != "assistant":
            raise RequestError(409, f"{why}, and a new branch must go on after the episode's first {keep} "
                                    f"message(s) with an assistant message (got {rest[0]['role']!r}): the record's "
                                    "prompt ends in the assistant header", "history_rewritten")
        return rest, True

    def _text_extension(self, request: TextRequest) -> dict:
        """What a ``/v1/completions`` call adds: the first call's whole prompt, then what a prompt adds after the
        episode so far (the earlier prompts and the model's completions, exactly as returned); 409 when it does not
        extend it. A session keeps to the prompt form of its first call (text, or token ids)."""
        prompt = request.prompt_ids if request.prompt_ids is not None else request.prompt_text
        kind = "ids" if request.prompt_ids is not None else "text"
        if self.held is None:
            self.held = prompt
            return {kind: prompt}
        held_kind = "ids" if isinstance(self.held, list) else "text"
        if kind != held_kind:
            raise RequestError(409, f"this session's prompts are {held_kind}: a session keeps to its first call's "
                                    "prompt form", "history_rewritten")
        if len(prompt) < len(self.held) or prompt[:len(self.held)] != self.held:
            unit = "token ids" if kind == "ids" else "characters"
            raise RequestError(409, f"the prompt does not extend the episode so far (its first {len(self.held)} "
                                    f"{unit}: the earlier prompt and the completions as returned): a session trains "
                                    "one text, whose past completions are the sampled tokens", "history_rewritten")
        rest, self.held = prompt[len(self.held):], prompt
        return {kind: rest}

    # ------------------------------------------------------------------------------------------------ worker side
    def reply(self, reply: Reply, body: dict) -> None:
        """The model's turn for the pending call: kept in the conversation, then handed to the waiting request."""
        with self._lock:
            call, self.pending = self.pending, None
            if call is None or self.closed is not None:
                return
            if call.raw is not None:  # a text completion: the episode so far grows by what the agent was given
                ids = list(body.get("asyncppo", {}).get("token_ids", []))
                self.held = self.held + ids if isinstance(self.held, list) else self.held + reply.content
                self.replied.append(ids)
                self.loop.call_soon_threadsafe(_settle, call.future, body)
                return
            self.conversation.append({"role": "assistant", "content": reply.content or "",
                                      "tool_call_ids": reply.tool_call_ids,
                                      "tool_calls": template_tool_calls(reply.tool_calls)})
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

    def transcript(self, decode: Optional[Callable[[list], str]] = None) -> list:
        """The conversation as chat messages (what ``env.reward_fn`` scores); a text session's is one message, its
        whole text (an ids session's decoded with ``decode``)."""
        with self._lock:
            if self.api == "text":
                held = self.held if isinstance(self.held, str) else decode(self.held) if decode else ""
                return [{"role": "completion", "content": held}]
            return [{"role": m["role"], "content": m["content"]} for m in self.conversation or []]


def _settle(future: asyncio.Future, value: Any) -> None:
    if future.done():  # the client went away: nobody waits for this reply
        return
    if isinstance(value, BaseException):
        future.set_exception(value)
    else:
        future.set_result(value)
