"""Turn trajectory groups into padded training tensors, and slice them into mini- and micro-batches.

Layout (as in verl): prompts are left-padded to the longest prompt ``P`` and responses right-padded to the longest
response ``T``, so every response token ``t`` sits at column ``P + t`` for every row and the logits that predict it are
at column ``P + t - 1``. Per-token tensors (log-probs, values, advantages) are ``[B, T]`` with a ``response_mask``.

The batch is built from the groups' columns (:meth:`TrajectoryGroup.as_columns`): a trajectory stays columnar from
the wire decode to the loss. ``token_versions`` carries the policy version of every response token, from which the
learner's per-token lag metrics are computed (:func:`asyncppo.metrics.batch_token_lag_stats`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator, Optional

import numpy as np
import torch

from asyncppo.learner.turn_batch import turn_arrays
from asyncppo.stream.records import TrajectoryGroup


# [B, P + T, ...]; every other 2-D field is [B, T, ...]
_SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids", "routed_experts")


@dataclass
class TrainBatch:
    input_ids: torch.Tensor  # [B, P+T] long
    attention_mask: torch.Tensor  # [B, P+T] long
    position_ids: torch.Tensor  # [B, P+T] long
    response_mask: torch.Tensor  # [B, T] float, 1 on valid response tokens
    behavior_logprobs: torch.Tensor  # [B, T] float
    scores: torch.Tensor  # [B] outcome reward per sample
    group_index: torch.Tensor  # [B] long, which prompt group each sample belongs to
    version_min: torch.Tensor  # [B] long
    prompt_len: int  # P (padded)
    # [B] bool, the response ended at the length limit (finish_reason "length"), not by its own stop token
    truncated: Optional[torch.Tensor] = None
    token_versions: Optional[torch.Tensor] = None  # [B, T] long, policy version of each response token (0 on padding)
    # [B, T] float, multi-turn samples' turn rewards at the last model token of each turn (None: no turn rewards
    # in the batch); response_mask is then 0 on environment tokens too (asyncppo.learner.turn_batch)
    turn_rewards: Optional[torch.Tensor] = None
    # [B, P+T, layers, top_k] int16: the engine's experts at every position (-1: none; algorithm.routing_replay)
    routed_experts: Optional[torch.Tensor] = None
    # tokens per packed row of this batch's forwards, or PADDED / ONE_ROW / LONGEST (asyncppo.learner.packing)
    pack_capacity: int = 0
    # Filled in by the learner before the update:
    old_logprobs: Optional[torch.Tensor] = None  # proximal policy (learner recompute) [B, T]
    ref_logprobs: Optional[torch.Tensor] = None
    old_values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    is_weights: Optional[torch.Tensor] = None  # [B, T] rollout-correction weights (algo.rollout_correction)
    loss_mask: Optional[torch.Tensor] = None  # [B, T] bool: response_mask minus rejected tokens (policy terms)
    token_select: Optional[torch.Tensor] = None  # [B, T] bool: clip_cov / kl_cov tokens of this mini-batch

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.response_mask.shape[1])

    def to(self, device: torch.device | str) -> "TrainBatch":
        moved = {}
        for f in fields(self):
            value = getattr(self, f.name)
            moved[f.name] = value.to(device) if isinstance(value, torch.Tensor) else value
        return TrainBatch(**moved)

    def select(self, index: torch.Tensor) -> "TrainBatch":
        """Rows ``index`` of every per-sample tensor (prompt layout unchanged)."""
        picked = {}
        for f in fields(self):
            value = getattr(self, f.name)
            picked[f.name] = value[index] if isinstance(value, torch.Tensor) else value
        return replace(self, **picked)

    def narrow_response(self, width: int) -> "TrainBatch":
        """The first ``width`` response columns (prompt layout unchanged): what a forward over rows whose responses
        all fit ``width`` needs, so that its per-token outputs (the float32 logits above all) are ``width`` wide
        instead of the whole batch's longest response. Columns past every row's response are padding, so nothing
        real is cut; the caller pads results back."""
        if width >= self.response_len:
            return self
        cut = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, torch.Tensor) and value.dim() >= 2:  # [B, P + T] or [B, T, ...]
                keep = self.prompt_len + width if f.name in _SEQUENCE_FIELDS else width
                value = value[:, :keep]
            cut[f.name] = value
        return replace(self, **cut)

    def response_extents(self) -> torch.Tensor:
        """[B] columns each row's response spans (responses are right-padded): the attention mask after the prompt,
        environment tokens of multi-turn samples included, which ``response_mask`` leaves out."""
        return self.attention_mask[:, self.prompt_len :].sum(dim=1)

    def narrowed(self) -> "TrainBatch":
        """:meth:`narrow_response` to the longest response these rows hold."""
        extent = int(self.response_extents().max()) if self.size else 0
        return self.narrow_response(max(1, extent))


def _concat_columns(groups: list[TrajectoryGroup]) -> tuple:
    """(response ids, log-probs, token versions, per-sample lengths, rewards, version_min, truncated, samples per
    group) of all groups, each one array over every sample or token: a fixed number of numpy calls per group, none per
    sample, and no Sample object is built for a group that arrived columnar."""
    cols = [g.as_columns() for g in groups]
    counts = [len(c.reward) for c in cols]
    if not sum(counts):
        raise ValueError("collate_groups: no samples")
    ids = np.concatenate([c.response_ids for c in cols])
    lps = np.concatenate([c.behavior_logprobs for c in cols])
    versions = np.concatenate([c.token_versions() for c in cols])
    lengths = np.fromiter((n for c in cols for n in c.lengths()), dtype=np.int64, count=sum(counts))
    rewards = np.fromiter((r for c in cols for r in c.reward), dtype=np.float64, count=len(lengths))
    vmin = np.fromiter((v for c in cols for v in c.version_min), dtype=np.int64, count=len(lengths))
    cut = np.fromiter((f == "length" for c in cols for f in c.finish_reason), dtype=np.bool_, count=len(lengths))
    return ids, lps, versions, lengths, rewards, vmin, cut, counts


def collate_groups(groups: list[TrajectoryGroup], pad_token_id: int) -> TrainBatch:
    """The padded batch of ``groups``, built from their columns (see the module docstring for the layout).

    Response tokens are scattered into place with one fancy-index assignment per array (row and column of every
    token computed from the lengths), so the cost does not grow with a Python loop over samples; only the prompt,
    shared by a group's samples, is written once per group."""
    ids, lps, versions, lengths, rewards, vmin, cut, counts = _concat_columns(groups)
    B = lengths.shape[0]
    P = max(int(g.prompt_ids.shape[0]) for g in groups)
    T = max(1, int(lengths.max()))
    group_index = np.repeat(np.arange(len(groups), dtype=np.int64), counts)
    prompt_lens = np.repeat(np.array([g.prompt_ids.shape[0] for g in groups], dtype=np.int64), counts)
    # row and column of every response token: token k of sample i sits at column k of row i
    tok_row = np.repeat(np.arange(B), lengths)
    tok_col = np.arange(ids.shape[0]) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    input_ids = np.full((B, P + T), pad_token_id, dtype=np.int64)
    row = 0
    for g, n in zip(groups, counts):
        n_prompt = int(g.prompt_ids.shape[0])
        input_ids[row : row + n, P - n_prompt : P] = g.prompt_ids
        row += n
    input_ids[tok_row, P + tok_col] = ids
    column = np.arange(P + T)
    attention_mask = ((column >= P - prompt_lens[:, None]) & (column < P + lengths[:, None])).astype(np.int64)
    response_mask = (np.arange(T) < lengths[:, None]).astype(np.float32)
    behavior = np.zeros((B, T), dtype=np.float32)
    behavior[tok_row, tok_col] = lps
    token_versions = np.zeros((B, T), dtype=np.int64)
    token_versions[tok_row, tok_col] = versions
    model_tokens, turn_rewards = turn_arrays(groups)  # multi-turn episodes: environment tokens leave the loss
    if model_tokens is not None:
        response_mask[tok_row, tok_col] = model_tokens
    placed = None
    if turn_rewards is not None:
        placed = np.zeros((B, T), dtype=np.float32)
        placed[tok_row[turn_rewards[0]], tok_col[turn_rewards[0]]] = turn_rewards[1]
    attention = torch.from_numpy(attention_mask)
    routed = _routed_experts(groups, counts, lengths, P, T)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=attention,
        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
        response_mask=torch.from_numpy(response_mask),
        behavior_logprobs=torch.from_numpy(behavior),
        scores=torch.from_numpy(rewards.astype(np.float32)),
        group_index=torch.from_numpy(group_index),
        version_min=torch.from_numpy(vmin),
        prompt_len=P,
        truncated=torch.from_numpy(cut),
        token_versions=torch.from_numpy(token_versions),
        turn_rewards=None if placed is None else torch.from_numpy(placed),
        routed_experts=routed,
    )


def _routed_experts(groups: list[TrajectoryGroup], counts: list[int], lengths: np.ndarray, P: int,
                    T: int) -> Optional[torch.Tensor]:
    """``[B, P + T, layers, top_k]`` int16 from the groups' routing columns, in the batch's layout (a sample's
    prompt positions end at column P, its response follows; -1 elsewhere); None when no group carries one. The
    door admits either every group with a column of the model's shape or none (stream/routing.py)."""
    if all(g.routing is None for g in groups):
        return None
    first = next(g.routing for g in groups if g.routing is not None)
    out = np.full((len(lengths), P + T, first.layers, first.top_k), -1, dtype=np.int16)
    row = 0
    for g, n in zip(groups, counts):
        p = int(g.prompt_ids.shape[0])
        if g.routing is not None:
            for j, rows in enumerate(g.routing.per_sample(p, [int(t) for t in lengths[row : row + n]])):
                out[row + j, P - p : P - p + rows.shape[0]] = rows
        row += n
    return torch.from_numpy(out)


def mini_batches(batch: TrainBatch, groups_per_mini_batch: int, generator: torch.Generator) -> Iterator[TrainBatch]:
    """Shuffled mini-batches that keep prompt groups whole (GRPO/RLOO statistics were computed per group)."""
    num_groups = int(batch.group_index.max().item()) + 1
    per = num_groups if groups_per_mini_batch <= 0 else groups_per_mini_batch
    order = torch.randperm(num_groups, generator=generator)
    for start in range(0, num_groups, per):
        chosen = order[start : start + per].to(batch.group_index.device)
        rows = torch.nonzero(torch.isin(batch.group_index, chosen), as_tuple=False).squeeze(1)
        yield batch.select(rows)


def micro_batch_rows(batch: TrainBatch, micro_batch_size: int, max_tokens: int) -> list[torch.Tensor]:
    """The row indices of each micro-batch (see :func:`micro_batches`): by sample count or by a token budget, rows
    sorted by length first."""
    n = batch.size
    lengths = batch.attention_mask.sum(dim=1)
    order = torch.argsort(lengths, stable=True)
    if max_tokens > 0:
        sorted_lengths = lengths[order].tolist()
        bounds, start, used = [], 0, 0
        for i, length in enumerate(sorted_lengths):
            if i > start and used + length > max_tokens:
                bounds.append((start, i))
                start, used = i, 0
            used += length
        bounds.append((start, n))
    else:
        size = n if micro_batch_size <= 0 else micro_batch_size
        bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
    return [order[s:e] for s, e in bounds]


def micro_batches(batch: TrainBatch, micro_batch_size: int, max_tokens: int) -> list[TrainBatch]:
    """Split rows into micro-batches by sample count or by a token budget, rows sorted by length first.

    Sorting puts similar lengths together, so each micro-batch's forward trims to its own longest row (see
    :mod:`asyncppo.learner.forward`); which rows share a micro-batch never changes the gradient, because losses are
    normalised by the mini-batch's global counts and summed. Each micro-batch is as wide as its own longest
    response: its float32 logits (and their gradient) are then rows x that width x vocab, not rows x the whole
    batch's longest, which a long tail makes many times larger."""
    return [batch.select(rows).narrowed() for rows in micro_batch_rows(batch, micro_batch_size, max_tokens)]
