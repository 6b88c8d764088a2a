"""A dedicated process group for weight broadcast, built without touching the default group.

Why not ``torch.distributed.init_process_group``: in the same processes vLLM (rollout) and FSDP (learner) each
own the *default* group, and a process can hold only one. So the learner's rank 0 hosts its own ``TCPStore`` and
every rank constructs the backend's ``ProcessGroup`` directly on that store (under a private key prefix). The
result is used only through :class:`SyncGroup`, which knows its device (CPU for gloo, the current CUDA device for
NCCL) so that callers never have to think about where a broadcast buffer must live.

Failures to meet (nobody listening, a wrong host, a worker that never joins) become :class:`SyncGroupError`
naming the address, the rank and the timeout, instead of torch's generic store errors.

Exposure. torch's ``TCPStore`` server listens on *every* interface whatever host it is given. So rank 0 binds the
listening socket itself, on exactly ``host`` (``cluster.bind_address``), and hands it to the store
(``master_listen_fd``; torch then owns and closes it). gloo's own pair sockets bind to the address the machine's
hostname resolves to unless told otherwise: on a loopback store every rank's gloo device is pinned to that loopback
address, rank 0's to ``host`` when that is a specific address, and another rank's to its own address on the route
to ``host`` (unless ``GLOO_SOCKET_IFNAME`` says otherwise). The store has no authentication (torch offers
none): ``store_prefix`` puts the group's keys under a per-run secret prefix, so a stranger who reaches the port
cannot guess the rendezvous keys; what remains is listed in docs/security.md.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist

from asyncppo.sync import shm as shm_path

BACKENDS = ("gloo", "nccl", "shm")  # shm: gloo signals + a shared-memory segment (sync/shm.py), for one device
_STORE_PREFIX = "asyncppo/weight-sync"


class SyncGroupError(RuntimeError):
    """The weight-sync group could not be formed (timeout, unreachable or invalid address, bad arguments)."""


@dataclass
class SyncGroup:
    """A formed weight-sync group: the backend process group plus what callers need to use it."""

    pg: Any  # torch.distributed ProcessGroupGloo / ProcessGroupNCCL
    rank: int
    world_size: int
    backend: str
    device: torch.device
    address: str  # "host:port" of the store, for error messages
    timeout_s: float
    store: Any = field(repr=False, default=None)  # kept alive: rank 0's store serves the others
    shm: Optional[shm_path.ShmChannel] = field(repr=False, default=None)  # backend "shm": the bytes' path

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` (contiguous, on :attr:`device`) from ``src`` in place, and wait for it."""
        try:
            if self.shm is not None:
                self.shm.broadcast(tensor, src)
            else:
                self._pg_broadcast(tensor, src)
        except RuntimeError as e:
            raise SyncGroupError(
                f"weight-sync broadcast failed (rank {self.rank}/{self.world_size}, store {self.address}, "
                f"backend {self.backend}, timeout {self.timeout_s}s): {e}"
            ) from e

    def _pg_broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.pg.broadcast([tensor], _bcast_opts(src)).wait()

    def _meet(self) -> None:
        """Every rank reaches this point (a one-element all-reduce: gloo has no cheaper barrier with a deadline)."""
        self.pg.allreduce([torch.zeros(1)]).wait()

    def close(self) -> None:
        """Release the backend's connections; the group is unusable afterwards."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            try:
                shutdown()
            except Exception:  # closing must not mask whatever made the caller close
                pass
        self.pg = None
        self.store = None


def _bcast_opts(src: int):
    opts = dist.BroadcastOptions()
    opts.rootRank = src
    opts.rootTensor = 0
    return opts


def stages_on_host(backend: str) -> bool:
    """Whether a push's tensors travel from host memory (gloo, and shm's segment), so snapshots go to the CPU."""
    return backend in ("gloo", "shm")


def backend_for(learner_on_gpu: bool, engines_on_gpu: bool) -> str:
    """NCCL when both the learner and the engines hold GPUs, gloo otherwise (every rank must use the same)."""
    return "nccl" if learner_on_gpu and engines_on_gpu else "gloo"


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"


def _is_wildcard(host: str) -> bool:
    return host.strip("[]") in ("0.0.0.0", "::", "")


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to exactly ``host:port`` and listening (what a store server should own)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


def bound_store(host: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """A ``TCPStore`` server listening on ``host:port`` only (torch alone would listen on every interface)."""
    sock = listen_socket(host, port)
    fd = sock.detach()  # the store owns the descriptor from here on and closes it when it is destroyed
    try:
        return dist.TCPStore(host.strip("[]"), port, world_size, True, timeout, wait_for_workers=False,
                             master_listen_fd=fd, use_libuv=True)
    except Exception:
        os.close(fd)
        raise


def local_address_towards(host: str, port: int) -> Optional[str]:
    """This machine's address on the route to ``host`` (the interface a connection to it would leave by), or None.
    A UDP ``connect`` only consults the routing table: no packet is sent."""
    h = host.strip("[]")
    family = socket.AF_INET6 if ":" in h else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((h, port))
            return str(s.getsockname()[0])
    except OSError:
        return None


def _gloo_options(host: str, rank: int, timeout: timedelta, port: int = 9):
    """Pin gloo's listening device to the right address for this rank (module docstring); None: gloo's default
    device. Rank 0 and every rank of a loopback store: ``host``. Another rank of a store on another machine: its own
    address on the route to ``host``. gloo's default there is the address the machine's hostname resolves to, which
    on many hosts (and in containers) is ``127.0.0.1``: the rank would listen where its peer cannot reach it (seen
    across two hosts, tests/e2e/test_two_hosts.py). ``GLOO_SOCKET_IFNAME``, when set, is the user's choice: left
    to gloo."""
    if _is_wildcard(host):
        return None
    if _is_loopback(host) or rank == 0:
        address = host.strip("[]")
    elif os.environ.get("GLOO_SOCKET_IFNAME"):
        return None
    else:
        address = local_address_towards(host, port)
        if address is None:
            return None
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return opts


def loopback_interface(host: str) -> Optional[str]:
    """The name of the loopback interface (``lo`` on Linux) when ``host`` is a loopback address, else None: what
    ``GLOO_SOCKET_IFNAME`` needs to keep a default process group's gloo sockets on loopback."""
    if not _is_loopback(host):
        return None
    for _, name in socket.if_nameindex():
        if name == "lo" or name.startswith("lo0"):
            return name
    return None


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (bind to port 0 and read what the OS chose).

    There is an unavoidable race between closing this probe socket and the store binding the port; it is only
    a convenience for tests and single-machine launches.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def make_sync_group(
    host: str,
    port: int,
    rank: int,
    world_size: int,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    store_prefix: str = "",
) -> SyncGroup:
    """Join (rank 0: host) the weight-sync group at ``host:port``; blocks until all ``world_size`` ranks joined.

    Rank 0 is the learner: it binds the ``TCPStore`` on ``host:port`` (``host`` is then the address to bind, e.g.
    ``0.0.0.0`` or ``127.0.0.1``). Other ranks connect to it. ``timeout_s`` bounds both the meeting and every later
    broadcast (a rank that never joins a broadcast makes the others fail after ``timeout_s``). ``store_prefix``: a
    per-run secret every rank must pass alike (the launcher hands it out with the endpoints).
    """
    if backend not in BACKENDS:
        raise SyncGroupError(f"backend={backend!r} is not supported; allowed: {', '.join(BACKENDS)}")
    if not isinstance(world_size, int) or world_size < 1:
        raise SyncGroupError(f"world_size={world_size!r} must be an int >= 1")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise SyncGroupError(f"rank={rank!r} must be an int in [0, {world_size})")
    if not isinstance(port, int) or not 0 < port < 65536:
        raise SyncGroupError(f"port={port!r} must be an int in [1, 65535]")
    if timeout_s <= 0:
        raise SyncGroupError(f"timeout_s={timeout_s!r} must be > 0")
    address = f"{host}:{port}"
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl" and not torch.cuda.is_available():
        raise SyncGroupError(f"backend='nccl' needs CUDA, which this process does not have (store {address})")

    who = f"rank {rank}/{world_size}"
    try:
        if rank == 0:
            store = bound_store(host, port, world_size, timeout)
        else:
            store = dist.TCPStore(host.strip("[]"), port, world_size, False, timeout)
    except Exception as e:  # DistNetworkError, DistStoreError, socket.gaierror, TimeoutError ...
        if rank == 0:
            msg = f"could not bind the weight-sync store on {address} ({who}): {e}"
        else:
            msg = (f"could not reach the weight-sync store at {address} within {timeout_s}s ({who}); "
                   f"is the learner (rank 0) running and the address right? ({type(e).__name__}: {e})")
        raise SyncGroupError(msg) from e
    return group_on_store(store, host, port, rank, world_size, backend, timeout_s, store_prefix)


def forget_rendezvous(store: Any, store_prefix: str) -> int:
    """Delete a formed group's rendezvous keys from rank 0's store; how many. Once every rank is connected nothing
    reads them again, and while they stay a stranger who reaches the store port reads them with ``list_keys`` (torch's
    store lists its keys to any client), the run's secret prefix in their names included (docs/security.md, "Across
    two hosts"). What remains visible is the rendezvous of a group while it forms."""
    head = f"{_STORE_PREFIX}/{store_prefix}/" if store_prefix else f"{_STORE_PREFIX}/"
    gone = 0
    for key in store.list_keys():
        if key.startswith(head):
            store.delete_key(key)
            gone += 1
    return gone


# How every weight-sync NCCL group handles a peer that stops (docs/reliability.md, "NCCL and gloo"), read by
# ProcessGroupNCCL when it is constructed: CleanUpOnly (2) aborts the group's communicator on a timeout or a peer's
# error and raises in the caller, and the process lives on; torch's default (3, SkipCleanUp) tears the whole process
# down, so one wedged engine would kill the learner. Blocking wait makes the pusher thread's wait() block on the
# collective and raise at the group timeout, instead of returning while the GPU stream is stuck.
NCCL_SYNC_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "TORCH_NCCL_BLOCKING_WAIT": "1"}
_NCCL_ENV_LOCK = threading.Lock()  # the fan-out forms groups from several threads; the environment is shared


def _nccl_group(prefixed: Any, rank: int, world_size: int, timeout: timedelta) -> Any:
    """A ProcessGroupNCCL with the group timeout and :data:`NCCL_SYNC_ENV`, set for its construction only (the
    learner ranks' own FSDP group keeps torch's defaults)."""
    with _NCCL_ENV_LOCK:
        saved = {k: os.environ.get(k) for k in NCCL_SYNC_ENV}
        os.environ.update(NCCL_SYNC_ENV)
        try:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, opts)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def group_on_store(store: Any, host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float,
                   store_prefix: str = "") -> SyncGroup:
    """Form a group on an existing store (rank 0 may serve many groups from one store, each under its own
    ``store_prefix``: :class:`asyncppo.sync.fanout.WeightFanout` forms one two-rank group per rollout worker)."""
    address, timeout, who = f"{host}:{port}", timedelta(seconds=timeout_s), f"rank {rank}/{world_size}"
    prefixed = dist.PrefixStore(f"{_STORE_PREFIX}/{store_prefix}" if store_prefix else _STORE_PREFIX, store)

    segment = ""
    if backend == "shm":  # rank 0 makes the segment before the pair forms, so rank 1 finds it once it has
        segment = shm_path.segment_path(store_prefix or str(port))  # both ranks know it; the host may differ
        if rank == 0:
            shm_path.create_segment(segment)
    try:
        if backend in ("gloo", "shm"):
            gloo_opts = _gloo_options(host, rank, timeout, port)
            pg = (dist.ProcessGroupGloo(prefixed, rank, world_size, timeout) if gloo_opts is None
                  else dist.ProcessGroupGloo(prefixed, rank, world_size, gloo_opts))
            device = torch.device("cpu")
        else:
            pg = _nccl_group(prefixed, rank, world_size, timeout)
            device = torch.device("cuda", torch.cuda.current_device())
    except Exception as e:
        if segment and rank == 0:
            shm_path.discard_segment(segment)
        raise SyncGroupError(
            f"the weight-sync group at {address} did not form within {timeout_s}s ({who}, backend {backend}): "
            f"not every one of the {world_size} ranks joined ({type(e).__name__}: {e})"
        ) from e
    group = SyncGroup(pg=pg, rank=rank, world_size=world_size, backend=backend, device=device,
                      address=address, timeout_s=float(timeout_s), store=store)
    if backend == "shm":
        try:
            group.shm = shm_path.attach(rank, segment, group._pg_broadcast, group._meet)
        except (OSError, RuntimeError) as e:
            group.close()
            raise SyncGroupError(f"the shared-memory segment {segment} of the weight-sync group at {address} could "
                                 f"not be mapped ({who}): {e}; set ASYNCPPO_SHM_DIR to a writable local "
                                 "directory") from e
    if backend == "nccl":
        # NCCL connects lazily; a first tiny broadcast makes a missing rank fail here, with the address, not
        # in the middle of the first weight push.
        group.broadcast(torch.zeros(1, device=device))
    return group
