"""Turn trajectory groups into padded training tensors, and slice them into mini- and micro-batches.

Layout (as in verl): prompts are left-padded to the longest prompt ``P`` and responses right-padded to the longest
response ``T``, so every response token ``t`` sits at column ``P + t`` for every row and the logits that predict it are
at column ``P + t - 1``. Per-token tensors (log-probs, values, advantages) are ``[B, T]`` with a ``response_mask``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator, Optional

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
    input_ids = torch.full((B, P + T), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((B, P + T), dtype=torch.long)
    response_mask = torch.zeros((B, T), dtype=torch.float32)
    behavior = torch.zeros((B, T), dtype=torch.float32)
    scores = torch.zeros(B, dtype=torch.float32)
    group_index = torch.zeros(B, dtype=torch.long)
    version_min = torch.zeros(B, dtype=torch.long)
    token_versions = torch.zeros((B, T), dtype=torch.long)
    for i, (g_idx, group, sample) in enumerate(rows):
        prompt = torch.tensor(group.prompt_ids, dtype=torch.long)
        n_prompt, n_resp = prompt.shape[0], sample.num_tokens
        input_ids[i, P - n_prompt : P] = prompt
        attention_mask[i, P - n_prompt : P + n_resp] = 1
        if n_resp:
            input_ids[i, P : P + n_resp] = torch.tensor(sample.response_ids, dtype=torch.long)
            behavior[i, :n_resp] = torch.tensor(sample.behavior_logprobs, dtype=torch.float32)
            response_mask[i, :n_resp] = 1.0
            token_versions[i, :n_resp] = torch.from_numpy(sample.token_versions())
        scores[i] = float(sample.reward)
        group_index[i] = g_idx
        version_min[i] = sample.version_min
    position_ids = (attention_mask.cumsum(dim=1) - 1).clamp(min=0)
    return TrainBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        behavior_logprobs=behavior,
        scores=scores,
        group_index=group_index,
        version_min=version_min,
        prompt_len=P,
        token_versions=token_versions,
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
