"""One policy update over several learner ranks: which rows each rank trains, and the no-grad work split over them.

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

Rank 0 hands every rank the whole batch (learner/distributed.py: ``broadcast_batch``); this module is what each rank
then does with it.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from asyncppo.learner.batch import TrainBatch, micro_batch_rows
from asyncppo.learner.distributed import comm_device
from asyncppo.learner.forward import chunked, count_chunks
from asyncppo.learner.ppo import PPOUpdate


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
    device = comm_device()
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
    forwards = torch.tensor([count_chunks(mine, chunk_rows, max_tokens)], dtype=torch.int64, device=comm_device())
    dist.all_reduce(forwards, op=dist.ReduceOp.MAX)
    local = chunked(fn, mine, chunk_rows, max_tokens, forwards=int(forwards))[: end - start]
    return all_gather_rows(local)


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
