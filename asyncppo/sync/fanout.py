"""Learner side of the weight sync with one two-rank group per rollout worker, so one member's death breaks nobody.

Why not one group of ``1 + N`` ranks. A collective needs every member: a worker killed in the middle of a run makes
every later broadcast of a shared group fail (gloo) or hang (NCCL) for all the others, and a replacement process
cannot enter a formed group, so the whole group would have to be re-formed by every member at once, in the middle of
generation. Here rank 0 serves one ``TCPStore`` (bound to ``cluster.bind_address``) and forms, for worker ``w`` in
its ``g``-th incarnation, a group of two ranks under the key prefix ``<run secret>/w<w>/g<g>``
(:func:`member_prefix`). A dead member's group is simply abandoned; its replacement forms a fresh one, in the
background, whenever it comes up.

Pushes. One snapshot of the weights per version is shared by all members; each member has one pusher thread that
broadcasts the queued versions in order, so members never wait for each other (a worker busy in a long decode step
delays only its own copy). A member that joins after a push receives the latest version at once: a replacement
holds the current weights before it generates. A push that fails (the peer died, or did not take the weights
within ``timeout_s``) retires that member and is recorded in :attr:`WeightFanout.failures` with the worker's
name; it is never raised into the learner, whose own deadlines (tickets, trajectories) name a worker that is late.

Streamed pushes (:meth:`WeightFanout.push_groups`): when the tensors are made group by group (a gather of an FSDP2
learner), each group goes to every member as soon as it exists and is freed once all took it, within a byte budget
(sync/group_stream.py); no snapshot is kept, so a member that joins later is :meth:`WeightFanout.behind` and the
learner pushes again at its next step.

Cost (measured in docs/benchmarks.md, "Weight sync fan-out"): the learner sends the bytes once per worker instead of
once per broadcast tree; with gloo on one machine, N pair groups pushed in parallel cost about what the shared
group's broadcast costs, because gloo's broadcast also sends the whole buffer to every peer.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from asyncppo.sync.broadcast import WeightSender, _as_named_list
from asyncppo.sync.group_stream import GroupStream
from asyncppo.sync.group import (
    SyncGroup, SyncGroupError, bound_store, forget_rendezvous, group_on_store, stages_on_host,
)

log = logging.getLogger("asyncppo.sync")


def member_prefix(run_prefix: str, worker_id: int, incarnation: int) -> str:
    """The store key prefix of worker ``worker_id``'s ``incarnation``-th group (both sides compute it alike)."""
    return f"{run_prefix}/w{int(worker_id)}/g{int(incarnation)}"


@dataclass
class _Member:
    worker_id: int
    incarnation: int
    state: str = "joining"  # (pending ->) joining -> ready -> failed | gone
    sender: Optional[WeightSender] = None
    queue: "queue.Queue" = field(default_factory=queue.Queue)
    error: str = ""
    last_version: int = -1  # the last version this member took
    # when each push still queued (or in hand) was queued, oldest first: a push deadline counts from there
    queued_at: collections.deque = field(default_factory=collections.deque)

    def put(self, item) -> None:
        """Queue a push (its clock starts now)."""
        self.queued_at.append(time.monotonic())
        self.queue.put(item)


def _oldest(member: _Member, default: float) -> float:
    """When the member's oldest push still queued was queued (``default`` if none). The pusher thread pops that
    entry without the fan-out's lock, so it may vanish between a check and a read: read it once, or fall back."""
    try:
        return member.queued_at[0]
    except IndexError:
        return default


def _drain(member: _Member) -> None:
    """Drop every push queued for a retired member (each counted as done)."""
    while True:
        try:
            member.queue.get_nowait()
            member.queue.task_done()
        except queue.Empty:
            member.queued_at.clear()
            return


class WeightFanout:
    """Rank 0 of one two-rank sync group per worker, all on one store. Thread-safe: the learner's loop pushes while
    the launcher's calls (:meth:`replace`) change the membership."""

    def __init__(self, host: str, port: int, run_prefix: str, *, backend: str = "gloo", timeout_s: float = 300.0,
                 bucket_bytes: int = 64 << 20):
        self.host, self.port, self.run_prefix = host, port, run_prefix
        self.backend, self.timeout_s, self.bucket_bytes = backend, float(timeout_s), bucket_bytes
        try:
            self.store = bound_store(host, port, 2, timedelta(seconds=timeout_s))
        except Exception as e:
            raise SyncGroupError(f"could not bind the weight-sync store on {host}:{port}: {e}") from e
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()  # calls on self.store from the pusher threads (_forget_rendezvous)
        self._members: dict[int, _Member] = {}
        self._latest: Optional[tuple[list, int]] = None  # (snapshot, version) of the newest push
        self._streamed_version: Optional[int] = None  # version of the newest push_groups (no snapshot kept)
        self.failures: list[str] = []  # one line per retired member: who, which version, why
        self.late: list[str] = []  # members retired because they did not take a push within timeout_s
        # members retired by retire_late (the push deadline): (worker id, incarnation, why); the launcher replaces
        # them as hung (launch/hang.py)
        self.hung: list[tuple[int, int, str]] = []
        self._closing = False
        self._threads: list[threading.Thread] = []

    # ------------------------------------------------------------------------------------------- membership
    def add(self, worker_id: int, incarnation: int = 0, join: bool = True) -> None:
        """Start forming worker ``worker_id``'s group (incarnation ``incarnation``) in the background; a member of an
        older incarnation is retired first. ``join=False`` only registers it: :meth:`start` begins the wait, so the
        ``timeout_s`` deadline counts from when the learner is ready for its workers, not from its own start-up."""
        member = _Member(worker_id, incarnation, state="joining" if join else "pending")
        with self._lock:
            old = self._members.get(worker_id)
            if old is not None:
                old.state = "gone"
                old.queue.put(None)
            self._members[worker_id] = member
        if join:
            self._join(member)

    def start(self) -> None:
        """Begin forming the groups of every member added with ``join=False``."""
        with self._lock:
            pending = [m for m in self._members.values() if m.state == "pending"]
            for m in pending:
                m.state = "joining"
        for m in pending:
            self._join(m)

    def _join(self, member: _Member) -> None:
        thread = threading.Thread(target=self._form, args=(member,), daemon=True,
                                  name=f"sync-join-w{member.worker_id}g{member.incarnation}")
        self._threads.append(thread)
        thread.start()

    def remove(self, worker_id: int) -> None:
        """Worker ``worker_id`` is gone: nothing more is pushed to it (its group is abandoned, not joined)."""
        with self._lock:
            member = self._members.pop(worker_id, None)
            if member is not None:
                member.state = "gone"
                member.queue.put(None)

    def replace(self, worker_id: int, incarnation: int) -> None:
        """The launcher restarted worker ``worker_id`` as incarnation ``incarnation``: retire the old member, await the new."""
        self.add(worker_id, incarnation)

    def _member_store(self):
        """A store client of the member's own. One client serialises its calls, and the rendezvous of a member that
        never comes (a worker that died while its group formed) waits holding it until ``timeout_s``: on a shared
        client every other member's rendezvous (a replacement's, a restarted learner's workers') would wait too."""
        host = self.host.strip("[]")
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)  # a wildcard bind
        return dist.TCPStore(host, self.port, 2, False, timedelta(seconds=self.timeout_s))

    def _form(self, member: _Member) -> None:
        prefix = member_prefix(self.run_prefix, member.worker_id, member.incarnation)
        try:
            group = group_on_store(self._member_store(), self.host, self.port, 0, 2, self.backend, self.timeout_s,
                                   prefix)
        except Exception as e:
            self._fail(member, f"worker {member.worker_id} (incarnation {member.incarnation}) did not join the "
                               f"weight-sync group within {self.timeout_s:.0f}s (cluster.timeout_s): {e}")
            return
        with self._lock:
            if member.state != "joining" or self._closing:
                group.close()
                return
            member.sender = WeightSender(group, bucket_bytes=self.bucket_bytes)
            member.state = "ready"
            if self._latest is not None:
                member.put(self._latest)  # a late joiner gets the current weights before anything else
        self._pusher(member, group)

    def _pusher(self, member: _Member, group: SyncGroup) -> None:
        try:
            while True:
                item = member.queue.get()
                try:
                    if item is None or member.state != "ready":
                        return
                    snap, version = item
                    t0 = time.monotonic()
                    try:
                        if isinstance(snap, GroupStream):  # layer groups handed over while they are gathered
                            member.sender.push_lazy(snap.metas, lambda i, s=snap: s.get(id(member), i),
                                                    lambda i, s=snap: s.sent(id(member), i), version)
                        else:
                            member.sender.push(snap, version)
                        if member.last_version < 0:
                            self._forget_rendezvous(member)
                        member.last_version = version
                    except Exception as e:
                        if isinstance(snap, GroupStream):
                            snap.drop(id(member))
                        # a dead peer fails the push at once (connection reset); a live one that never joins it
                        # fails it only at the group timeout: that worker is late, not gone
                        late = time.monotonic() - t0 >= 0.9 * self.timeout_s
                        self._fail(member, f"rollout worker {member.worker_id} (incarnation {member.incarnation}) "
                                           + (f"did not take weights v{version} within {self.timeout_s:.0f}s "
                                              "(cluster.timeout_s)" if late else
                                              f"failed weight push v{version}: {type(e).__name__}: {e}"), late)
                        return
                finally:
                    if item is not None and member.queued_at:
                        member.queued_at.popleft()
                    member.queue.task_done()
        finally:
            group.close()

    def _forget_rendezvous(self, member: _Member) -> None:
        """After the member's first push both ranks are surely past the rendezvous (rank 0's group returns as soon
        as it is connected, while rank 1 may still be reading rank 0's key): its keys can go."""
        try:
            # one store client, several pusher threads: torch's store client is not safe to call from two threads
            # at once (the two calls' replies interleave on its one socket and one waits out its timeout; seen as
            # two members' first pushes ending together and one pusher stuck for the 60 s timeout)
            with self._store_lock:
                forget_rendezvous(self.store, member_prefix(self.run_prefix, member.worker_id, member.incarnation))
        except Exception as e:  # a store that cannot list or delete keys keeps them: exposure, not a failure
            log.warning("could not delete the rendezvous keys of worker %d's weight-sync group: %s",
                        member.worker_id, e)

    def _fail(self, member: _Member, why: str, late: bool = False) -> None:
        with self._lock:
            if member.state not in ("joining", "ready") or self._closing:
                return
            member.state = "failed"
            self.failures.append(why)
            if late:
                self.late.append(why)
                self.hung.append((member.worker_id, member.incarnation, why))
        _drain(member)  # so wait() does not block on a member that will never take what was queued
        log.warning("%s; the member is retired", why)

    # ------------------------------------------------------------------------------------------- pushes
    def ready(self) -> list[int]:
        with self._lock:
            return sorted(w for w, m in self._members.items() if m.state == "ready")

    def wait_joined(self, worker_ids: Iterable[int], timeout_s: Optional[float] = None) -> None:
        """Block until every listed worker has joined; raise :class:`SyncGroupError` naming those that did not."""
        want = set(worker_ids)
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            with self._lock:
                missing = sorted(w for w in want if self._members.get(w) is None
                                 or self._members[w].state != "ready")
                failed = [self._members[w] for w in missing if w in self._members
                          and self._members[w].state == "failed"]
            if not missing:
                return
            if failed or time.monotonic() > deadline:
                raise SyncGroupError(f"rollout worker(s) {missing} did not join the weight-sync group within "
                                     f"{self.timeout_s:.0f}s (cluster.timeout_s)"
                                     + (f": {self.failures[-1]}" if self.failures else ""))
            time.sleep(0.05)

    def push_async(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   version: int) -> None:
        """Snapshot ``tensors`` once and queue them for every member; members joining later get the newest."""
        named = _as_named_list(tensors)
        with torch.no_grad():
            snap = [(n, t.detach().to("cpu" if stages_on_host(self.backend) else t.device, copy=True)) for n, t in named]
        with self._lock:
            self._latest = (snap, int(version))
            for m in self._members.values():
                if m.state == "ready":
                    m.put(self._latest)

    def push_groups(self, metas: list, groups: list[list[int]], produce: Iterable[list[tuple[int, torch.Tensor]]],
                    version: int, budget_bytes: int, on_release=None) -> GroupStream:
        """Stream a push whose tensors are made group by group (asyncppo/sync/group_stream.py) to every ready member.

        ``produce`` yields the groups in order, each as ``(index, tensor)`` pairs; it is advanced only when the
        group fits ``budget_bytes`` (so the producer, e.g. a collective gather, runs in the caller's thread and
        blocks there). Returns once every group was produced; members send the rest in the background
        (:meth:`wait`). No snapshot is kept: a member joining later is :meth:`behind` until the next push.
        """
        with self._lock:
            ready = [m for m in self._members.values() if m.state == "ready"]
            by_id = {id(m): m for m in ready}  # members are unhashable dataclasses: key them by identity
            stream = GroupStream(metas, groups, by_id, budget_bytes, alive=lambda c: by_id[c].state == "ready",
                                 on_release=on_release)
            self._latest = None  # an older snapshot must never reach a late joiner as if it were current
            self._streamed_version = int(version)
            for m in ready:
                m.put((stream, int(version)))
        it = iter(produce)
        try:
            for _ in groups:
                stream.wait_room()
                stream.put(next(it))
        except BaseException as e:
            stream.abort(e)
            raise
        return stream

    def behind(self) -> list[int]:
        """Ready members that missed the last streamed push (they joined after it) and have nothing queued."""
        with self._lock:
            v = self._streamed_version
            if v is None or self._latest is not None:
                return []
            return sorted(w for w, m in self._members.items()
                          if m.state == "ready" and m.last_version < v and not m.queue.unfinished_tasks)

    def pushing(self) -> bool:
        """Some live member has a push it has not finished taking (non-blocking; what coalescing asks)."""
        with self._lock:
            return any(m.state == "ready" and m.queue.unfinished_tasks for m in self._members.values())

    def wait(self, timeout_s: Optional[float] = None) -> None:
        """Wait until every live member took every queued push. A member whose push failed at once (it died) is
        retired, not raised (module docstring); one that did not take a push within ``timeout_s`` (default: the
        group timeout) raises :class:`SyncGroupError` naming it."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        while True:
            with self._lock:
                busy = [m for m in self._members.values() if m.state == "ready" and m.queue.unfinished_tasks]
            if self.late:
                raise SyncGroupError(self.late[0])
            if not busy:
                return
            if time.monotonic() > deadline:
                names = ", ".join(str(m.worker_id) for m in busy)
                raise SyncGroupError(f"rollout worker(s) {names} did not take the weights pushed to them within "
                                     f"{self.timeout_s if timeout_s is None else timeout_s:.0f}s (cluster.timeout_s)")
            time.sleep(0.01)

    def retire_late(self, deadline_s: float) -> list[str]:
        """Wait until every live member took every queued push or has had its oldest one for ``deadline_s``
        (counted from when that push was queued, not from this call: the learner calls this before its next push,
        a step after the last one started, and a push across a slow link once took 18 s against a 10 s deadline
        without ever being late by the call's clock); retire each one still busy then, and return why (also kept in
        :attr:`hung`). Unlike :meth:`wait`, nothing is raised: the members that took the weights already hold them,
        and the late one is the launcher's to replace (``cluster.push_timeout_s``, docs/reliability.md). Its pusher
        thread may stay blocked in the broadcast until the peer is killed (the connection resets) or the group
        timeout ends it; it holds no lock and nobody waits for it."""
        called = time.monotonic()

        def due(m: _Member) -> float:
            return _oldest(m, called) + deadline_s

        while True:
            with self._lock:
                busy = [m for m in self._members.values() if m.state == "ready" and m.queue.unfinished_tasks]
            if not busy:
                return []
            now = time.monotonic()
            if all(now > due(m) for m in busy):
                break
            time.sleep(0.01)
        return self._retire(busy, deadline_s)

    def retire_overdue(self, deadline_s: float) -> list[str]:
        """Retire, without waiting, every live member whose oldest queued push was queued more than ``deadline_s``
        ago; return why. The learner calls this while it waits for a batch: :meth:`retire_late` runs only between
        two steps, and a batch that needs the late worker's own groups (tickets are trained in order) is not
        complete until that worker has the weights, so across a stalled link the step never came and the push
        deadline never fired (the run waited for ``cluster.timeout_s``)."""
        now = time.monotonic()
        with self._lock:
            late = [m for m in self._members.values() if m.state == "ready" and m.queue.unfinished_tasks
                    and now - _oldest(m, now) > deadline_s]
        return self._retire(late, deadline_s) if late else []

    def _retire(self, members: list, deadline_s: float) -> list[str]:
        retired = []
        for m in members:
            why = (f"rollout worker {m.worker_id} (incarnation {m.incarnation}) did not take the weights pushed to it "
                   f"within {deadline_s:.0f}s (cluster.push_timeout_s); it last took v{m.last_version}")
            with self._lock:
                if m.state != "ready":
                    continue
                m.state = "failed"
                self.failures.append(why)
                self.hung.append((m.worker_id, m.incarnation, why))
            _drain(m)  # what is queued behind the stuck push will never be taken
            log.warning("%s; the member is retired", why)
            retired.append(why)
        return retired

    def versions(self) -> dict[int, int]:
        """The last version each live member took (-1: none yet)."""
        with self._lock:
            return {w: m.last_version for w, m in self._members.items() if m.state == "ready"}

    def close(self, join_s: float = 5.0) -> None:
        """Retire every member; give their threads ``join_s`` to leave (a thread blocked in a broadcast to a peer
        that is gone leaves when the broadcast fails; one still blocked after that is left to its timeout)."""
        with self._lock:
            self._closing = True
            members = list(self._members.values())
            self._members.clear()
        for m in members:
            m.state = "gone"
            m.queue.put(None)
        deadline = time.monotonic() + join_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
