"""The skeleton every rollout worker shares: open the channels, watch the learner's versions, load weights, loop, close.

Why one skeleton: the LLM worker (:mod:`asyncppo.rollout.worker`, an inference engine kept full) and the embodied
worker (:mod:`asyncppo.envs.worker`, a vector env stepped by a small policy) differ only in what one unit of work is
and in how weights reach the model. Everything around that - the admission client, the control subscription, the
weight-sync group, the trajectory sender, the order things close in, the refusal of a learner on another wire
version - is the same contract with the learner, so it is written once here.

The loop is a small state machine, one :meth:`WorkerSkeleton._turn` per pass:

1. **control** - read the learner's newest state; stop if asked.
2. **weights** - the learner announced newer weights: :meth:`_on_weights_announced` (load now, or drain first).
3. **work** - :meth:`_work`: admit, generate or step, send what is finished, or wait without spinning.

A subclass provides ``_open_workload`` (its engine or env, and what it needs), ``_on_weights_announced`` and
``_work``; it may add to ``_before_close`` and ``_drop_work``, and move into :meth:`WorkerSkeleton.prepare` what
needs no learner (an inference engine: its imports, weights and warm-up), which a launch then runs while the learner
starts; :meth:`WorkerSkeleton.attach` hands over the learner's addresses afterwards.

**A restarted learner.** When the learner process dies, the launcher starts a new one from the latest checkpoint
(launch/learner_restart.py) on new addresses, and hands them to every live worker with the data position the
checkpoint holds (:meth:`WorkerSkeleton.request_reconnect`, called from another thread). The worker notices it at
the top of its next turn (or while it retries a send): it drops the work in flight (the new learner never granted
those tickets, and their draws are drawn again from the position), forgets its tickets, closes its channels (the
dead learner's weight-sync group with them) and opens new ones on the new addresses, joining a new two-rank group.
Its weights count as none (version -1) until the new learner's first push, which comes before any ticket is served:
the engine may hold newer weights than the checkpoint, which the new learner never trained from.
"""

from __future__ import annotations

import collections
import logging
import time

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.staleness import AdmissionClient
from asyncppo.stream.channels import ControlSubscriber, TrajectorySender
from asyncppo.stream.endpoints import Endpoints
from asyncppo.sync import SyncGroupError, WeightReceiver, make_sync_group
from asyncppo.sync.fanout import member_prefix

log = logging.getLogger("asyncppo.rollout")

# Seconds without a control message (repeated every 0.2 s) after which a failed weight receive is blamed on a dead
# learner, whose restart the worker then awaits.
LEARNER_SILENT_S = 3.0


class WorkerSkeleton:
    """What every worker holds and does around its workload (module docstring)."""

    role = "worker"  # how errors and logs name this kind of worker ("rollout worker", "env worker")

    def __init__(self, cfg: AsyncPPOConfig, worker_id: int, num_workers: int, endpoints: Endpoints | None,
                 incarnation: int = 0):
        self.cfg = cfg
        self.worker_id = worker_id
        self.num_workers = num_workers
        self.endpoints = endpoints
        # incarnation: how many times the launcher restarted this worker (0: the first process); it names the
        # worker's weight-sync group and its group ids, so a replacement never collides with its predecessor
        self.incarnation = incarnation
        self.version = 0  # version of the weights the model holds
        self.stats: dict = {}  # counters the worker returns; each worker names its own
        self._pending: collections.deque = collections.deque()  # granted tickets not yet used
        self._closables: list = []
        self._state = None  # the learner's newest control state
        self._seq = 0
        self._channels: list = []  # what _open_channels opened: closed and reopened when the learner is restarted
        self._reconnect_to = None  # (endpoints, data position) of a restarted learner, set from another thread
        # what the launcher's control ping reads (heartbeat(), launch/hang.py): the phase the loop is in and a
        # counter of progress (decode steps, groups sent, weight loads) that only grows while the worker gets on
        self.phase = "starting"  # starting | generating | waiting | sending | loading
        self.progress = 0

    # ------------------------------------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Build what needs no learner, before its addresses exist (launch/start.py overlaps it with the learner's
        own start-up). Idempotent: :meth:`run` calls it too. Nothing by default."""

    def attach(self, endpoints: Endpoints, position=None) -> None:
        """The learner's addresses (and, for a worker that draws prompts, where its draws resume), known once the
        learner has bound its sockets; before :meth:`run`."""
        self.endpoints = endpoints

    def run(self) -> dict:
        if self.endpoints is None:
            raise RuntimeError(f"{self.role} {self.worker_id}: run() before attach(): no learner addresses")
        self._open()
        self.phase = "waiting"
        try:
            while self._turn():
                pass
        finally:
            self._close()
        return dict(self.stats, worker_id=self.worker_id, version=self.version)

    def heartbeat(self) -> dict:
        """Answer the launcher's control ping (from another thread: plain reads only). A worker that is waiting
        (for a ticket, for weights, for the learner to take a group) makes no progress and is not hung; one that is
        generating must keep stepping (launch/hang.py)."""
        beat = {"phase": self.phase, "progress": self.progress, "incarnation": self.incarnation}
        env = self._env_health()
        if env is not None:
            beat["env"] = env
        return beat

    def _env_health(self) -> dict | None:
        """How this worker's environment calls fare, for a worker whose environments run beside its loop (text
        environments: ``{"stuck": calls past their deadline still running, "returned": calls returned}``); None
        for the others. Its idle waits for those calls count as steps, so only this shows a pool that hangs."""
        return None

    def _turn(self) -> bool:
        """One pass of the loop in the module docstring; False once the run is over. A weight receive that fails
        because the learner died (its control channel went silent) waits for the restarted learner instead of
        ending the worker; any other failure ends it (the launcher replaces it)."""
        try:
            return self._pass()
        except SyncGroupError:
            self.phase = "waiting"  # on the learner: silent means dead, and a dead one is being restarted
            if self.control.heard(LEARNER_SILENT_S) or not self._await_reconnect():
                raise
            return True

    def _await_reconnect(self) -> bool:
        """Wait up to ``cluster.timeout_s`` for the launcher to hand over a restarted learner's addresses."""
        deadline = time.monotonic() + self.cfg.cluster.timeout_s
        while self._reconnect_to is None and time.monotonic() < deadline:
            time.sleep(0.2)
        return self._reconnect_to is not None

    def _pass(self) -> bool:
        if self._reconnect_to is not None:
            self._reconnect()
        state = self._read_control()
        if state is not None and state.stop:
            return False
        if state is not None and state.weights_version > self.version and self._on_weights_announced(state):
            return True
        self._work()
        return True

    # ---------------------------------------------------------------------------------------- what a worker adds
    def _open_workload(self) -> None:
        """Build the model side (engine or env and policy) before any channel opens."""
        raise NotImplementedError

    def _on_weights_announced(self, state) -> bool:
        """React to newer announced weights; True ends this turn (the next one reads control again)."""
        raise NotImplementedError

    def _work(self) -> None:
        raise NotImplementedError

    def _before_close(self) -> None:
        """Release what must go before the channels close (e.g. abort the sequences in flight)."""

    def _drop_work(self, position) -> None:
        """A restarted learner (at ``self.endpoints`` now): forget the work in flight, resume the draws at
        ``position`` and move what the workload itself connects to the learner."""

    # ------------------------------------------------------------------------------------------------------------
    def request_reconnect(self, endpoints: Endpoints, position=None) -> None:
        """The launcher restarted the learner: move to ``endpoints`` at the next turn (module docstring)."""
        self._reconnect_to = (endpoints, position)

    def _reconnect(self) -> None:
        endpoints, position = self._reconnect_to
        self._reconnect_to = None
        self.endpoints = endpoints
        self._drop_work(position)
        self._pending.clear()
        for channel in reversed(self._channels):
            try:
                channel.close()
            except Exception:  # the old learner is gone: its sockets and group may fail to close cleanly
                pass
            self._closables.remove(channel)
        self._channels = []
        self._state, self.version = None, -1
        self.phase = "waiting"  # joining the new learner's weight sync is a wait on the learner, not a hang
        self.stats["learner_reconnects"] = self.stats.get("learner_reconnects", 0) + 1
        print(f"[asyncppo] {self.role} {self.worker_id}: the learner was restarted; reconnecting"
              + (f" from draw {position['next']}" if position else ""), flush=True)
        self._open_channels()

    # ------------------------------------------------------------------------------------------------------------
    def _open(self) -> None:
        self.prepare()
        self._open_workload()
        self._open_channels()

    def _open_channels(self) -> None:
        """The weight-sync group, then the trajectory sender, the control subscription and the admission client."""
        cfg, ep = self.cfg, self.endpoints
        if ep.sync_per_worker:  # one two-rank group per worker and incarnation (sync/fanout.py)
            rank, world, prefix = 1, 2, member_prefix(ep.sync_prefix, self.worker_id, self.incarnation)
        else:
            rank, world, prefix = 1 + self.worker_id, ep.sync_world_size, ep.sync_prefix
        self.group = make_sync_group(ep.sync_host, ep.sync_port, rank=rank, world_size=world,
                                     backend=ep.sync_backend, timeout_s=cfg.cluster.timeout_s, store_prefix=prefix)
        self._closables.append(self.group)
        self.receiver = WeightReceiver(self.group)
        # ep.curve: the run's CURVE client keys when the learner authenticates peers (docs/security.md)
        self.sender = TrajectorySender(ep.trajectory, hwm=cfg.cluster.stream_hwm,
                                       max_message_bytes=ep.max_message_bytes, curve=ep.curve)
        self.control = ControlSubscriber(ep.control, curve=ep.curve)
        self.admission = AdmissionClient(ep.admission, self.worker_id, curve=ep.curve)
        self._closables += [self.sender, self.control, self.admission]
        self._channels = [self.group, self.sender, self.control, self.admission]

    def _close(self) -> None:
        try:
            self._before_close()
        except Exception:  # closing must not mask the run's outcome
            pass
        for closable in reversed(self._closables):
            try:
                closable.close()
            except Exception:  # closing must not mask the run's outcome
                pass

    # ------------------------------------------------------------------------------------------------------------
    def _read_control(self):
        self._state = self.control.latest(timeout_ms=0) or self._state
        if self._state is None and self.control.rejected.get("version", 0):
            # Every control message is refused: the learner runs another asyncppo wire version. Waiting would
            # hang the run until its timeout; fail now with the reason.
            raise RuntimeError(
                f"{self.role} {self.worker_id}: the learner's control messages use another wire schema "
                "version; run the same asyncppo version on every node"
            )
        return self._state

    def _waits_for_a_push(self, tickets) -> bool:
        """Every ticket of ``tickets`` needs weights newer than the learner has announced (not merely not loaded
        yet): with pushes every ``s >= 2`` versions that can last a whole learner step, and a ticket released
        meanwhile must still reach a worker, so the workers then keep a request open beyond their room."""
        announced = max(self.version, self._state.weights_version if self._state is not None else -1)
        return not any(t.min_version <= announced for t in tickets)

    def _send_until_sent(self, send_once) -> bool:
        """Retry ``send_once()`` (one bounded attempt) until the learner takes it; False when a stop came first."""
        while not send_once():
            state = self._read_control()
            if (state is not None and state.stop) or self._reconnect_to is not None:
                return False  # a restarted learner re-draws this work from its data position
        return True
