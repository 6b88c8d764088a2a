"""Forward passes over a :class:`TrainBatch`: per-token log-probs, entropy and values of the response tokens."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from asyncppo.algo import entropy_from_logits, logprobs_from_logits
from asyncppo.learner.batch import TrainBatch


def response_logits(model: nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """Logits that predict each response token, divided by the sampling temperature: [B, T, V]."""
    out = model(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        position_ids=batch.position_ids,
        use_cache=False,
    )
    P, T = batch.prompt_len, batch.response_len
    logits = out.logits[:, P - 1 : P + T - 1, :].float()
    return logits / temperature


def policy_forward(
    model: nn.Module, batch: TrainBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Returns (logprobs [B,T], entropy [B,T] or None, logits [B,T,V])."""
    labels = batch.input_ids[:, batch.prompt_len : batch.prompt_len + batch.response_len]
    logits = response_logits(model, batch, temperature)
    logprobs = logprobs_from_logits(logits, labels)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy, logits


def value_forward(critic: nn.Module, batch: TrainBatch) -> torch.Tensor:
    """V(s_t) for the state before each response token t: [B, T]."""
    values = critic(batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids)
    P, T = batch.prompt_len, batch.response_len
    return values[:, P - 1 : P + T - 1].float()


@torch.no_grad()
def chunked(fn, batch: TrainBatch, chunk_rows: int) -> torch.Tensor:
    """Apply a no-grad forward in row chunks and concatenate (bounded activation memory)."""
    outs = []
    for start in range(0, batch.size, max(chunk_rows, 1)):
        rows = torch.arange(start, min(start + chunk_rows, batch.size), device=batch.input_ids.device)
        outs.append(fn(batch.select(rows)))
    return torch.cat(outs, dim=0)
