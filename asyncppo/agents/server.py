"""The HTTP side of one rollout worker: an aiohttp server on its own event loop, the sessions, the agents' runs.

Why aiohttp on a thread of its own: the worker's loop steps the engine and must never wait on a socket, and a
hand-written HTTP parser would be one more thing to get wrong at the edge where hostile input arrives. The server
is an entry like a ZeroMQ socket (docs/security.md): bodies are bounded (``env.agent_max_body_bytes``, 413 past
it), every route but the health of the process needs the run's bearer key (401), session ids are 128-bit random
(404 unknown, 410 ended), and every refusal is counted by status and kind (:attr:`AgentServer.refusals`).

Routes (``{base}`` = ``/sessions/<id>/v1``, what the agent's client is given as ``base_url``):

* ``POST {base}/chat/completions``: one model turn of the episode (:mod:`asyncppo.agents.session`), as one JSON
  body or, with ``stream=true``, as server-sent events;
* ``POST {base}/completions``: one model turn of an episode played as text (a prompt string, or token ids, that
  extends the episode so far; no chat template);
* ``GET {base}/models`` and ``GET /v1/models``: the one model this endpoint serves;
* ``POST /v1/chat/completions``, ``POST /v1/completions``: 404 naming the session URL (a call outside an episode has
  nowhere to train).

The agent programs run in a child process (:mod:`asyncppo.agents.host`) and call this server over loopback like
any client; each run's end or error comes back to its session's events.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import secrets
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Optional

from asyncppo.agents.host import AgentHost
from asyncppo.agents.openai_format import (RequestError, error_body, parse_chat_request, parse_completion_request,
                                           stream_chunks)
from asyncppo.agents.session import Session

#: Pending connections the listener queues: every episode's client may connect at once when a group starts (a full
#: queue drops the SYN, and the client's kernel retries a second later)
BACKLOG = 4096
#: Ended sessions remembered (so that a late call gets 410, not 404), at most this many.
CLOSED_KEPT = 4096


class AgentServer:
    """One worker's endpoint (module docstring). :meth:`start` binds; :meth:`open_session` starts an agent run.
    ``agent``: the ``pkg.module:function`` path of the agent program (imported in the child process)."""

    def __init__(self, agent: str, *, host: str = "127.0.0.1", port: int = 0, key: Optional[str] = None,
                 max_body_bytes: int = 4 << 20, model_name: str = "policy", max_concurrency: int = 16,
                 stop_token_id: Callable[[str], Optional[int]] = lambda s: None, client_timeout_s: float = 600.0,
                 branches: str = "final", vocab_size: int = 1 << 31):
        self.host, self.port, self.branches = host, port, branches
        self.agents = AgentHost(agent, self._agent_done, max_concurrency=max_concurrency,
                                client_timeout_s=client_timeout_s)
        self.key = key or secrets.token_urlsafe(24)
        self.max_body_bytes, self.model_name = max_body_bytes, model_name
        self.stop_token_id, self.vocab_size = stop_token_id, vocab_size
        self.sessions: dict[str, Session] = {}
        self._closed: OrderedDict[str, str] = OrderedDict()
        self.refusals: Counter = Counter()
        self.calls = 0
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="agent-http", daemon=True)
        self._runner = None

    # ------------------------------------------------------------------------------------------------ lifecycle
    def start(self) -> "AgentServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._serve(), self.loop).result(timeout=30)
        self.agents.warm()  # the child imports the agent now, not on the first episode
        return self

    async def _serve(self) -> None:
        from aiohttp import web  # heavy: aiohttp

        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/sessions/{sid}/v1/chat/completions", self._chat)
        app.router.add_get("/sessions/{sid}/v1/models", self._models)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/sessions/{sid}/v1/completions", self._text)
        app.router.add_post("/v1/chat/completions", self._no_session)
        app.router.add_post("/v1/completions", self._no_session)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, backlog=BACKLOG)
        await site.start()
        self.port = self._runner.addresses[0][1]

    def close(self) -> None:
        for s in list(self.sessions.values()):
            s.close("the worker stopped")
        self.agents.close()
        if self._runner is not None and self._thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(timeout=10)
            except Exception:  # a stop must not fail on a server that is already half gone
                pass
        self.loop.call_soon_threadsafe(self.loop.stop)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def base_url(self, session: Session) -> str:
        return f"{self.url}/sessions/{session.sid}/v1"

    # ------------------------------------------------------------------------------------------------ sessions
    def open_session(self, row: dict) -> Session:
        """A new session and the agent's run on it (started at once; its calls wait for the episode)."""
        session = Session(secrets.token_hex(16), self.loop, self.branches)
        self.sessions[session.sid] = session
        session.cancel = lambda sid=session.sid: self.agents.cancel(sid)
        self.agents.start(session.sid, self.base_url(session), self.key, row)
        return session

    def end_session(self, session: Session, why: str) -> None:
        session.close(why)
        if self.sessions.pop(session.sid, None) is not None:
            self._closed[session.sid] = why
            while len(self._closed) > CLOSED_KEPT:
                self._closed.popitem(last=False)

    def _agent_done(self, sid: str, kind: str, value: Any) -> None:
        """The agent host's report of a run's end (``end`` with its value, ``error`` with its detail)."""
        session = self.sessions.get(sid)
        if session is not None:
            session.events.put((kind, value))

    # ------------------------------------------------------------------------------------------------ routes
    def _refuse(self, err: RequestError):
        from aiohttp import web  # heavy: aiohttp

        self.refusals[f"{err.status}_{err.kind}"] += 1
        return web.json_response(error_body(err), status=err.status)

    def _authorized(self, request) -> bool:
        sent = request.headers.get("Authorization", "")
        return hmac.compare_digest(sent.encode(), f"Bearer {self.key}".encode())

    async def _models(self, request):
        from aiohttp import web  # heavy: aiohttp

        if not self._authorized(request):
            return self._refuse(RequestError(401, "a bearer key is required (the run's key)", "unauthorized"))
        return web.json_response({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                              "created": 0, "owned_by": "asyncppo"}]})

    async def _no_session(self, request):
        return self._refuse(RequestError(404, "no session in the URL: an agent's client is given its episode's "
                                              "base URL, /sessions/<id>/v1", "no_session"))

    async def _body(self, request) -> Any:
        from aiohttp import web  # heavy: aiohttp

        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise RequestError(413, f"the body is larger than env.agent_max_body_bytes={self.max_body_bytes}",
                               "too_large") from None
        try:
            return json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise RequestError(400, f"the body is not JSON ({type(e).__name__})", "malformed_json") from None

    async def _chat(self, request):
        return await self._turn(request, lambda body: parse_chat_request(body, stop_token_id=self.stop_token_id))

    async def _text(self, request):
        return await self._turn(request, lambda body: parse_completion_request(
            body, stop_token_id=self.stop_token_id, vocab_size=self.vocab_size))

    async def _turn(self, request, parse):
        """One model turn of a session: checked (``parse``), admitted, answered when the engine has written it."""
        from aiohttp import web  # heavy: aiohttp

        try:
            if not self._authorized(request):
                raise RequestError(401, "a bearer key is required (the run's key)", "unauthorized")
            sid = request.match_info["sid"]
            session = self.sessions.get(sid)
            if session is None:
                if sid in self._closed:
                    raise RequestError(410, f"session closed: the episode ended ({self._closed[sid]})",
                                       "session_closed")
                raise RequestError(404, "unknown session", "unknown_session")
            body = await self._body(request)
            chat = parse(body)
            future = self.loop.create_future()
            session.accept(chat, future)
            answer = await future  # the model's turn, or a RequestError when the episode ended first
        except RequestError as err:
            return self._refuse(err)
        self.calls += 1
        if chat.stream:
            return await self._stream(request, answer, chat.stream_usage)
        return web.json_response(answer)

    async def _stream(self, request, answer: dict, include_usage: bool):
        """``stream=true``: the turn as server-sent events (openai_format.stream_chunks), then ``[DONE]``."""
        from aiohttp import web  # heavy: aiohttp

        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        for chunk in stream_chunks(answer, include_usage):
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
