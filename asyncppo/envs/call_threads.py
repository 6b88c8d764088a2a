"""Where environment calls run, and who fires their deadlines: three small pieces of thread machinery for
:class:`asyncppo.envs.env_runner.EnvRunner`.

* :class:`DaemonPool`: daemon threads for *blocking* calls (a ``def step`` that computes or waits on I/O).
* :class:`LoopThread`: one asyncio event loop on its own thread for *coroutine* calls (an ``async def step``), all
  of them side by side.
* :class:`Deadlines`: one thread that fires each call's deadline.

Why one loop for every coroutine call rather than a thread per call: behind a tool that answers in 200 ms a worker
holds ~100 calls at once. A thread per call (with a waiter thread beside it for the deadline) made ~200 threads
that woke, ran a small event loop each and handed results across, all on the interpreter lock the engine's own
Python needs between decode steps. One loop waits on all of them with one selector and wakes once per answer.

Why the deadlines are not the loop's own timers: a coroutine that blocks (``time.sleep`` where it should
``await``) stops the whole loop, and with it every timer on it. The deadline thread still fires, the calls on the
blocked loop come back as timeouts, and :class:`LoopThread` reports itself blocked (its heartbeat stops), so the
runner starts a fresh loop for new calls. A blocked loop costs the calls that were on it, never a stall.
"""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import heapq
import itertools
import logging
import math
import queue
import threading
import time
from typing import Any, Callable, Coroutine

log = logging.getLogger("asyncppo.envs")


class DaemonPool:
    """Up to ``max_workers`` daemon threads taking calls from one queue; :meth:`submit` returns a standard Future.

    Threads start when calls need them (a call submitted while every started thread is busy starts one more, up to
    ``max_workers``), so a generous bound (``env.max_concurrency``'s auto value is the episodes a worker may hold)
    costs nothing until the environment is slow enough to use it. Daemon threads: the standard
    ``ThreadPoolExecutor`` joins its threads at interpreter exit, so one call hung forever would keep the worker
    process from exiting."""

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
            except BaseException as e:  # handed to the future's owner, which counts it
                result, error = None, e
            # counted done before the owner hears: a caller that submits again at once finds this thread free
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


class LoopThread:
    """One asyncio event loop running forever on a daemon thread; :meth:`submit` schedules a coroutine on it
    (at most ``max_concurrency`` running at once, the rest wait their turn) and returns a standard Future.

    A heartbeat callback runs every ``HEARTBEAT_S``: :meth:`blocked_for` says how long the loop has not run it, i.e.
    how long one callback (a coroutine that blocks) has held the loop."""

    HEARTBEAT_S = 0.1

    def __init__(self, max_concurrency: int, name: str):
        self.loop = asyncio.new_event_loop()
        self._max = max_concurrency
        self._sem: asyncio.Semaphore | None = None  # made on the loop's thread, at its first call
        self._beat = time.monotonic()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        try:
            self._thread.start()
        except Exception:  # out of threads: the loop's descriptors are not left open
            self.loop.close()
            raise

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._heartbeat)
        try:
            self.loop.run_forever()
        finally:  # stopped: what is still running there is cancelled, as asyncio.run's close would
            tasks = asyncio.all_tasks(self.loop)
            for task in tasks:
                task.cancel()
            if tasks:
                self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self.loop.close()

    def _heartbeat(self) -> None:
        self._beat = time.monotonic()
        self.loop.call_later(self.HEARTBEAT_S, self._heartbeat)

    def alive(self) -> bool:
        """The loop's thread has not ended (a stopped loop ends once the call blocking it, if any, returns)."""
        return self._thread.is_alive()

    def blocked_for(self) -> float:
        """Seconds since the loop last ran its heartbeat, beyond the heartbeat's own period (0 when it is free)."""
        return max(0.0, time.monotonic() - self._beat - self.HEARTBEAT_S)

    def submit(self, make: Callable[[], Coroutine]) -> cf.Future:
        """Run ``make()`` (a coroutine) on the loop under the concurrency bound."""
        return asyncio.run_coroutine_threadsafe(self._bounded(make), self.loop)

    async def _bounded(self, make: Callable[[], Coroutine]) -> Any:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self._max)
        async with self._sem:
            return await make()

    def stop(self, wait_s: float = 0.0, drain_s: float = 0.0) -> None:
        """Stop the loop and cancel what still runs there: after the calls on it have had up to ``drain_s`` to
        finish, once it runs again (a coroutine may be blocking it). Waits up to ``wait_s`` for its thread to end.
        Never blocks longer than ``wait_s``."""
        try:
            if drain_s > 0:
                self.loop.call_soon_threadsafe(lambda: self.loop.create_task(self._drain_then_stop(drain_s)))
            else:
                self.loop.call_soon_threadsafe(self.loop.stop)
        except RuntimeError:  # already closed
            return
        if wait_s > 0 and threading.current_thread() is not self._thread:
            self._thread.join(wait_s)

    async def _drain_then_stop(self, drain_s: float) -> None:
        others = [t for t in asyncio.all_tasks(self.loop) if t is not asyncio.current_task()]
        if others:
            await asyncio.wait(others, timeout=drain_s)
        self.loop.stop()


class Deadlines:
    """One daemon thread that calls ``fire()`` at each registered time unless ``pending()`` is already false.

    Entries whose ``pending()`` turned false are dropped as they reach the front, without a wake of their own:
    calls that answer long before their deadline (the usual case) cost the thread nothing."""

    def __init__(self, name: str):
        self._heap: list = []
        self._order = itertools.count()
        self._cond = threading.Condition()
        self._closed = False
        self._name = name
        self._thread: threading.Thread | None = None
        self.wakes = 0  # times the thread woke from a wait (a deadline, or a new front of the queue)

    def add(self, when: float, pending: Callable[[], bool], fire: Callable[[], None]) -> None:
        """``fire()`` at ``when`` (``time.monotonic()`` seconds) if ``pending()`` still holds then; never for an
        infinite ``when`` (``env.step_timeout_s=inf``: no deadline, and nothing kept for one)."""
        if not math.isfinite(when):
            return
        with self._cond:
            if self._closed:
                return
            if self._thread is None:
                thread = threading.Thread(target=self._work, name=self._name, daemon=True)
                thread.start()  # raises if the process is out of threads: the caller's call does not start
                self._thread = thread
            heapq.heappush(self._heap, (when, next(self._order), pending, fire))
            if self._heap[0][3] is fire:  # the new front: the thread sleeps until a later time now
                self._cond.notify()

    def _work(self) -> None:
        with self._cond:
            while not self._closed:
                while self._heap and not self._heap[0][2]():
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._cond.wait()
                    self.wakes += 1
                    continue
                delay = self._heap[0][0] - time.monotonic()
                if delay > 0:
                    self._cond.wait(min(delay, threading.TIMEOUT_MAX))
                    self.wakes += 1
                    continue
                fire = heapq.heappop(self._heap)[3]
                self._cond.release()
                try:
                    fire()
                except Exception:  # a bug in the owner's callback must not stop every later deadline
                    log.exception("environment deadline callback failed")
                finally:
                    self._cond.acquire()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._heap.clear()
            self._cond.notify()
