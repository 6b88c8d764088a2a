"""Several learner ranks training one policy: the rank group, batch transport, sharding and the follower loop.

Why this shape. Rank 0 is the only rank that talks to the rollout side (sockets, staleness buffer, weight push), so
every other rank is a *follower* that does exactly what rank 0 tells it, in the same order, because every FSDP
forward/backward and every gather is a collective that all ranks must enter together. Rank 0 announces each command
with a fixed-size int64 header broadcast (``OP_BATCH`` + field shapes/dtypes, ``OP_GATHER``, ``OP_STOP``); a batch
follows as a few flat tensor broadcasts, one per dtype. Nothing is pickled: a follower only ever interprets integers.

Which work is global and which is per rank (the update must equal one rank training on the whole batch):

* Every rank receives the **whole** collated batch (it is small next to the models: ids and per-token floats).
* No-grad preparation (proximal/old log-probs, reference log-probs, values) is split: :func:`sharded_no_grad` gives
  each rank an even contiguous slice of rows (padded to the same length so every rank runs the same number of
  FSDP forwards), and :func:`all_gather_rows` puts the full ``[B, T]`` result on every rank.
* Everything with batch statistics then runs on every rank on the full batch and gives identical results: reward
  clipping/normalisation (incl. the running statistics), KL-in-reward and the adaptive KL controller, advantage
  estimation including whitening (GAE, REINFORCE++) and per-group baselines (GRPO, RLOO), metrics.
* Mini-batches are drawn on every rank from the full batch with the same seeded generator, so all ranks see the same
  *global* mini-batch; each rank then trains on its :func:`shard_rows` slice of it. Losses are normalised by the
  global mini-batch token/sequence counts (``PPOUpdate._global_counts``) and multiplied by ``world_size``; FSDP2
  averages gradients over ranks, so the synchronised gradient is exactly the whole mini-batch's gradient.
  (Sharding first and drawing mini-batches per rank would not: different group permutations, and ranks with
  different mini-batch counts would deadlock.)
* Each rank must run the same number of micro-batches per mini-batch (each one is an FSDP collective).
  :func:`micro_batch_counts` computes every rank's count locally (all ranks hold the global mini-batch), so a
  mismatch is reported as an error instead of a hang.

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

from asyncppo.learner.batch import TrainBatch, micro_batch_rows
from asyncppo.learner.forward import chunked, count_chunks
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.sync.group import bound_store, loopback_interface

OP_BATCH, OP_GATHER, OP_STOP, OP_CHECKPOINT = 1, 2, 3, 4
_MAGIC, _PROTOCOL = 0x41505031, 1  # "APP1"
# the ints (prompt_len in the header; pack_capacity, which each rank sets from its own options) do not travel
_TENSOR_FIELDS = tuple(f.name for f in fields(TrainBatch) if f.name not in ("prompt_len", "pack_capacity"))
_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
           torch.bool)
_DTYPE_CODE = {dt: i for i, dt in enumerate(_DTYPES)}
_MAX_DIMS = 2
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


def _comm_device() -> torch.device:
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
    header = header.to(_comm_device())
    dist.broadcast(header, src=src)
    return header.cpu()


def _receive_header(src: int = 0) -> torch.Tensor:
    header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=_comm_device())
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
    device = _comm_device()
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
        dist.broadcast(flat, src=src)
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


# ---------------------------------------------------------------------------------------------------------------
# sharding
def _balanced_bounds(weights: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous ranges of ``weights`` whose sums are as close as possible to equal shares (some may be empty)."""
    total, bounds, start, acc = sum(weights), [], 0, 0
    for p in range(parts):
        end = start
        target = total * (p + 1) / parts
        while end < len(weights) and (p == parts - 1 or acc + weights[end] / 2 <= target):
            acc += weights[end]
            end += 1
        bounds.append((start, end))
        start = end
    return bounds


def shard_rows(batch: TrainBatch, rank: int, world_size: int) -> TrainBatch:
    """This rank's rows: a contiguous run of whole prompt groups, balanced by row count, renumbered 0..k-1.

    Groups are taken in order of their ``group_index``; a rank gets an empty batch when there are fewer groups
    than ranks. The shards of all ranks cover every row exactly once.
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"shard_rows: rank={rank} must be in [0, world_size={world_size})")
    return _take_shard(batch, *_shard_row_indices(batch, world_size)[rank])


def _shard_row_indices(batch: TrainBatch, world_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every rank's ``(rows of batch its shard holds, ascending; their groups renumbered 0..k-1)``, in rank order
    (see :func:`shard_rows`)."""
    _, inverse, counts = torch.unique(batch.group_index.cpu(), sorted=True, return_inverse=True, return_counts=True)
    indices = []
    for start, end in _balanced_bounds(counts.tolist(), world_size):
        rows = torch.nonzero((inverse >= start) & (inverse < end), as_tuple=False).squeeze(1)
        indices.append((rows, inverse[rows] - start))
    return indices


def _take_shard(batch: TrainBatch, rows: torch.Tensor, groups: torch.Tensor) -> TrainBatch:
    shard = batch.select(rows.to(batch.group_index.device))
    shard.group_index = groups.to(batch.group_index.device)
    return shard


def _micro_batch_count(shard: TrainBatch, micro_batch_size: int, max_tokens: int) -> int:
    return len(micro_batch_rows(shard, micro_batch_size, max_tokens)) if shard.size else 0


def micro_batch_counts(mini: TrainBatch, world_size: int, micro_batch_size: int, max_tokens: int) -> list[int]:
    """Micro-batches each rank will run on its :func:`shard_rows` slice of the global ``mini`` (no communication)."""
    return [_micro_batch_count(_take_shard(mini, *index), micro_batch_size, max_tokens)
            for index in _shard_row_indices(mini, world_size)]


def all_gather_rows(local: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
    """Concatenate every rank's ``[rows_r, ...]`` tensor along dim 0, in rank order, on every rank.

    Ranks may hold different row counts and (for 2-D tensors) different widths: narrower rows are right-padded with
    ``pad_value`` to the widest (response-aligned ``[B, T]`` tensors are right-padded in :class:`TrainBatch`).
    """
    if local.dim() not in (1, 2):
        raise ValueError(f"all_gather_rows: expected a 1-D or 2-D tensor, got shape {tuple(local.shape)}")
    world = dist.get_world_size()
    device = _comm_device()
    shape = torch.tensor([local.shape[0], local.shape[1] if local.dim() == 2 else 0], dtype=torch.int64,
                         device=device)
    shapes = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes, shape)
    shapes = [s.tolist() for s in shapes]
    rows, width = max(s[0] for s in shapes), max(s[1] for s in shapes)
    padded = torch.full((rows, width) if local.dim() == 2 else (rows,), pad_value, dtype=local.dtype, device=device)
    if local.dim() == 2:
        padded[: local.shape[0], : local.shape[1]] = local
    else:
        padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([p[:n] for p, (n, _) in zip(parts, shapes)], dim=0).to(local.device)


def sharded_no_grad(fn: Callable[[TrainBatch], torch.Tensor], batch: TrainBatch, chunk_rows: int,
                    max_tokens: int = 0) -> torch.Tensor:
    """``chunked(fn, batch, chunk_rows, max_tokens)`` with the rows split over the ranks; the full result on every
    rank.

    Every rank gets ``ceil(B / world)`` rows (the last rank pads by repeating its last row, or row 0 when it has
    none; padding rows are dropped). FSDP requires every rank to run the same number of forwards, and a token bound
    cuts ranks' rows into different numbers of chunks, so the ranks agree on the most and the others run filler
    forwards.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    per = -(-batch.size // world)
    start, end = min(rank * per, batch.size), min((rank + 1) * per, batch.size)
    index = torch.arange(start, end)
    if index.numel() < per:
        filler = end - 1 if end > start else 0
        index = torch.cat([index, torch.full((per - index.numel(),), filler, dtype=torch.long)])
    mine = batch.select(index.to(batch.input_ids.device))
    forwards = torch.tensor([count_chunks(mine, chunk_rows, max_tokens)], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(forwards, op=dist.ReduceOp.MAX)
    local = chunked(fn, mine, chunk_rows, max_tokens, forwards=int(forwards))[: end - start]
    return all_gather_rows(local)


# ---------------------------------------------------------------------------------------------------------------
class ShardedPPOUpdate(PPOUpdate):
    """:class:`PPOUpdate` for one rank of several: whole batch in, this rank's slice of each mini-batch trained.

    Works with ``PPOUpdate`` as it is: its no-grad preparation then runs on the full batch on every rank, which is
    correct but repeats work. Once ``PPOUpdate.step`` calls ``self._no_grad_rows(fn, batch, rows)`` where it now
    calls ``chunked(...)``, :meth:`_no_grad_rows` splits that work over the ranks.
    """

    def __init__(self, *args, rank: int, world_size: int, **kwargs) -> None:
        super().__init__(*args, world_size=world_size, **kwargs)
        self.rank = rank

    def _no_grad_rows(self, fn, batch: TrainBatch, rows: int) -> torch.Tensor:
        return sharded_no_grad(fn, batch, rows, self.no_grad_tokens)

    def _update_mini_batch(self, mini: TrainBatch, means, first_pass=None, fused: bool = False):
        """This rank's shard of the mini-batch. A fused step (``learner/passes.py``) returns the proximal log-probs
        of the whole mini-batch on every rank: each rank's shard's, gathered and put back in the mini-batch's row
        order, so the correction's batch figures are the same everywhere."""
        assert first_pass is None, "a sharded step makes no single pass (learner/passes.py: single_pass)"
        indices = _shard_row_indices(mini, self.world_size)  # every rank's shard, from one pass over the groups
        shards = [_take_shard(mini, *index) for index in indices]
        counts = [_micro_batch_count(shard, self.alg.micro_batch_size, self.alg.max_tokens_per_micro_batch)
                  for shard in shards]
        if len(set(counts)) != 1:
            raise ValueError(
                f"learner ranks would run different numbers of micro-batches {counts} on a mini-batch of "
                f"{mini.size} rows: FSDP would deadlock. Use ppo_mini_batch_size divisible by the learner "
                f"ranks with equal group sizes, and micro_batch_size (not max_tokens_per_micro_batch)"
            )
        proximal = super()._update_mini_batch(shards[self.rank], means, fused=fused)
        if not fused:
            return None
        order = torch.cat([rows for rows, _ in indices])
        gathered = all_gather_rows(proximal)
        full = torch.zeros((mini.size, mini.response_len), dtype=gathered.dtype, device=gathered.device)
        full[order.to(gathered.device), : gathered.shape[1]] = gathered
        return full
