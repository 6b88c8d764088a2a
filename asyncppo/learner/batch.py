"""Turn trajectory groups into padded training tensors, and slice them into mini- and micro-batches.

Layout (as in verl): prompts are left-padded to the longest prompt ``P`` and responses right-padded to the longest
response ``T``, so every response token ``t`` sits at column ``P + t`` for every row and the logits that predict it are
at column ``P + t - 1``. Per-token tensors (log-probs, values, advantages) are ``[B, T]`` with a ``response_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator, Optional

import numpy as np
import torch

from asyncppo.stream.records import TrajectoryGroup


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
    token_versions: Optional[torch.Tensor] = None  # [B, T] long, policy version of each response token (0 on padding)
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


def collate_groups(groups: list[TrajectoryGroup], pad_token_id: int) -> TrainBatch:
    rows = [(g_idx, g, s) for g_idx, g in enumerate(groups) for s in g.samples]
    if not rows:
        raise ValueError("collate_groups: no samples")
    P = max(int(g.prompt_ids.shape[0]) for g in groups)
    T = max(1, max(s.num_tokens for _, _, s in rows))
    B = len(rows)
    # filled row by row in numpy and converted once: per-row torch tensors cost more than the copies themselves
    input_ids = np.full((B, P + T), pad_token_id, dtype=np.int64)
    attention_mask = np.zeros((B, P + T), dtype=np.int64)
    response_mask = np.zeros((B, T), dtype=np.float32)
    behavior = np.zeros((B, T), dtype=np.float32)
    scores = np.zeros(B, dtype=np.float32)
    group_index = np.zeros(B, dtype=np.int64)
    version_min = np.zeros(B, dtype=np.int64)
    token_versions = np.zeros((B, T), dtype=np.int64)
    for i, (g_idx, group, sample) in enumerate(rows):
        n_prompt, n_resp = int(group.prompt_ids.shape[0]), sample.num_tokens
        input_ids[i, P - n_prompt : P] = group.prompt_ids
        attention_mask[i, P - n_prompt : P + n_resp] = 1
        if n_resp:
            input_ids[i, P : P + n_resp] = sample.response_ids
            behavior[i, :n_resp] = sample.behavior_logprobs
            response_mask[i, :n_resp] = 1.0
            token_versions[i, :n_resp] = sample.token_versions()
        scores[i] = float(sample.reward)
        group_index[i] = g_idx
        version_min[i] = sample.version_min
    attention = torch.from_numpy(attention_mask)
    return TrainBatch(
        input_ids=torch.from_numpy(input_ids),
        attention_mask=attention,
        position_ids=(attention.cumsum(dim=1) - 1).clamp(min=0),
        response_mask=torch.from_numpy(response_mask),
        behavior_logprobs=torch.from_numpy(behavior),
        scores=torch.from_numpy(scores),
        group_index=torch.from_numpy(group_index),
        version_min=torch.from_numpy(version_min),
        prompt_len=P,
        token_versions=torch.from_numpy(token_versions),
    )


def mini_batches(batch: TrainBatch, groups_per_mini_batch: int, generator: torch.Generator) -> Iterator[TrainBatch]:
    """Shuffled mini-batches that keep prompt groups whole (GRPO/RLOO statistics were computed per group)."""
    num_groups = int(batch.group_index.max().item()) + 1
    per = num_groups if groups_per_mini_batch <= 0 else groups_per_mini_batch
    order = torch.randperm(num_groups, generator=generator)
    for start in range(0, num_groups, per):
        chosen = order[start : start + per]
        rows = torch.nonzero(torch.isin(batch.group_index, chosen), as_tuple=False).squeeze(1)
        yield batch.select(rows)


def micro_batches(batch: TrainBatch, micro_batch_size: int, max_tokens: int) -> list[TrainBatch]:
    """Split rows into micro-batches by sample count or by a token budget, rows sorted by length first.

    Sorting puts similar lengths together, so each micro-batch's forward trims to its own longest row (see
    :mod:`asyncppo.learner.forward`); which rows share a micro-batch never changes the gradient, because losses are
    normalised by the mini-batch's global counts and summed."""
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
    return [batch.select(order[s:e]) for s, e in bounds]
