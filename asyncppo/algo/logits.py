"""Token log-probabilities and entropies from logits ``[B, T, V]``.

The vocabulary dimension dominates memory. ``logprobs_from_logits`` never materialises a second
``[B, T, V]`` log-softmax for full-precision inputs: it gathers the label logit and subtracts the
log-sum-exp, whose backward needs only its input and output. Half-precision logits lose too much
in a log-sum-exp over a large vocabulary, so they are processed one row at a time in float32.
"""

from __future__ import annotations

import torch

__all__ = ["logprobs_from_logits", "entropy_from_logits"]


def _scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return logits if temperature == 1.0 else logits / temperature


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log softmax(logits / temperature)[labels]``; logits ``[..., V]``, labels ``[...]``, float32 out.

    The temperature must equal the sampling temperature, otherwise the recomputed log-probs are of
    a different distribution than the one the tokens were drawn from.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on leading dims")
    logits = _scale(logits, temperature)
    labels = labels.long()
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return (picked - torch.logsumexp(logits, dim=-1)).float()
    flat_logits = logits.reshape(-1, logits.shape[-1]) if logits.dim() != 3 else logits
    flat_labels = labels.reshape(-1) if logits.dim() != 3 else labels
    rows = []
    for row_logits, row_labels in zip(flat_logits, flat_labels):
        logp = torch.log_softmax(row_logits.float(), dim=-1)
        rows.append(logp.gather(-1, row_labels.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows).reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of ``softmax(logits / temperature)`` over the last dim: ``lse(z) - sum p z``."""
    z = _scale(logits, temperature).float()
    p = torch.softmax(z, dim=-1)
    return torch.logsumexp(z, dim=-1) - (p * z).sum(dim=-1)
