"""A discrete-event model of the asyncppo pipeline: engines, admission, stream, learner and weight pushes.

Why a simulator and not a formula: with a long-tailed length distribution the pipeline's speed is set by who waits
for whom (the batch waits for its slowest ticket, tickets wait for the staleness window, engines wait for weights),
and those waits interact. The model replays the real rules, stated in docs/architecture.md, at the granularity of
sequences finishing, so a run of thousands of learner steps on hundreds of engines takes seconds:

* **engines** (``engines``, each ``max_num_seqs`` slots) decode continuously; one decode step of an engine running
  ``n`` sequences whose contexts hold ``kv`` tokens takes ``base + per_seq*n + per_kv_token*kv`` seconds and gives
  every running sequence one token. A group of ``n`` samples is admitted when the engine holds a ticket whose
  ``min_version`` its weights satisfy and it has room: ``n`` free slots (``admission_unit="group"``) or one
  (``"slot"``: the samples that find no slot wait in the engine's queue and start as slots free, as vLLM's
  scheduler starts them); its slots free one by one as samples finish; the group is delivered when its last sample
  finishes (the stream costs nothing at this scale: docs/benchmarks.md, Transport).
* **admission**: the run's own :class:`~asyncppo.staleness.controller.AdmissionController` grants the tickets:
  ticket ``i`` while ``i < (j + v + 1) * B``, needing weights ``>= i // B - j``, with the deadline ``i // B - j + k``
  (``j = rollout.admission_lookahead``, ``k`` when unset); engines take tickets in order as they have room, exactly
  like the workers.
* **learner**: the batch at version ``v`` is chosen by the buffer's own rule (:func:`~asyncppo.staleness.order.
  next_batch`): the ``B`` lowest outstanding tickets once all are delivered, or, under a lookahead, the ``B`` lowest
  delivered ones when every missing ticket still meets its deadline; it takes ``base + per_token * tokens / ranks``
  seconds; then ``v + 1``, and every
  ``sync_every`` versions the weights are pushed: every engine pauses ``load_s`` (between two decode steps, keeping
  its sequences, as ``inflight_update=keep``) and then labels new tokens with the new version.
* **colocated** (``colocated=True``, needs ``k = 0``): the same GPUs generate and train, as a synchronous trainer
  on one pool does; ``switch_s`` is added per step for swapping the two roles in and out of memory.
* **episodes** (``turns > 1`` or ``env_s > 0``: multi-turn agents, ``env.text_env``): a sample is ``turns`` model
  turns (its decoded tokens, ``model_frac`` of its length, split evenly among them); after each turn it leaves the
  engine, freeing its slot, for an environment call of ``env_s`` seconds, then queues for a slot again; the call
  after its last turn ends it. The engine admits by the episode worker's expected load
  (:func:`~asyncppo.staleness.episode_load.engine_load`: episodes in flight times their share of time in the
  engine, kept by the same :class:`~asyncppo.staleness.episode_load.EngineShare` on simulated time), so a slow
  tool lets it hold more episodes than slots while the staleness window allows.

Within an engine the number of running sequences is constant between events, so progress is integrated exactly
(the per-KV term makes step time grow linearly with progress: a quadratic, solved in closed form). Tokens are
counted continuously (a sequence of length ``L`` finishes after ``L`` decode steps of its engine).

Pure Python (heapq, random): no Ray, sockets or torch; deterministic for a given seed.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from asyncppo.config.choices import admission_room
from asyncppo.pipeline.model import EngineSpeed, Result, Setup, TrainSpeed
from asyncppo.staleness.controller import AdmissionController
from asyncppo.staleness.episode_load import EngineShare, engine_load
from asyncppo.staleness.order import next_batch

__all__ = ["EngineSpeed", "Result", "Setup", "Simulator", "TrainSpeed", "simulate"]


class _Engine:
    __slots__ = ("idx", "t", "p", "n", "kv0", "heap", "paused_until", "version", "busy", "steps", "run_steps",
                 "pending", "marks", "epoch", "queue", "at_env", "share")

    def __init__(self, idx: int):
        self.idx = idx
        self.t = 0.0  # time up to which progress is integrated
        self.p = 0.0  # progress: decode steps done
        self.n = 0  # running sequences
        self.kv0 = 0.0  # context tokens of the running sequences = n * p + kv0
        self.heap: list = []  # (finish progress, seq id)
        self.paused_until = 0.0
        self.version = 0
        self.busy = self.steps = self.run_steps = 0.0
        self.pending: deque = deque()  # granted tickets not yet admitted
        self.marks: list[tuple[float, int]] = [(0.0, 0)]  # (progress, version from then on)
        self.epoch = 0
        # (ticket, length, segments left, environment tokens a turn, context) of samples waiting for a slot:
        # admitted per slot, or an episode back from its environment; length is the sample's response tokens,
        # context its response tokens so far (the environment's included)
        self.queue: deque = deque()
        self.at_env = 0  # episodes at their environment call (hold no slot)
        self.share = EngineShare()  # the episode worker's share of in-flight time in the engine, on simulated time


@dataclass
class _RunState:
    """What one :meth:`Simulator.run` changes as events fire (the engines' own state lives in :class:`_Engine`)."""

    engines: list
    tickets: AdmissionController
    seqs: dict = field(default_factory=dict)  # seq id -> (ticket, start progress, length, segments, env a turn, context)
    groups: dict = field(default_factory=dict)  # ticket -> {left, tokens (trained), dec (decoded), vmin, tv}
    delivered: dict = field(default_factory=dict)
    learner_busy_until: Optional[float] = None
    step_ends: list = field(default_factory=lambda: [0.0])
    train_time: list = field(default_factory=list)
    lags: list = field(default_factory=list)
    token_lags: list = field(default_factory=list)
    snap: dict = field(default_factory=lambda: {"t": 0.0, "busy": [0.0], "steps": [0.0], "run": [0.0], "train": 0.0,
                                                "lags": 0, "tlags": 0})
    seq_ids: int = 0
    # the state of the last step the buffer's rule found no batch for: the rule is a pure function of the version,
    # the delivered groups and the tickets granted, released, trained and the window's changes, so until one of
    # them changes it finds none again (the simulator releases no ticket and moves no window today)
    not_ready: Optional[tuple] = None

    @property
    def version(self) -> int:
        """The learner's version: the controller's own, so the two can never disagree."""
        return self.tickets.version


class Simulator:
    def __init__(self, setup: Setup, gen: EngineSpeed, train: TrainSpeed, lengths):
        if setup.group_size > gen.max_num_seqs:
            raise ValueError(f"a group of {setup.group_size} does not fit in max_num_seqs={gen.max_num_seqs}")
        if gen.base_s <= 0 and gen.per_seq_s <= 0 and gen.per_kv_token_s <= 0:
            raise ValueError("EngineSpeed needs a positive base_s, per_seq_s or per_kv_token_s (a step takes time)")
        self.s, self.gen, self.train, self.lengths = setup, gen, train, lengths
        self.episodes = setup.episodes  # read on every event: a property of the frozen setup, computed once
        self.rng = random.Random(setup.seed)

    # -- engine progress ------------------------------------------------------------------------------------
    def _rate_terms(self, e: _Engine) -> tuple[float, float]:
        """Step time at progress p is alpha + beta * (p - e.p)."""
        g = self.gen
        alpha = g.base_s + g.per_seq_s * e.n + g.per_kv_token_s * (e.n * e.p + e.kv0)
        return alpha, g.per_kv_token_s * e.n

    def _advance(self, e: _Engine, t: float) -> None:
        if t <= e.t:
            return
        start = max(e.t, e.paused_until)
        if e.n and start < t:
            dt = t - start
            alpha, beta = self._rate_terms(e)
            d = dt / alpha if beta == 0 else 2.0 * dt / (alpha + math.sqrt(alpha * alpha + 2.0 * beta * dt))
            e.p += d
            e.busy += dt
            e.steps += d
            e.run_steps += e.n * d
        e.t = t

    def _time_to(self, e: _Engine, p_target: float) -> float:
        alpha, beta = self._rate_terms(e)
        d = max(0.0, p_target - e.p)
        return max(e.t, e.paused_until) + alpha * d + 0.5 * beta * d * d

    def _schedule(self, e: _Engine) -> None:
        e.epoch += 1
        if e.heap:
            target = e.heap[0][0]
            heapq.heappush(self.events, (self._time_to(e, target), 0, self._seq(), ("finish", e.idx, e.epoch, target)))

    def _seq(self) -> int:
        self._counter += 1
        return self._counter

    def _mean_version(self, e: _Engine, p0: float, p1: float) -> float:
        """Token-weighted mean weight version of the tokens decoded between progress p0 and p1 on engine e."""
        if p1 <= p0:
            return float(e.version)
        if p0 >= e.marks[-1][0]:  # the common case: no load since the sequence started
            return float(e.marks[-1][1])
        total = 0.0
        i = max(0, bisect.bisect_right(e.marks, (p0, float("inf"))) - 1)
        while i < len(e.marks) and e.marks[i][0] < p1:
            lo = max(p0, e.marks[i][0])
            hi = min(p1, e.marks[i + 1][0]) if i + 1 < len(e.marks) else p1
            total += max(0.0, hi - lo) * e.marks[i][1]
            i += 1
        return total / (p1 - p0)

    # -- the run --------------------------------------------------------------------------------------------
    def run(self) -> Result:
        """Replay events (sequence finished, step trained, weights loaded, environment answered) in time order until
        the last step."""
        self.events: list = []
        self._counter = 0
        tickets = AdmissionController(self.s.batch_groups, self.s.max_staleness, lookahead=self.s.lookahead)
        self.r = r = _RunState(engines=[_Engine(i) for i in range(self.s.engines)], tickets=tickets)
        self._admit_all(0.0)
        while self.events and r.version < self.s.steps:
            now, _, _, ev = heapq.heappop(self.events)
            if ev[0] == "finish":
                self._on_finish(ev, now)
            elif ev[0] == "trained":
                self._on_trained(now)
            elif ev[0] == "loaded":
                self._on_loaded(ev, now)
            elif ev[0] == "env":
                self._on_env(ev, now)
        if r.version < self.s.steps:
            raise RuntimeError(f"the simulated pipeline stalled at version {r.version} (no event left): {self.s}")
        return self._result(r.engines, r.snap, r.step_ends, r.train_time, r.lags, r.token_lags)

    def _admit(self, e: _Engine, now: float) -> None:
        """Request tickets in order while the engine has room, then admit every group whose version it satisfies."""
        r, n = self.r, self.s.group_size
        self._advance(e, now)
        if self.episodes:  # as the worker: the counts so far, then the room (single-turn room never reads it)
            e.share.add(e.n + len(e.queue), e.at_env, now)
        room = self._room(e)
        while len(e.pending) < room:  # request tickets, in order, while the window has them
            granted = r.tickets.try_acquire()
            if granted is None:
                break
            e.pending.append(granted)
        added = admitted = False
        while e.pending and self._room(e) and e.pending[0].min_version <= e.version:
            admitted = True
            ticket = e.pending.popleft().index
            r.groups[ticket] = {"left": n, "tokens": 0, "dec": 0, "vmin": e.version, "tv": 0.0}
            e.queue.extend((ticket, L, *self._segments(L), 0.0) for L in self.lengths.sample_group(self.rng, n))
            added = self._start_queued(e) or added
        if self.episodes and admitted:  # else the counts are those just added, at the same time: no change
            e.share.add(e.n + len(e.queue), e.at_env, now)
        if added:
            self._schedule(e)

    def _segments(self, length: int) -> tuple[tuple, float]:
        """The decoded tokens of a sample of ``length`` response tokens, one entry per model turn, and the tokens
        the environment adds to its context after each turn but the last (the rest of its length: the answer that
        ends an episode adds none)."""
        s = self.s
        if s.turns == 1.0 and s.model_frac == 1.0:
            return (length,), 0.0
        decoded = max(1, round(length * s.model_frac))  # a turn decodes at least its stop token
        whole = int(s.turns)
        turns = min(decoded, whole + (s.turns > whole and self.rng.random() < s.turns - whole))
        base, extra = divmod(decoded, turns)
        return tuple(base + (i < extra) for i in range(turns)), max(0, length - decoded) / max(1, turns - 1)

    def _load(self, e: _Engine) -> int:
        """What admission counts as engine ``e``'s load: the samples in it or queued for it; with episodes the load
        the episodes in flight make on average (the episode worker's rule)."""
        in_engine = e.n + len(e.queue)
        return engine_load(in_engine, in_engine + e.at_env, e.share.share) if self.episodes else in_engine

    def _room(self, e: _Engine) -> int:
        """Groups engine ``e`` may admit now."""
        return admission_room(self.gen.max_num_seqs - self._load(e), self.s.group_size, self.s.admission_unit)

    def _start_queued(self, e: _Engine) -> bool:
        """Start queued samples while the engine has a free slot (at its current progress); True if any started."""
        r, started = self.r, False
        while e.queue and e.n < self.gen.max_num_seqs:
            ticket, L, segs, env_turn, ctx = e.queue.popleft()
            r.seq_ids += 1
            r.seqs[r.seq_ids] = (ticket, e.p, L, segs, env_turn, ctx)
            heapq.heappush(e.heap, (e.p + segs[0], r.seq_ids))
            e.kv0 += self.s.prompt_tokens + ctx - e.p
            e.n += 1
            started = True
        return started

    def _admit_all(self, now: float) -> None:
        # engines with the most room ask first, as idle workers' requests reach the controller first
        for e in sorted(self.r.engines, key=lambda x: self._load(x) if self.episodes else x.n):
            self._admit(e, now)

    def _try_train(self, now: float) -> None:
        """Start the next step once the learner is free and the buffer's rule has a batch for it."""
        s, r = self.s, self.r
        B, n = s.batch_groups, s.group_size
        if r.learner_busy_until is not None or r.version >= s.steps:
            return
        # a sequence finishes far more often than a group is delivered or a ticket granted: most calls would
        # recompute the same "not ready" (half of a decision's time in the window tuner on long-tailed runs)
        t = r.tickets
        state = (r.version, len(r.delivered), t.granted, t.consumed_count, t.released, t.window_changes)
        if state == r.not_ready:
            return
        pick = next_batch(r.tickets, r.delivered, B, r.version)
        if pick is None:
            r.not_ready = state
            return
        batch = pick[0]
        for t in batch:
            r.tickets.consumed(t)
        recs = [r.delivered.pop(t) for t in batch]
        tokens = sum(rec["tokens"] for rec in recs)
        for rec in recs:
            r.lags.extend([r.version - rec["vmin"]] * n)
            r.token_lags.append((r.version * rec["dec"] - rec["tv"], rec["dec"]))
        dur = self.train.step_s(tokens, s.train_ranks) + (s.switch_s if s.colocated else 0.0)
        r.train_time.append(dur)
        r.learner_busy_until = now + dur
        heapq.heappush(self.events, (now + dur, 1, self._seq(), ("trained", tokens)))

    def _on_finish(self, ev: tuple, now: float) -> None:
        """Sequences of one engine reached their length (or ended a turn): free their slots, deliver completed
        groups (or send the episodes to their environment), refill."""
        s, r = self.s, self.r
        e = r.engines[ev[1]]
        if ev[2] != e.epoch:
            return  # superseded by a later schedule of this engine
        self._advance(e, now)
        # the event was computed to reach this progress: snap to it, so float rounding of tiny step times
        # (now + 1e-9 == now) can never leave the sequence unfinished and the event re-firing forever
        if ev[3] > e.p:
            e.steps += ev[3] - e.p
            e.run_steps += e.n * (ev[3] - e.p)
            e.p = ev[3]
        while e.heap and e.heap[0][0] <= e.p + 1e-9:
            _, sid = heapq.heappop(e.heap)
            ticket, p0, L, segs, env_turn, ctx = r.seqs.pop(sid)
            e.n -= 1
            e.kv0 -= s.prompt_tokens + ctx - p0
            g = r.groups[ticket]
            g["dec"] += segs[0]
            g["tv"] += segs[0] * self._mean_version(e, p0, p0 + segs[0])
            if self.episodes:  # to the environment (its slot is free now); back in env_s, or ended by the last call
                e.at_env += 1
                heapq.heappush(self.events, (now + s.env_s, 3, self._seq(),
                                             ("env", e.idx, ticket, L, segs[1:], env_turn, ctx + segs[0] + env_turn)))
            else:
                self._sample_done(ticket, L)
        if e.n == 0:
            e.kv0 = 0.0  # no drift of floating-point sums across idle periods
        self._start_queued(e)
        self._admit(e, now)
        self._schedule(e)
        self._try_train(now)

    def _sample_done(self, ticket: int, length: int) -> None:
        g = self.r.groups[ticket]
        g["left"] -= 1
        g["tokens"] += length
        if g["left"] == 0:
            self.r.delivered[ticket] = self.r.groups.pop(ticket)

    def _on_env(self, ev: tuple, now: float) -> None:
        """An episode's environment call answered: its next turn queues for a slot, or the episode has ended."""
        _, idx, ticket, length, segs, env_turn, ctx = ev
        e = self.r.engines[idx]
        self._advance(e, now)  # integrate progress at the old count before the count changes
        e.at_env -= 1
        if segs:
            e.queue.append((ticket, length, segs, env_turn, ctx))
            self._start_queued(e)
        else:
            self._sample_done(ticket, length)
        self._admit(e, now)
        self._schedule(e)
        self._try_train(now)

    def _on_trained(self, now: float) -> None:
        """A step ended: the next version, the warm-up snapshot, and every ``sync_every`` versions a weight push."""
        s, r = self.s, self.r
        r.learner_busy_until = None
        r.tickets.set_version(r.version + 1)
        r.step_ends.append(now)
        if r.version == s.warmup_steps:
            for e in r.engines:
                self._advance(e, now)
            r.snap = {"t": now, "busy": [e.busy for e in r.engines], "steps": [e.steps for e in r.engines],
                      "run": [e.run_steps for e in r.engines], "train": sum(r.train_time),
                      "lags": len(r.lags), "tlags": len(r.token_lags)}
        if r.version % s.sync_every == 0 and r.version < s.steps:
            for e in r.engines:
                self._advance(e, now)
                e.paused_until = max(e.paused_until, now) + s.load_s
                heapq.heappush(self.events, (e.paused_until, 2, self._seq(), ("loaded", e.idx, r.version)))
                self._schedule(e)
        self._admit_all(now)
        self._try_train(now)

    def _on_loaded(self, ev: tuple, now: float) -> None:
        """An engine finished loading a version: new tokens carry it, and tickets that waited for it may start."""
        e = self.r.engines[ev[1]]
        self._advance(e, now)
        if ev[2] > e.version:
            e.version = ev[2]
            e.marks.append((e.p, e.version))
        self._admit(e, now)
        self._schedule(e)

    def _result(self, engines, snap, step_ends, train_time, lags, token_lags) -> Result:
        s = self.s
        t_end = step_ends[-1]
        for e in engines:
            self._advance(e, t_end)
        wall = t_end - snap["t"]
        measured = s.steps - s.warmup_steps
        samples = measured * s.batch_groups * s.group_size
        busy = sum(e.busy for e in engines) - sum(snap["busy"])
        steps = sum(e.steps for e in engines) - sum(snap["steps"])
        run = sum(e.run_steps for e in engines) - sum(snap["run"])
        train = sum(train_time) - snap["train"]
        lag_w = lags[snap["lags"]:]
        tl = token_lags[snap["tlags"]:]
        tokens = sum(c for _, c in tl)
        rollout_busy = busy / (wall * s.engines)
        train_busy = train / wall
        gpus = s.engines + (0 if s.colocated else s.train_ranks)
        used = busy + train * (s.train_ranks if not s.colocated else s.engines)
        return Result(
            samples_per_s=samples / wall,
            tokens_per_s=tokens / wall,
            step_s=wall / measured,
            rollout_busy=rollout_busy,
            train_busy=train_busy,
            occupancy=run / steps / self.gen.max_num_seqs if steps else 0.0,
            lag_mean=sum(lag_w) / len(lag_w) if lag_w else 0.0,
            lag_max=max(lag_w, default=0),
            token_lag_mean=sum(v for v, _ in tl) / tokens if tokens else 0.0,
            waste=0.0,
            idle_gpu_frac=max(0.0, 1.0 - used / (wall * gpus)),
            step_times=[b - a for a, b in zip(step_ends[s.warmup_steps:], step_ends[s.warmup_steps + 1:])],
        )


def simulate(setup: Setup, gen: EngineSpeed, train: TrainSpeed, lengths) -> Result:
    """Run the model once; see the module docstring for what it replays."""
    return Simulator(setup, gen, train, lengths).run()
