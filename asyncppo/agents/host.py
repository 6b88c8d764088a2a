"""The agent host: the user's agent programs run in a child process of the rollout worker, not inside it.

Why a process of their own: an agent call costs its client side (the OpenAI client, pydantic, httpx, the agent's
own logic) a few milliseconds of Python, and the worker's thread that steps the engine is Python too. On one
interpreter the two share the GIL: measured on the 2-core box, 128 calculator agents on the worker's event loop
waited 1.6 s (p50) between the model's reply and their next call, and played 0.17 of the in-process environment's
episodes per second (``asyncppo bench agent-overhead``). In a child process they talk to the worker's endpoint
over loopback HTTP like any client, and a crash or a runaway agent cannot take the engine with it.

The child is ``python -m asyncppo.agents.host`` (a fresh interpreter: a fork would copy the engine and its threads,
and multiprocessing's spawn would re-run the worker's main module). Its pipes carry JSON lines only (nothing is
unpickled): the worker writes ``{"start": sid, "url", "key", "row"}`` and ``{"cancel": sid}`` to its stdin; the child
answers on a pipe of its own (the agent's prints go to the worker's log, not into the protocol) with ``{"sid",
"kind": "end", "value"}`` or ``{"sid", "kind": "error", "detail"}``. A reward that is not JSON is an ``error``. The
child exits when its stdin closes (the worker stopped or died); if it dies first, every open session gets an error
and the next episode starts a new child.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from asyncppo.envs.text_env import import_named

#: Connections one agent's client may open (its own pool: an agent is one conversation, one call at a time, but a
#: framework may send a few at once). One pool shared by every agent cost the child O(calls in flight) of Python per
#: request (httpx scans its pool), 17 ms a call with 480 episodes in flight: the child at 100% CPU and agents' first
#: calls late by seconds (measured on the guess game); a client per agent with a shared TLS context costs 0.14 ms to
#: make (37 ms with its own, which loads the CA certificates).
AGENT_CONNECTIONS = 8


def load_function(path: str, option: str) -> Callable:
    """The function named ``pkg.module:function`` (or ``pkg.module.function``); ValueError naming ``option``."""
    fn = import_named(path, option, "pkg.module:function")
    if not callable(fn):
        raise ValueError(f"{option}={path!r}: not callable (got {fn!r:.80})")
    return fn


class AgentHost:
    """The worker's side: starts the child, sends it episodes, hands their ends to ``on_result(sid, kind, value)``."""

    def __init__(self, agent_path: str, on_result: Callable[[str, str, Any], None], *, max_concurrency: int = 64,
                 client_timeout_s: float = 600.0):
        load_function(agent_path, "env.agent")  # a bad path is refused here, by name, before any episode
        self.agent_path, self.on_result = agent_path, on_result
        self.max_concurrency, self.client_timeout_s = max_concurrency, client_timeout_s
        self._lock = threading.Lock()
        self._proc: Optional[subprocess.Popen] = None
        self._ready = threading.Event()  # the current child has loaded the agent
        self._open: set[str] = set()
        self.restarts = 0
        self._closed = False

    def start(self, sid: str, url: str, key: str, row: dict) -> None:
        msg = {"start": sid, "url": url, "key": key, "row": row}
        with self._lock:
            if self._closed:
                raise RuntimeError("the agent host is closed")
            self._ensure_child()
            self._open.add(sid)
            self._send(msg)

    def warm(self, timeout_s: float = 120.0) -> None:
        """Start the child now and wait until it has imported the OpenAI client and the agent's module (seconds:
        paid once, when the worker opens, not by the first episodes' deadlines). RuntimeError when it cannot."""
        with self._lock:
            if self._closed:
                return
            self._ensure_child()
            proc, ready = self._proc, self._ready
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.1):
            if proc.poll() is not None:
                raise RuntimeError(f"env.agent={self.agent_path!r}: the agent process exited (code {proc.returncode}) "
                                   "before it was ready; its error is in the worker's log")
            if time.monotonic() > deadline:
                raise RuntimeError(f"env.agent={self.agent_path!r}: the agent process was not ready after "
                                   f"{timeout_s:g} s")

    def cancel(self, sid: str) -> None:
        with self._lock:
            if sid in self._open and self._proc is not None:
                self._open.discard(sid)
                self._send({"cancel": sid})

    def close(self) -> None:
        with self._lock:
            self._closed = True
            proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            proc.stdin.close()  # the child's signal to stop
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)

    # --------------------------------------------------------------------------------------------------------
    def _send(self, msg: dict) -> None:
        """One command line to the child (the lock is held). A dead child's pipe fails quietly: its reader reports
        the sessions it held."""
        try:
            self._proc.stdin.write(json.dumps(msg, default=str).encode() + b"\n")
            self._proc.stdin.flush()
        except (OSError, ValueError):
            pass

    def _ensure_child(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        if self._proc is not None:
            self.restarts += 1
        read_fd, write_fd = os.pipe()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the worker's imports
        proc = subprocess.Popen(
            [sys.executable, "-m", "asyncppo.agents.host", "--agent", self.agent_path, "--results-fd", str(write_fd),
             "--max-concurrency", str(self.max_concurrency), "--timeout-s", str(self.client_timeout_s)],
            stdin=subprocess.PIPE, pass_fds=(write_fd,), env=env)
        os.close(write_fd)
        self._proc, self._ready = proc, threading.Event()
        threading.Thread(target=self._read, args=(os.fdopen(read_fd, "rb"), proc), name="agent-host-reader",
                         daemon=True).start()

    def _read(self, results, proc) -> None:
        ready = self._ready
        for line in results:
            try:
                msg = json.loads(line)
                sid, kind = str(msg["sid"]), str(msg["kind"])
            except (ValueError, KeyError, TypeError):  # our own child's message: a bug, skipped, never a crash
                continue
            if kind == "ready":
                ready.set()
                continue
            with self._lock:
                known = sid in self._open
                self._open.discard(sid)
            if known:
                self.on_result(sid, kind, msg.get("value") if kind == "end" else str(msg.get("detail", "")))
        results.close()
        with self._lock:  # the child is gone: every episode it held ends as an error
            if self._proc is not proc:
                return
            lost, self._open = set(self._open), set()
        code = proc.wait()
        for sid in lost:
            self.on_result(sid, "error", f"the agent process exited (code {code})")


# ------------------------------------------------------------------------------------------------ the child
def _child_main(argv=None) -> None:
    p = argparse.ArgumentParser(description="the agent host's child process (started by a rollout worker)")
    p.add_argument("--agent", required=True)
    p.add_argument("--results-fd", type=int, required=True)
    p.add_argument("--max-concurrency", type=int, default=64)
    p.add_argument("--timeout-s", type=float, default=600.0)
    args = p.parse_args(argv)
    agent = load_function(args.agent, "env.agent")
    with os.fdopen(args.results_fd, "wb") as results:
        asyncio.run(_serve(sys.stdin.buffer, results, agent, args.max_concurrency, args.timeout_s))


async def _serve(commands, results, agent: Callable, max_concurrency: int, client_timeout_s: float) -> None:
    import concurrent.futures as cf

    import httpx
    import openai

    import ssl

    loop = asyncio.get_running_loop()
    limits = httpx.Limits(max_connections=AGENT_CONNECTIONS, max_keepalive_connections=AGENT_CONNECTIONS)
    tls = ssl.create_default_context()  # made once: every client's (unused on plain http) TLS settings
    threads = cf.ThreadPoolExecutor(max_concurrency, thread_name_prefix="agent")
    tasks: dict[str, asyncio.Task] = {}
    send_lock = threading.Lock()
    stopped = asyncio.Event()

    def send(msg: dict) -> None:
        try:
            data = json.dumps(msg).encode()
        except (TypeError, ValueError) as e:
            data = json.dumps({"sid": msg["sid"], "kind": "error",
                               "detail": f"the agent's return value is not JSON ({e})"}).encode()
        with send_lock:
            try:
                results.write(data + b"\n")
                results.flush()
            except (OSError, ValueError):  # the worker is gone
                pass

    async def run(sid: str, url: str, key: str, row: dict) -> None:
        try:
            if inspect.iscoroutinefunction(agent):
                async with httpx.AsyncClient(limits=limits, timeout=client_timeout_s, verify=tls) as http:
                    client = openai.AsyncOpenAI(base_url=url, api_key=key, max_retries=0, timeout=client_timeout_s,
                                                http_client=http)
                    value = await agent(client, row)
            else:
                value = await loop.run_in_executor(threads, run_blocking, url, key, row)
        except asyncio.CancelledError:
            return
        except BaseException as e:  # the user's code: whatever it raises is its episode's fault, named
            send({"sid": sid, "kind": "error", "detail": f"{type(e).__name__}: {e}"})
            return
        finally:
            tasks.pop(sid, None)
        send({"sid": sid, "kind": "end", "value": value})

    def run_blocking(url: str, key: str, row: dict):
        with httpx.Client(limits=limits, timeout=client_timeout_s, verify=tls) as http:
            client = openai.OpenAI(base_url=url, api_key=key, max_retries=0, timeout=client_timeout_s,
                                   http_client=http)
            return agent(client, row)

    def handle(line: bytes) -> None:
        try:
            msg = json.loads(line)
        except ValueError:
            return
        if "start" in msg:
            sid = str(msg["start"])
            tasks[sid] = loop.create_task(run(sid, msg["url"], msg["key"], msg["row"]))
        elif "cancel" in msg and str(msg["cancel"]) in tasks:
            tasks[str(msg["cancel"])].cancel()

    def reader() -> None:
        for line in commands:
            loop.call_soon_threadsafe(handle, line)
        loop.call_soon_threadsafe(stopped.set)  # stdin closed: the worker stopped or died

    threading.Thread(target=reader, name="agent-host-commands", daemon=True).start()
    send({"sid": "", "kind": "ready"})
    await stopped.wait()
    for task in list(tasks.values()):
        task.cancel()
    threads.shutdown(wait=False, cancel_futures=True)


if __name__ == "__main__":
    _child_main()
