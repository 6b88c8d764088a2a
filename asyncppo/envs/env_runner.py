"""Running environment calls off the engine's loop: a bounded pool, a deadline per call, and faults as outcomes.

Why: an environment call may be slow (a tool, a sandbox, a web request) or broken (it raises, hangs, returns
garbage). The rollout loop must keep decoding other sequences meanwhile and must never die of one episode. So
every ``init``/``step``/``close`` runs in a pool of ``env.max_concurrency`` threads (or, for an environment whose
methods are coroutines, on the caller's asyncio loop under a semaphore of the same size), waits at most
``env.step_timeout_s``, and comes back as an :class:`EnvOutcome` whatever happened. A fault is counted by kind
(:data:`FAULT_KINDS`) and handled per ``env.on_error``:

* ``zero_reward``: the episode ends here with reward 0 for the failing turn (its group still trains);
* ``drop``: the outcome says ``drop``; the caller discards the episode's group and its admission slot is
  regenerated.

A thread whose call passed its deadline cannot be killed (Python has no safe way); it keeps its pool slot until
the call returns, and :attr:`EnvRunner.stuck` says how many slots are held that way. The pool's threads are daemon
threads (the standard ``ThreadPoolExecutor`` joins its threads at interpreter exit, so one call hung forever would
keep the worker process from exiting). Calls queued behind them still
time out on their own deadline (counted from submission), so a hung environment costs throughput, never a stall
without a named cause.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import inspect
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from asyncppo.config.validate_text_env import ENV_ON_ERROR as ON_ERROR
from asyncppo.envs.text_env import MalformedStep, normalize_init, normalize_step

#: Fault kinds, counted in :attr:`EnvRunner.faults`.
FAULT_KINDS = ("raised", "timeout", "malformed", "nonfinite_reward")


@dataclass
class EnvOutcome:
    """One environment call's result. ``fault`` is None or one of :data:`FAULT_KINDS` (``detail`` says more);
    after a fault ``done`` is True and ``drop`` tells whether the episode is to be discarded."""

    observations: list = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    fault: Optional[str] = None
    detail: str = ""
    drop: bool = False
    seconds: float = 0.0


_THREAD_LOOP = threading.local()


def _run(fn: Callable, *args) -> Any:
    """Call ``fn`` in a pool thread; a coroutine it returns is run to completion on that thread's event loop.

    One loop per pool thread, kept for its life: ``asyncio.run`` built and closed a loop per call, which behind a
    200 ms tool (~100 calls a second) took ~4% of the worker's interpreter time on the engine's core (py-spy
    ``--gil``, docs/benchmarks.md)."""
    out = fn(*args)
    if not inspect.isawaitable(out):
        return out
    runner = getattr(_THREAD_LOOP, "runner", None)
    if runner is None:
        runner = _THREAD_LOOP.runner = asyncio.Runner()
    try:
        return runner.run(out)
    finally:  # what the call left running is cancelled, as asyncio.run's close would (none in the usual case)
        loop = runner.get_loop()
        left = asyncio.all_tasks(loop)  # the tasks not yet done
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))


class _DaemonPool:
    """Up to ``max_workers`` daemon threads taking calls from one queue; :meth:`submit` returns a standard Future.

    Threads start when calls need them (a call submitted while every started thread is busy starts one more, up to
    ``max_workers``), so a generous bound (``env.max_concurrency``'s auto value is the episodes a worker may hold)
    costs nothing until the environment is slow enough to use it."""

    def __init__(self, max_workers: int, name: str):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._max, self._name = max_workers, name
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._unfinished = 0  # calls submitted and not yet done (queued or running)

    def submit(self, fn: Callable, *args) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the environment runner was shut down")
            if self._unfinished + 1 > len(self._threads) and len(self._threads) < self._max:
                thread = threading.Thread(target=self._work, name=f"{self._name}-{len(self._threads)}", daemon=True)
                try:
                    thread.start()
                except RuntimeError:  # the process is out of threads: the started ones take the call in turn
                    if not self._threads:
                        raise
                else:
                    self._threads.append(thread)
            self._unfinished += 1
            self._queue.put((fut, fn, args))
        return fut

    @property
    def threads(self) -> int:
        """Threads started so far."""
        return len(self._threads)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                self._done()
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the waiter, which counts it
                result, error = None, e
            # counted done before the waiter wakes: a caller that submits again at once finds this thread free
            # instead of starting another
            self._done()
            if error is None:
                fut.set_result(result)
            else:
                fut.set_exception(error)

    def _done(self) -> None:
        with self._lock:
            self._unfinished -= 1

    def shutdown(self) -> None:
        """Cancel queued calls and let idle threads end; a thread inside a call ends when the call returns."""
        with self._lock:
            self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                item[0].cancel()
                self._done()
        with self._lock:
            started = len(self._threads)
        for _ in range(started):
            self._queue.put(None)


class EnvRunner:
    """Runs text-environment calls with a bound on concurrency and a deadline each (module docstring)."""

    def __init__(self, max_concurrency: int = 16, step_timeout_s: float = 30.0, on_error: str = "zero_reward"):
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"env.max_concurrency={max_concurrency!r}: must be an int >= 1")
        if not step_timeout_s > 0:
            raise ValueError(f"env.step_timeout_s={step_timeout_s!r}: must be > 0")
        if on_error not in ON_ERROR:
            raise ValueError(f"env.on_error={on_error!r}: allowed: {', '.join(ON_ERROR)}")
        self.max_concurrency, self.step_timeout_s, self.on_error = max_concurrency, float(step_timeout_s), on_error
        self._pool = _DaemonPool(max_concurrency, "text-env")
        self._sem: Optional[asyncio.Semaphore] = None
        self._lock = threading.Lock()
        self.faults = collections.Counter({k: 0 for k in FAULT_KINDS})
        self.calls = 0
        self.seconds = 0.0  # summed wall time of calls (env seconds per step = seconds / calls)
        self._stuck: set = set()

    @property
    def stuck(self) -> int:
        """Pool threads still inside a call that passed its deadline."""
        with self._lock:
            self._stuck = {f for f in self._stuck if not f.done()}
            return len(self._stuck)

    # ------------------------------------------------------------------------------------------- blocking

    def init(self, env: Any, prompt_messages: list) -> EnvOutcome:
        """``env.init`` off-loop; the outcome's ``observations`` are the starting messages."""
        return self._finish(env, "init", self._submit(env.init, list(prompt_messages)), time.monotonic())

    def step(self, env: Any, action_text: str) -> EnvOutcome:
        """``env.step`` off-loop, with the deadline."""
        return self._finish(env, "step", self._submit(env.step, action_text), time.monotonic())

    def close(self, env: Any) -> None:
        """``env.close`` if it has one; a failure is counted, never raised."""
        if callable(getattr(env, "close", None)):
            self._finish(env, "close", self._submit(env.close), time.monotonic())

    def _submit(self, fn: Callable, *args) -> cf.Future:
        return self._pool.submit(_run, fn, *args)

    def _finish(self, env: Any, what: str, fut: cf.Future, t0: float) -> EnvOutcome:
        try:
            value = fut.result(timeout=self.step_timeout_s)
        except cf.TimeoutError:
            if not fut.cancel():
                with self._lock:
                    self._stuck.add(fut)
            return self._fault(env, what, "timeout", f"no answer within env.step_timeout_s={self.step_timeout_s}",
                               t0)
        except Exception as e:  # the environment's own exception
            return self._fault(env, what, "raised", f"{type(e).__name__}: {e}", t0)
        return self._accept(env, what, value, t0)

    # ------------------------------------------------------------------------------------------- asyncio

    async def astep(self, env: Any, action_text: str) -> EnvOutcome:
        """:meth:`step` for an asyncio caller: a coroutine ``step`` is awaited on this loop (under a semaphore of
        ``max_concurrency``), a plain one runs in the pool; either way under the deadline."""
        return await self._acall(env, "step", env.step, action_text)

    async def ainit(self, env: Any, prompt_messages: list) -> EnvOutcome:
        return await self._acall(env, "init", env.init, list(prompt_messages))

    async def _acall(self, env: Any, what: str, fn: Callable, arg: Any) -> EnvOutcome:
        t0 = time.monotonic()
        try:
            if inspect.iscoroutinefunction(fn):
                if self._sem is None:
                    self._sem = asyncio.Semaphore(self.max_concurrency)
                async with self._sem:
                    value = await asyncio.wait_for(fn(arg), self.step_timeout_s)
            else:
                fut = self._submit(fn, arg)
                try:
                    value = await asyncio.wait_for(asyncio.wrap_future(fut), self.step_timeout_s)
                except asyncio.TimeoutError:
                    with self._lock:
                        self._stuck.add(fut)
                    raise
        except asyncio.TimeoutError:
            return self._fault(env, what, "timeout", f"no answer within env.step_timeout_s={self.step_timeout_s}",
                               t0)
        except Exception as e:
            return self._fault(env, what, "raised", f"{type(e).__name__}: {e}", t0)
        return self._accept(env, what, value, t0)

    # ------------------------------------------------------------------------------------------- shared

    def _accept(self, env: Any, what: str, value: Any, t0: float) -> EnvOutcome:
        try:
            if what == "init":
                messages, info = normalize_init(value)
                return self._count(EnvOutcome(messages, 0.0, False, info), t0)
            if what == "close":
                return self._count(EnvOutcome(done=True), t0)
            r = normalize_step(value)
        except MalformedStep as e:
            return self._fault(env, what, e.kind, str(e), t0)
        return self._count(EnvOutcome(r.observations, r.reward, r.done, r.info), t0)

    def _count(self, outcome: EnvOutcome, t0: float) -> EnvOutcome:
        outcome.seconds = time.monotonic() - t0
        with self._lock:
            self.calls += 1
            self.seconds += outcome.seconds
        return outcome

    def _fault(self, env: Any, what: str, kind: str, detail: str, t0: float) -> EnvOutcome:
        with self._lock:
            self.faults[kind] += 1
        text = f"{type(env).__name__}.{what}: {detail}"
        return self._count(EnvOutcome([], 0.0, True, {}, kind, text, self.on_error == "drop"), t0)

    def shutdown(self) -> None:
        """Stop taking calls; threads stuck in a hung call are left to finish on their own (never joined)."""
        self._pool.shutdown()

    def __enter__(self) -> "EnvRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
