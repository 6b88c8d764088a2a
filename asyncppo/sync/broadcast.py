"""Sender (learner rank 0) and receivers (engines) of a bucketed weight broadcast over a :class:`SyncGroup`.

Why buckets: broadcasting tensor by tensor costs one round of latency per tensor (hundreds per model), while one
flat buffer of the whole model doubles peak memory. Fixed-size buckets bound the extra memory on both sides to
one bucket (plus, on a receiver that returns everything, the received model itself) at a handful of messages.

Why a background push: the learner can start its next step while the previous weights stream out. The tensors
are snapshotted first (a copy on the group's device), so the optimiser may change the live parameters at once.
Pushes are strictly ordered and at most one is in flight, so at most one snapshot exists.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from asyncppo.sync.group import SyncGroup
from asyncppo.sync.layout import (
    Header,
    TensorMeta,
    WeightSyncProtocolError,
    check_preamble,
    decode_header,
    encode_header,
    meta_of,
    plan_buckets,
    preamble,
)

NamedTensors = list[tuple[str, torch.Tensor]]
OnBucket = Callable[[NamedTensors], None]
OnHeader = Callable[[Header], None]


class WeightSyncError(RuntimeError):
    """A push or receive failed (the original error is chained)."""


@dataclass(frozen=True)
class TransferStats:
    """One push or receive: what moved and how long it took."""

    version: int
    num_tensors: int
    num_buckets: int
    payload_bytes: int  # tensor bytes (no alignment padding)
    wire_bytes: int  # bytes broadcast: preamble + header + buckets
    max_bucket_bytes: int
    header_bytes: int
    seconds: float  # the broadcast itself, header to last bucket
    snapshot_seconds: float = 0.0  # push_async only: copying the tensors before returning


def _as_named_list(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> NamedTensors:
    items = list(tensors.items()) if isinstance(tensors, Mapping) else list(tensors)
    seen = set()
    for k, item in enumerate(items):
        if not (isinstance(item, tuple) and len(item) == 2):
            raise TypeError(f"weights[{k}] must be a (name, tensor) pair, got {type(item).__name__}")
        name, t = item
        if not isinstance(name, str) or not name:
            raise TypeError(f"weights[{k}] name={name!r} must be a non-empty string")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights[{k}] ({name!r}) must be a torch.Tensor, got {type(t).__name__}")
        if name in seen:
            raise ValueError(f"weights[{k}] name {name!r} appears twice")
        seen.add(name)
    return items


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


class WeightSender:
    """Broadcasts named tensors from rank 0 of ``group`` in buckets of at most ``bucket_bytes`` bytes."""

    def __init__(self, group: SyncGroup, bucket_bytes: int = 64 << 20, history: int = 1000):
        if group.rank != 0:
            raise ValueError(f"WeightSender must run on rank 0 of the sync group, this is rank {group.rank}")
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1024:
            raise ValueError(f"bucket_bytes={bucket_bytes!r} must be an int >= 1024")
        self.group = group
        self.bucket_bytes = bucket_bytes
        self.history: deque[TransferStats] = deque(maxlen=history)
        self._buffer: torch.Tensor | None = None  # the one staging bucket, reused across pushes
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # one push on the wire at a time

    @property
    def stats(self) -> TransferStats | None:
        """The last completed push (``history`` holds the recent ones)."""
        return self.history[-1] if self.history else None

    # ---------------------------------------------------------------------------------------------------------
    def push(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], version: int) -> \
            TransferStats:
        """Broadcast ``tensors`` as ``version`` and return when every bucket is out (waits for a pending push)."""
        self.wait()
        named = _as_named_list(tensors)
        with torch.no_grad():
            return self._push(named, self._check_version(version), 0.0)

    def push_async(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                   version: int) -> None:
        """Snapshot ``tensors`` and broadcast them on a background thread; :meth:`wait` joins it.

        A previous push is waited for first (errors from it are raised here), so pushes stay in order and at most
        one snapshot is alive.
        """
        self.wait()
        version = self._check_version(version)
        named = _as_named_list(tensors)
        t0 = time.perf_counter()
        with torch.no_grad():
            snap = [(n, t.detach().to(self.group.device, copy=True)) for n, t in named]
        if self.group.device.type == "cuda":
            torch.cuda.current_stream(self.group.device).synchronize()
        snap_s = time.perf_counter() - t0

        def run() -> None:
            try:
                if self.group.device.type == "cuda":
                    torch.cuda.set_device(self.group.device)
                with torch.no_grad():
                    self._push(snap, version, snap_s)
            except BaseException as e:  # handed to wait()
                self._error = e

        self._thread = threading.Thread(target=run, name=f"weight-push-v{version}", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the background push (if any) finished; re-raise its error as :class:`WeightSyncError`."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
            if thread.is_alive():
                raise TimeoutError(f"weight push still running after {timeout_s}s")
            self._thread = None
        if self._error is not None:
            err, self._error = self._error, None
            raise WeightSyncError(f"background weight push failed: {err}") from err

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------------------------------------------------
    @staticmethod
    def _check_version(version: int) -> int:
        if not isinstance(version, int) or isinstance(version, bool) or version < 0:
            raise ValueError(f"version={version!r} must be an int >= 0")
        return version

    def push_lazy(self, metas: Sequence[TensorMeta], get: Callable[[int], torch.Tensor],
                  sent: Callable[[int], None] | None = None, version: int = 0) -> TransferStats:
        """Broadcast tensors that need not exist yet: the header comes from ``metas``; ``get(i)`` returns tensor
        ``i`` when its first byte is packed (indices rise; it may block until the tensor exists), and ``sent(i)``
        is called once every byte of tensor ``i`` is copied into the staging bucket, so the caller may free it.
        Why at packing, not after the broadcast: a bucket may hold the tail of one layer group and the head of the
        next, and a producer that frees a group only after its broadcast would wait for a bucket that waits for
        it. This is how a layer-group gather streams without holding the whole model (learner/gather.py)."""
        self.wait()
        with torch.no_grad():
            return self._push(None, self._check_version(version), 0.0, tuple(metas), get, sent)

    def _push(self, named: NamedTensors | None, version: int, snapshot_s: float,
              metas: tuple[TensorMeta, ...] | None = None, get: Callable[[int], torch.Tensor] | None = None,
              sent: Callable[[int], None] | None = None) -> TransferStats:
        if named is not None:
            metas = tuple(meta_of(n, t) for n, t in named)
            get = lambda i: named[i][1]  # noqa: E731
        with self._lock:
            g = self.group
            header = Header(version=version, bucket_bytes=self.bucket_bytes, tensors=metas)
            plan = plan_buckets(header.tensors, self.bucket_bytes)
            raw = encode_header(header)
            t0 = time.perf_counter()
            g.broadcast(preamble(len(raw)).to(g.device))
            g.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(g.device))
            max_bucket = max((b.nbytes for b in plan), default=0)
            if self._buffer is None or self._buffer.numel() < max_bucket:
                self._buffer = torch.empty(max_bucket, dtype=torch.uint8, device=g.device)
            buf = self._buffer
            views: dict[int, torch.Tensor] = {}  # byte view of a tensor being sent in chunks
            wire = 24 + len(raw)
            for bucket in plan:
                for p in bucket.pieces:
                    src = views.get(p.index)
                    if src is None:
                        src = _byte_view(get(p.index))
                        if bucket.chunk:
                            views[p.index] = src
                    buf[p.offset:p.offset + p.nbytes].copy_(src[p.src_start:p.src_start + p.nbytes])
                    if p.index in bucket.complete:
                        views.pop(p.index, None)
                        src = None
                        if sent is not None:  # its bytes are in the staging bucket: the source may go now
                            sent(p.index)
                g.broadcast(buf[:bucket.nbytes])
                wire += bucket.nbytes
            stats = TransferStats(version=version, num_tensors=len(metas), num_buckets=len(plan),
                                  payload_bytes=header.payload_bytes, wire_bytes=wire, max_bucket_bytes=max_bucket,
                                  header_bytes=len(raw), seconds=time.perf_counter() - t0,
                                  snapshot_seconds=snapshot_s)
            self.history.append(stats)
            return stats


class WeightReceiver:
    """Receives pushes from rank 0 of ``group`` (call :meth:`receive` when the learner announced a version)."""

    def __init__(self, group: SyncGroup, history: int = 1000):
        if group.rank == 0:
            raise ValueError("WeightReceiver cannot run on rank 0: rank 0 is the sender")
        self.group = group
        self.history: deque[TransferStats] = deque(maxlen=history)
        self.version: int | None = None  # the last version received

    @property
    def stats(self) -> TransferStats | None:
        return self.history[-1] if self.history else None

    def receive(self, on_bucket: OnBucket | None = None, on_header: OnHeader | None = None) -> \
            tuple[int, NamedTensors | None]:
        """Join the next push; return ``(version, tensors)``, or ``(version, None)`` when ``on_bucket`` is given.

        ``on_header(header)`` (optional) sees every name, dtype and shape before any data arrives. ``on_bucket``
        gets the tensors completed by each bucket, in push order, as soon as the bucket is in; the tensors are
        views of a buffer allocated for that bucket, so memory stays bounded when the callback copies them out and
        drops them (as an engine load does). Tensors are on the group's device (CPU for gloo).
        """
        g = self.group
        t0 = time.perf_counter()
        pre = torch.empty(3, dtype=torch.int64, device=g.device)
        g.broadcast(pre)
        length = check_preamble([int(x) for x in pre.cpu().tolist()])
        raw = torch.empty(length, dtype=torch.uint8, device=g.device)
        g.broadcast(raw)
        header = decode_header(raw.cpu().numpy().tobytes())
        plan = plan_buckets(header.tensors, header.bucket_bytes)
        if on_header is not None:
            on_header(header)
        metas = header.tensors
        out: NamedTensors | None = [] if on_bucket is None else None
        pending: dict[int, torch.Tensor] = {}  # tensors arriving in chunks, received straight into place
        wire, max_bucket = 24 + length, 0
        for bucket in plan:
            if bucket.chunk:
                (p,) = bucket.pieces
                dst = pending.get(p.index)
                if dst is None:
                    m = metas[p.index]
                    dst = pending[p.index] = torch.empty(m.shape, dtype=m.torch_dtype, device=g.device)
                g.broadcast(dst.reshape(-1).view(torch.uint8)[p.src_start:p.src_start + p.nbytes])
                done = [(metas[i].name, pending.pop(i)) for i in bucket.complete]
            else:
                buf = torch.empty(bucket.nbytes, dtype=torch.uint8, device=g.device)
                g.broadcast(buf)
                done = []
                for p in bucket.pieces:
                    m = metas[p.index]
                    done.append((m.name, buf[p.offset:p.offset + p.nbytes].view(m.torch_dtype).view(m.shape)))
            wire += bucket.nbytes
            max_bucket = max(max_bucket, bucket.nbytes)
            if not done:
                continue
            if on_bucket is not None:
                on_bucket(done)
            else:
                out.extend(done)
        if pending:  # cannot happen with a plan from plan_buckets; guards future edits of the layout
            raise WeightSyncProtocolError(f"push v{header.version} ended with incomplete tensors {sorted(pending)}")
        self.version = header.version
        self.history.append(TransferStats(
            version=header.version, num_tensors=len(metas), num_buckets=len(plan),
            payload_bytes=header.payload_bytes, wire_bytes=wire, max_bucket_bytes=max_bucket, header_bytes=length,
            seconds=time.perf_counter() - t0))
        return header.version, out
