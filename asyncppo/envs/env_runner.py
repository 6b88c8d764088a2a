"""Running environment calls off the engine's loop: a bounded number at once, a deadline each, faults as outcomes.

Why: an environment call may be slow (a tool, a sandbox, a web request) or broken (it raises, hangs, returns
garbage). The rollout loop must keep decoding other sequences meanwhile and must never die of one episode. So
every ``init``/``step``/``close`` starts with :meth:`EnvRunner.start`, which never blocks and returns a future of
an :class:`EnvOutcome`: a blocking method runs on a pool of up to ``env.max_concurrency`` daemon threads, a
coroutine method on the runner's one event loop (at most ``env.max_concurrency`` at once), and either way the
future is settled by ``env.step_timeout_s`` at the latest, whatever happened (the machinery and why it is shaped so:
:mod:`asyncppo.envs.call_threads`). A fault is counted by kind (:data:`FAULT_KINDS`) and handled per
``env.on_error``:

* ``zero_reward``: the episode ends here with reward 0 for the failing turn (its group still trains);
* ``drop``: the outcome says ``drop``; the caller discards the episode's group and its admission slot is
  regenerated.

A call that passed its deadline cannot be killed (Python has no safe way to stop a thread; a coroutine is cancelled,
but one that blocks its loop never sees the cancellation). A blocking call keeps its pool thread until it returns; a
coroutine that blocks keeps the loop, and the runner moves later calls to a fresh one. :attr:`EnvRunner.stuck` says
how many calls are still running past their deadline. Calls queued behind them still time out on their own deadline
(counted from :meth:`~EnvRunner.start`), so a hung environment costs throughput, never a stall without a named
cause.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures as cf
import inspect
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from asyncppo.config.validate_text_env import ENV_ON_ERROR as ON_ERROR
from asyncppo.envs.call_threads import DaemonPool, Deadlines, LoopThread
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


def _run(fn: Callable, *args) -> Any:
    """Call ``fn`` in a pool thread. A coroutine *function* runs on the runner's event loop instead; what is left here
    is the rare plain method that hands back a coroutine, run to completion on a loop of its own."""
    out = fn(*args)
    return asyncio.run(out) if inspect.isawaitable(out) else out


def _describe(error: BaseException) -> str:
    """``Type: message``, even for an exception whose ``str`` raises."""
    try:
        return f"{type(error).__name__}: {error}"
    except Exception:
        return f"{type(error).__name__} (its message could not be read)"


@dataclass(eq=False)
class _Call:
    """One call in flight: ``outcome`` is what its caller holds; ``inner`` is where it runs (a pool or loop
    future); whichever of its answer and its deadline comes first claims it."""

    env: Any
    what: str
    t0: float
    outcome: cf.Future
    inner: Optional[cf.Future] = None
    on_loop: bool = False  # a coroutine on the runner's event loop (else a blocking call on the pool)
    claimed: bool = False


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
        self._pool = DaemonPool(max_concurrency, "text-env")
        self._deadlines = Deadlines("text-env-deadlines")
        self._loop: Optional[LoopThread] = None  # started at the first coroutine call
        self.loops_replaced = 0  # event loops given up because a coroutine blocked one past a deadline
        self._lock = threading.Lock()
        self._closed = False
        self.faults = collections.Counter({k: 0 for k in FAULT_KINDS})
        self.calls = 0
        self.seconds = 0.0  # summed wall time of calls
        # the same for step calls alone (the metric episodes/env_s_per_step: a tool's latency, not init's or close's)
        self.step_calls = 0
        self.step_seconds = 0.0
        self.step_durations: collections.deque = collections.deque(maxlen=10_000)  # the latest, for percentiles
        self._stuck: set = set()
        self._blocked_loops: list[LoopThread] = []
        self.returned = 0  # calls the environment returned from (or raised in), on time or past their deadline
        # what the launcher's hang watch reads (health()): calls asked and neither answered, cancelled nor past their
        # deadline, and the seconds such calls were waiting since the environment last returned from any call
        self._waiting: set = set()
        self._unanswered_s = 0.0
        self._ticked = time.monotonic()
        self._inflight: set[_Call] = set()  # started and not yet settled

    @property
    def stuck(self) -> int:
        """Threads held by calls past their deadline: pool threads still inside such a call, and event loops given
        up because a coroutine blocked them and still blocked."""
        with self._lock:
            self._stuck = {f for f in self._stuck if not f.done()}
            self._blocked_loops = [t for t in self._blocked_loops if t.alive()]
            return len(self._stuck) + len(self._blocked_loops)

    def health(self) -> dict:
        """What the launcher's hang watch reads (launch/hang.py, rule 6): ``stuck``, calls still running past their
        deadline (:attr:`stuck`, and the current event loop when a coroutine has blocked it past a deadline: it is
        given up only at the next coroutine call); ``unanswered_s``, the seconds calls have been waiting for an
        answer since the environment last returned from any call (time with no call asked does not count, so a
        worker idle behind admission is not a pool that hangs); ``returned``, the calls returned so far. A pool
        whose calls all hang has ``stuck > 0`` and ``unanswered_s`` growing; a slow environment that answers late,
        or one that hangs some calls and answers others, resets it."""
        stuck = self.stuck
        with self._lock:
            self._tick()
            loop, unanswered, returned = self._loop, self._unanswered_s, self.returned
        if loop is not None and loop.blocked_for() > self.step_timeout_s:
            stuck += 1
        return {"stuck": stuck, "unanswered_s": round(unanswered, 3), "returned": returned}

    def _tick(self) -> None:
        """Add the time since the last tick to ``_unanswered_s`` if calls were waiting meanwhile (under ``_lock``)."""
        now = time.monotonic()
        if self._waiting:
            self._unanswered_s += now - self._ticked
        self._ticked = now

    def _returned(self, inner: cf.Future) -> None:
        with self._lock:
            self._tick()
            self._waiting.discard(inner)
            if not inner.cancelled():
                self.returned += 1
                self._unanswered_s = 0.0

    # ------------------------------------------------------------------------------------------- starting

    def start(self, env: Any, what: str, arg: Any = None) -> cf.Future:
        """Start ``env.<what>(arg)`` (``init`` with the prompt messages, ``step`` with the action text, ``close``
        with nothing) and return at once a future of its :class:`EnvOutcome`, settled by the deadline at the latest
        and never with an exception (nor does this method raise: a call that cannot start is a ``raised`` fault).
        ``close`` on an environment without one is done at once."""
        call = _Call(env, what, time.monotonic(), cf.Future())
        out = call.outcome  # the call lets go of it once settled (the deadline queue may hold the call a while)
        fn = getattr(env, what, None)
        if what == "close" and not callable(fn):
            call.claimed = True
            out.set_result(EnvOutcome(done=True))
            return out
        try:
            args = () if what == "close" else (list(arg) if what == "init" else arg,)
            call.on_loop = inspect.iscoroutinefunction(fn)
            with self._lock:
                if self._closed:
                    raise RuntimeError("the environment runner was shut down")
                self._inflight.add(call)  # settled by its answer, its deadline or shutdown's sweep
                loop = self._event_loop() if call.on_loop else None
            # the deadline first: a call that could not get one must not run unbounded
            self._deadlines.add(call.t0 + self.step_timeout_s, lambda: not call.claimed,
                                lambda: self._settle(call, lambda: self._timed_out(call)))
            inner = loop.submit(lambda: fn(*args)) if loop is not None else self._pool.submit(_run, fn, *args)
        except Exception as e:  # shut down, out of threads or descriptors, a bad argument
            self._settle(call, lambda: self._fault(call, "raised", f"could not start: {_describe(e)}"))
            return out
        call.inner = inner
        with self._lock:
            self._tick()
            self._waiting.add(inner)
        inner.add_done_callback(self._returned)  # at once if it is done already
        inner.add_done_callback(lambda f: self._settle(call, lambda: self._answered(call, f)))
        if call.claimed:  # its deadline (or shutdown) came before it was submitted: it is abandoned as a timed-out one
            self._abandon(call, inner)
        return out

    def _event_loop(self) -> LoopThread:
        """The loop for coroutine calls (under ``_lock``); a fresh one when a coroutine has blocked the current one
        for longer than a deadline (its calls time out on the deadline thread; new calls must not queue behind it)
        or its thread has died. The old loop is left to run out its calls and stop."""
        old = self._loop
        if old is not None and (old.blocked_for() > self.step_timeout_s or not old.alive()):
            old.stop(drain_s=self.step_timeout_s)
            self._blocked_loops.append(old)
            self._loop = None
            self.loops_replaced += 1
        if self._loop is None:
            self._loop = LoopThread(self.max_concurrency, f"text-env-loop-{self.loops_replaced}")
        return self._loop

    # ------------------------------------------------------------------------------------------- blocking

    def init(self, env: Any, prompt_messages: list) -> EnvOutcome:
        """``env.init`` off-loop; the outcome's ``observations`` are the starting messages."""
        return self.start(env, "init", prompt_messages).result()

    def step(self, env: Any, action_text: str) -> EnvOutcome:
        """``env.step`` off-loop, with the deadline."""
        return self.start(env, "step", action_text).result()

    def close(self, env: Any) -> None:
        """``env.close`` if it has one; a failure is counted, never raised."""
        self.start(env, "close").result()

    # ------------------------------------------------------------------------------------------- settling

    def _settle(self, call: _Call, make: Callable[[], EnvOutcome]) -> None:
        """The first of a call's answer, its deadline and shutdown's sweep settles it; the others do nothing. The
        outcome is always set: a failure to make it (an exception whose ``str`` raises, a hostile mapping) is a
        ``raised`` fault, so no caller ever waits on a call that was claimed and left unset."""
        with self._lock:
            if call.claimed:
                return
            call.claimed = True
            self._inflight.discard(call)
        try:
            outcome = make()
        except Exception as e:
            outcome = self._fault(call, "raised", f"its outcome could not be read: {_describe(e)}")
        out = call.outcome
        # the deadline queue may hold the call until its deadline: not the environment, its answer or the outcome
        call.env = call.inner = call.outcome = None
        out.set_result(outcome)

    def _answered(self, call: _Call, inner: cf.Future) -> EnvOutcome:
        if inner.cancelled():
            return self._fault(call, "raised", "cancelled: the environment runner was shut down")
        error = inner.exception()
        if error is not None:  # the environment's own exception
            return self._fault(call, "raised", _describe(error))
        return self._accept(call, inner.result())

    def _timed_out(self, call: _Call) -> EnvOutcome:
        if call.inner is not None:  # else not submitted yet: start() abandons it once it is
            self._abandon(call, call.inner)
        return self._fault(call, "timeout", f"no answer within env.step_timeout_s={self.step_timeout_s}")

    def _abandon(self, call: _Call, inner: cf.Future) -> None:
        """A queued pool call or a coroutine is cancelled (the coroutine when its loop next runs); a pool thread
        inside the call cannot be, and is counted in :attr:`stuck` until the call returns."""
        if not inner.cancel() and not call.on_loop:
            with self._lock:
                self._stuck.add(inner)
                self._tick()
                self._waiting.discard(inner)  # past its deadline: counted as stuck, no longer as waiting

    def _accept(self, call: _Call, value: Any) -> EnvOutcome:
        try:
            if call.what == "init":
                messages, info = normalize_init(value)
                return self._count(EnvOutcome(messages, 0.0, False, info), call)
            if call.what == "close":
                return self._count(EnvOutcome(done=True), call)
            r = normalize_step(value)
        except MalformedStep as e:
            return self._fault(call, e.kind, str(e))
        return self._count(EnvOutcome(r.observations, r.reward, r.done, r.info), call)

    def _count(self, outcome: EnvOutcome, call: _Call) -> EnvOutcome:
        outcome.seconds = time.monotonic() - call.t0
        with self._lock:
            self.calls += 1
            self.seconds += outcome.seconds
            if call.what == "step":
                self.step_calls += 1
                self.step_seconds += outcome.seconds
                self.step_durations.append(outcome.seconds)
        return outcome

    def _fault(self, call: _Call, kind: str, detail: str) -> EnvOutcome:
        with self._lock:
            self.faults[kind] += 1
        text = f"{type(call.env).__name__}.{call.what}: {detail}"
        return self._count(EnvOutcome([], 0.0, True, {}, kind, text, self.on_error == "drop"), call)

    def shutdown(self, grace_s: float = 2.0) -> None:
        """Stop taking calls; give those in flight (the ``close`` of every episode a stopping worker abandons, most
        often) up to ``grace_s`` to answer, then settle what is left as ``raised`` ("shut down") and stop. Threads
        stuck in a hung call are left to finish on their own (never joined)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = [call.outcome for call in self._inflight]  # an unsettled call still holds its outcome
        cf.wait(pending, timeout=grace_s)
        with self._lock:
            left = list(self._inflight)
            loop, self._loop = self._loop, None
        for call in left:
            self._settle(call, lambda call=call: self._fault(call, "raised", "the environment runner was shut down"))
        self._pool.shutdown()
        if loop is not None:  # free now: it ends at once, cancelling what the calls left running
            loop.stop(wait_s=1.0)
        self._deadlines.close()

    def __enter__(self) -> "EnvRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
