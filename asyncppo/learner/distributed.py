"""Several learner ranks training one policy: the rank group, batch transport and the follower loop.

Why this shape. Rank 0 is the only rank that talks to the rollout side (sockets, staleness buffer, weight push), so
every other rank is a *follower* that does exactly what rank 0 tells it, in the same order, because every FSDP
forward/backward and every gather is a collective that all ranks must enter together. Rank 0 announces each command
with a fixed-size int64 header broadcast (``OP_BATCH`` + field shapes/dtypes, ``OP_GATHER``, ``OP_STOP``); a batch
follows as a few flat tensor broadcasts, one per dtype. Nothing is pickled: a follower only ever interprets integers.

Which work each rank does on a batch, and why the sharded update equals one rank's: learner/sharding.py.

FSDP2 (``fully_shard``) works on CPU with gloo in torch 2.13, so the CPU tests run the same gradient path as GPUs.
"""

from __future__ import annotations

import os
from dataclasses import fields
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch import nn

from asyncppo.learner.batch import TrainBatch
from asyncppo.sync.group import bound_store, loopback_interface

OP_BATCH, OP_GATHER, OP_STOP, OP_CHECKPOINT = 1, 2, 3, 4
_MAGIC, _PROTOCOL = 0x41505031, 1  # "APP1"
# the ints (prompt_len in the header; pack_capacity, which each rank sets from its own options) do not travel
_TENSOR_FIELDS = tuple(f.name for f in fields(TrainBatch) if f.name not in ("prompt_len", "pack_capacity"))
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
           torch.bool, torch.int16)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_MAX_DIMS = 4  # routed_experts is [B, P + T, layers, top_k]
_PER_FIELD = 3 + _MAX_DIMS  # present, dtype code, ndim, dims
_HEADER_LEN = 6 + len(_TENSOR_FIELDS) * _PER_FIELD  # magic, protocol, op, arg, prompt_len, n_fields + fields


class LearnerGroupError(RuntimeError):
    """The learner ranks could not form their group, or a rank received something it cannot interpret."""


class LearnerStopped(Exception):
    """Raised on a follower by :func:`broadcast_batch` when rank 0 broadcast a stop instead of a batch."""


# ---------------------------------------------------------------------------------------------------------------
# the group
def init_learner_group(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    backend: Optional[str] = None,
    *,
    timeout_s: float = 600.0,
    local_rank: Optional[int] = None,
    bind_host: Optional[str] = None,
) -> torch.device:
    """Initialise the *default* process group of the learner ranks and return this rank's device.

    ``backend`` defaults to nccl when CUDA is available, else gloo. With nccl the CUDA device is the local rank's
    (``local_rank``, else ``$LOCAL_RANK``, else ``rank % device_count``: under Ray each actor usually sees one GPU).
    ``timeout_s`` bounds the meeting and every later collective, so a lost rank fails the others loudly.

    Rank 0 hosts the rendezvous ``TCPStore`` listening on ``bind_host`` only (default ``master_addr``; torch's own
    ``tcp://`` init would listen on every interface, see :func:`asyncppo.sync.group.bound_store`). With gloo and no
    ``GLOO_SOCKET_IFNAME`` set, a loopback ``master_addr`` also pins gloo's pair sockets to the loopback interface.
    """
    if not 0 <= rank < world_size:
        raise LearnerGroupError(f"rank={rank} must be in [0, world_size={world_size})")
    if dist.is_initialized():
        raise LearnerGroupError("the default process group is already initialised in this process; call destroy()")
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("nccl", "gloo"):
        raise LearnerGroupError(f"backend={backend!r} is not supported; allowed: nccl, gloo")
    device = torch.device("cpu")
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise LearnerGroupError("backend='nccl' needs CUDA, which this process does not have")
        index = local_rank
        if index is None:
            index = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    host = f"[{master_addr}]" if ":" in master_addr else master_addr
    url = f"tcp://{host}:{master_port}"
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo" and "GLOO_SOCKET_IFNAME" not in os.environ:
        ifname = loopback_interface(master_addr)
        if ifname is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    try:
        if rank == 0:
            store = bound_store(bind_host or master_addr, master_port, world_size, timeout)
        else:
            store = dist.TCPStore(master_addr, master_port, world_size, False, timeout)
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
            device_id=device if backend == "nccl" else None,
        )
    except Exception as e:  # DistNetworkError, DistStoreError, TimeoutError ...
        raise LearnerGroupError(
            f"learner rank {rank}/{world_size} could not form the learner group at {url} within {timeout_s}s "
            f"(backend {backend}); are all {world_size} learner ranks started and the address reachable? "
            f"({type(e).__name__}: {e})"
        ) from e
    return device


def destroy() -> None:
    """Leave the learner group (idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


# ---------------------------------------------------------------------------------------------------------------
# commands and batches from rank 0
def _broadcast_header(op: int, arg: int = 0, batch: Optional[TrainBatch] = None, src: int = 0) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
    header[:6] = torch.tensor([_MAGIC, _PROTOCOL, op, arg, batch.prompt_len if batch else 0, len(_TENSOR_FIELDS)])
    if batch is not None:
        for i, name in enumerate(_TENSOR_FIELDS):
            value = getattr(batch, name)
            if value is None:
                continue
            if value.dim() > _MAX_DIMS or value.dtype not in _DTYPE_CODE:
                raise ValueError(f"broadcast_batch: field {name} has shape {tuple(value.shape)} and dtype "
                                 f"{value.dtype}; allowed: at most {_MAX_DIMS} dims, dtypes {list(_DTYPE_CODE)}")
            base = 6 + i * _PER_FIELD
            header[base : base + 3] = torch.tensor([1, _DTYPE_CODE[value.dtype], value.dim()])
            header[base + 3 : base + 3 + value.dim()] = torch.tensor(value.shape)
    header = header.to(comm_device())
    dist.broadcast(header, src=src)
    return header.cpu()


def _receive_header(src: int = 0) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=comm_device())
    dist.broadcast(header, src=src)
    header = header.cpu()
    magic, protocol, op, _, _, n_fields = header[:6].tolist()
    if magic != _MAGIC or protocol != _PROTOCOL or n_fields != len(_TENSOR_FIELDS):
        raise LearnerGroupError(
            f"learner command header not understood: magic={magic:#x} protocol={protocol} fields={n_fields} "
            f"(expected {_MAGIC:#x}, {_PROTOCOL}, {len(_TENSOR_FIELDS)}): ranks run different code versions?"
        )
    if op not in (OP_BATCH, OP_GATHER, OP_STOP, OP_CHECKPOINT):
        raise LearnerGroupError(f"learner command op={op} unknown; allowed: {OP_BATCH}, {OP_GATHER}, {OP_STOP}, "
                                f"{OP_CHECKPOINT}")
    return header


def _batch_payload(header: torch.Tensor, batch: Optional[TrainBatch], src: int) -> TrainBatch:
    """Broadcast the tensors described by ``header``, one flat buffer per dtype (few collectives, bit-exact)."""
    device = comm_device()
    specs = []
    for i, name in enumerate(_TENSOR_FIELDS):
        present, code, ndim, *dims = header[6 + i * _PER_FIELD : 6 + (i + 1) * _PER_FIELD].tolist()
        if present:
            specs.append((name, _DTYPES[code], tuple(dims[:ndim])))
    out: dict = {name: None for name in _TENSOR_FIELDS}
    for dtype in _DTYPES:
        group = [(name, shape) for name, dt, shape in specs if dt == dtype]
        if not group:
            continue
        numels = [int(torch.Size(shape).numel()) for _, shape in group]
        if batch is not None:
            flat = torch.cat([getattr(batch, name).reshape(-1) for name, _ in group]).to(device)
        else:
            flat = torch.empty(sum(numels), dtype=dtype, device=device)
        # gloo has no int16: those travel as their bytes (bit-exact either way)
        dist.broadcast(flat.view(torch.uint8) if dtype == torch.int16 else flat, src=src)
        for (name, shape), part in zip(group, torch.split(flat, numels)):
            out[name] = part.view(shape)
    return TrainBatch(prompt_len=int(header[4]), **out)


def broadcast_batch(batch: Optional[TrainBatch], src: int = 0) -> TrainBatch:
    """Rank ``src`` passes a collated batch; every rank returns it (on the communication device).

    A follower raises :class:`LearnerStopped` if rank ``src`` broadcast a stop instead (see :func:`broadcast_stop`).
    """
    if dist.get_rank() == src:
        if batch is None:
            raise ValueError("broadcast_batch: the source rank must pass a TrainBatch")
        header = _broadcast_header(OP_BATCH, batch=batch, src=src)
        return _batch_payload(header, batch, src)
    header = _receive_header(src)
    op = int(header[2])
    if op == OP_STOP:
        raise LearnerStopped()
    if op != OP_BATCH:
        raise LearnerGroupError(f"expected a batch from rank {src}, got command op={op}")
    return _batch_payload(header, None, src)


def broadcast_stop(src: int = 0) -> None:
    """Rank ``src`` tells every follower to leave :func:`run_follower`."""
    _broadcast_header(OP_STOP, src=src)


def broadcast_gather(model_index: int = 0, src: int = 0) -> None:
    """Rank ``src`` announces a :func:`gather_full_state_dict` of model ``model_index`` (0 actor, 1 critic)."""
    _broadcast_header(OP_GATHER, arg=model_index, src=src)


def broadcast_checkpoint(version: int, src: int = 0) -> None:
    """Rank ``src`` announces a sharded checkpoint of ``version``: every follower writes its shards
    (``run_follower``'s ``on_checkpoint``, learner/checkpoint.py ``save_sharded``) while rank ``src`` writes its own."""
    _broadcast_header(OP_CHECKPOINT, arg=int(version), src=src)


def gather_full_state_dict(model: nn.Module, rank: int) -> Optional[dict[str, torch.Tensor]]:
    """The unsharded state dict on rank 0, ``None`` elsewhere. Collective: every rank must call it, in step.

    Tensors are gathered one at a time and dropped at once on other ranks, so no rank but 0 ever holds a full copy.
    It issues the same collectives in the same order (one ``full_tensor`` per state-dict entry) as
    :func:`asyncppo.learner.gather.iter_full_groups`, so a follower answers a layer-group gather or push of rank 0
    with it (``OP_GATHER``) without knowing which one rank 0 runs.
    """
    out: Optional[dict[str, torch.Tensor]] = {} if rank == 0 else None
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if out is not None:
            out[name] = tensor.detach()
        del tensor
    return out


def run_follower(updater, stop_check: Optional[Callable[[], bool]] = None, src: int = 0,
                 on_checkpoint: Optional[Callable[[int], None]] = None) -> int:
    """Loop of ranks > 0: execute rank ``src``'s commands until it broadcasts a stop; return the steps done.

    ``OP_BATCH`` -> ``updater.step(batch)``; ``OP_GATHER`` -> take part in gathering the actor (0) or critic (1).
    ``stop_check`` is polled before each command; returning True leaves the loop at once (rank 0 then fails its
    next collective after the group timeout, which is the right outcome when a follower must go away).
    """
    steps = 0
    models = {0: updater.actor, 1: updater.critic}
    while not (stop_check is not None and stop_check()):
        header = _receive_header(src)
        op, arg = int(header[2]), int(header[3])
        if op == OP_STOP:
            break
        if op == OP_CHECKPOINT:
            if on_checkpoint is None:
                raise LearnerGroupError("a sharded checkpoint was requested, but this rank cannot write one")
            on_checkpoint(arg)
            continue
        if op == OP_GATHER:
            if models.get(arg) is None:
                raise LearnerGroupError(f"gather of model {arg} requested, but this rank has no such model")
            gather_full_state_dict(models[arg], dist.get_rank())
            continue
        updater.step(_batch_payload(header, None, src))
        steps += 1
    return steps
