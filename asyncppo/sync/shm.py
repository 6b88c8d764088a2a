"""The weight-sync data path between two processes on one device: a host shared-memory segment, not NCCL.

Why. ``--gpus N`` puts an engine and a learner rank on the same device, and NCCL refuses two ranks of one group on
one GPU. The two processes share the host, so the bytes of a push go through one shared-memory segment that both
map (a file in ``/dev/shm``, 0600, named from the group's secret store prefix, removed as soon as both mapped it),
and only tiny signals travel over the pair's gloo group: "chunk ready" from the sender, "chunk taken" back. Each
chunk is copied twice, into the segment and out of it, at memory speed; no byte crosses a socket.

Why not CUDA IPC handles. They would skip the host for a CUDA learner and a CUDA engine, but an IPC handle pins the
sender's allocation until the receiver releases it (so a push would hold a second copy of the weights inside the
learner's share of the device), it needs the two processes to agree on CUDA streams and events, and it cannot be
run on CPU, so the path CI exercises would not be the one GPUs use. The segment works the same on CPU and CUDA;
on CUDA it is page-locked (``cudaHostRegister``) so device <-> segment copies are DMA transfers.

Protocol for one :meth:`ShmChannel.broadcast` of a tensor of ``n`` bytes, in chunks of the segment's size: the
sender copies a chunk in, broadcasts its length (int64, gloo), every receiver copies it out, then all ranks meet in a
one-element all-reduce before the sender may overwrite the segment. Small tensors (the preamble and header of
sync/layout.py) go over gloo directly. Every gloo call carries the group's deadline, so a peer that died leaves the
other side with a timeout error that names the group, never a hang.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from typing import Callable

import torch

SEGMENT_BYTES = 64 << 20  # one chunk in flight: what each shared device pays in host memory per engine
DIRECT_BYTES = 1 << 16  # tensors below this go over gloo as they are (a push's preamble and header)


def segment_dir() -> str:
    """``ASYNCPPO_SHM_DIR`` if set, else ``/dev/shm`` (memory-backed), else the temporary directory."""
    chosen = os.environ.get("ASYNCPPO_SHM_DIR")
    if chosen:
        return chosen
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def segment_path(store_prefix: str) -> str:
    """Both ranks derive the segment's name from the group's secret store prefix (sync/fanout.py), so a stranger
    cannot guess it and every worker incarnation gets its own."""
    digest = hashlib.sha256(f"asyncppo-shm/{store_prefix}".encode()).hexdigest()[:24]
    return os.path.join(segment_dir(), f"asyncppo-sync-{digest}")


def create_segment(path: str, nbytes: int = 0) -> None:
    """Rank 0: make the segment file (exclusive, owner-only) of ``nbytes`` (0: :data:`SEGMENT_BYTES`); a leftover of
    a crashed run is replaced."""
    nbytes = nbytes or SEGMENT_BYTES
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
    finally:
        os.close(fd)


def discard_segment(path: str) -> None:
    """Remove the segment's name (mappings stay valid until their processes drop them)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def map_segment(path: str) -> torch.Tensor:
    """A uint8 tensor over the whole segment, shared with every process that maps the same file."""
    nbytes = os.path.getsize(path)
    return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)


def _page_lock(seg: torch.Tensor) -> bool:
    """On a CUDA machine, register the mapping as page-locked host memory so copies to and from the device are DMA;
    without CUDA, or if the driver refuses, the copies are plain ones. Returns whether it is registered."""
    if not torch.cuda.is_available():
        return False
    try:
        # cudaHostRegisterDefault = 0; the binding returns the CUDA error code (0: success) rather than raising
        return int(torch.cuda.cudart().cudaHostRegister(seg.data_ptr(), seg.numel(), 0)) == 0
    except Exception:  # optional speed-up only: pageable copies are correct, just slower
        return False


def _page_unlock(seg: torch.Tensor) -> None:
    """Undo :func:`_page_lock` before the mapping goes, so the driver keeps no registration of freed memory."""
    try:
        torch.cuda.cudart().cudaHostUnregister(seg.data_ptr())
    except Exception:  # the mapping goes anyway; a leftover registration only costs the driver a table entry
        pass


class ShmChannel:
    """The segment plus the two signals, bound to one group's rank (module docstring)."""

    def __init__(self, segment: torch.Tensor, rank: int, signal: Callable[[torch.Tensor, int], None],
                 meet: Callable[[], None], path: str = ""):
        self.segment, self.rank, self.path = segment, rank, path
        self._signal, self._meet = signal, meet
        self.bytes_moved = 0
        self.page_locked = _page_lock(segment)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """``tensor`` (contiguous) from ``src`` to every rank, in place, through the segment."""
        flat = tensor.reshape(-1).view(torch.uint8)
        total = flat.numel()
        if total < DIRECT_BYTES:
            self._signal(tensor, src)
            return
        step = self.segment.numel()
        length = torch.zeros(1, dtype=torch.int64)
        for start in range(0, total, step):
            n = min(step, total - start)
            if self.rank == src:
                self.segment[:n].copy_(flat[start:start + n])
                length[0] = n
            self._signal(length, src)  # "chunk ready": receivers wait here for the sender's copy
            if int(length[0]) != n:
                raise RuntimeError(f"shared-memory weight sync: chunk of {int(length[0])} bytes announced where "
                                   f"{n} were expected (offset {start} of {total}); the peers disagree on the tensor")
            if self.rank != src:
                flat[start:start + n].copy_(self.segment[:n])
            self._meet()  # "chunk taken": the sender may overwrite the segment
        self.bytes_moved += total

    def close(self) -> None:
        if self.page_locked and self.segment is not None:
            _page_unlock(self.segment)
        self.segment = None
        if self.rank == 0 and self.path:
            discard_segment(self.path)


def attach(rank: int, path: str, signal: Callable[[torch.Tensor, int], None], meet: Callable[[], None]) -> ShmChannel:
    """Both ranks, once the gloo pair has formed (rank 0 created the file before forming it): map the segment, meet,
    then rank 0 removes the name, so nothing is left in ``/dev/shm`` whatever happens to the processes later."""
    segment = map_segment(path)
    meet()
    if rank == 0:
        discard_segment(path)
    return ShmChannel(segment, rank, signal, meet, path if rank == 0 else "")
