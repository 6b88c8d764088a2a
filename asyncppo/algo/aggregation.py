"""Reducing a per-token loss matrix ``[B, T]`` to a scalar.

The learner splits a mini-batch into micro-batches (and across data-parallel ranks) and accumulates
gradients. A per-micro-batch *mean* would weight tokens by the size of the micro-batch they landed
in, so every mode here divides by a count that the caller can pass for the **whole** mini-batch
(``global_tokens`` / ``global_seqs``): then the sum of micro-batch losses equals the whole-batch
loss, and so do the gradients. When several data-parallel ranks share the global counts, the
gradient all-reduce must therefore be a SUM (or the loss multiplied by the world size before an
averaging all-reduce).

A "sequence" is a row with at least one valid token: padding rows added to balance micro-batches do
not dilute sequence means. Use :func:`count_tokens_and_seqs` on each micro-batch and sum to get the
global counts.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["aggregate", "LOSS_AGG_MODES", "count_tokens_and_seqs", "get_loss_agg", "loss_denominators"]


def count_tokens_and_seqs(mask: torch.Tensor) -> tuple[int, int]:
    """(valid tokens, sequences with at least one valid token) in ``mask`` ``[B, T]``."""
    m = mask.bool()
    return int(m.sum().item()), int(m.any(dim=-1).sum().item())


def loss_denominators(response_mask: torch.Tensor, loss_mask: torch.Tensor) -> tuple[float, float, float, float]:
    """``(tokens, seqs, policy_tokens, policy_seqs)`` of one (local) mini-batch, to be summed over ranks and passed
    as ``global_tokens`` / ``global_seqs``.

    The critic's pair counts the whole response: every response token, and every *row* (a row without response
    tokens still counts as a sequence, with loss 0). The policy's pair counts the ``loss_mask`` left after rollout
    correction's rejection: rejected tokens are not in the token count, and a row whose every response token was
    rejected is no longer a sequence; that is what makes rejection remove a sample rather than average a 0 into
    the mean. Floats, so that they can be all-reduced as they are.
    """
    lm = loss_mask.bool()
    rows = float(response_mask.shape[0])
    rejected_rows = float((response_mask.bool().any(-1) & ~lm.any(-1)).sum())
    return float(response_mask.sum()), rows, float(lm.sum()), rows - rejected_rows


def _local_tokens(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum().clamp(min=1)


def _local_seqs(mask: torch.Tensor) -> torch.Tensor:
    return (mask.sum(dim=-1) > 0).to(mask.dtype).sum().clamp(min=1)


def _denominator(value, fallback: torch.Tensor, name: str):
    if value is None:
        return fallback
    if float(value) <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def _token_mean(loss_mat, mask, global_tokens, global_seqs, norm_length):
    return (loss_mat * mask).sum() / _denominator(global_tokens, _local_tokens(mask), "global_tokens")


def _seq_mean_token_sum(loss_mat, mask, global_tokens, global_seqs, norm_length):
    seq = (loss_mat * mask).sum(dim=-1)
    return seq.sum() / _denominator(global_seqs, _local_seqs(mask), "global_seqs")


def _seq_mean_token_mean(loss_mat, mask, global_tokens, global_seqs, norm_length):
    seq = (loss_mat * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
    return seq.sum() / _denominator(global_seqs, _local_seqs(mask), "global_seqs")


def _seq_mean_token_sum_norm(loss_mat, mask, global_tokens, global_seqs, norm_length):
    # Dividing by a constant length (rather than the sequence's own length) removes the bias
    # towards short answers that a per-sequence mean introduces (Dr. GRPO). Pass norm_length
    # explicitly when micro-batches are padded to different widths, else the default differs.
    L = loss_mat.shape[-1] if norm_length is None else norm_length
    if L <= 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    seq = (loss_mat * mask).sum(dim=-1) / L
    return seq.sum() / _denominator(global_seqs, _local_seqs(mask), "global_seqs")


def _token_sum(loss_mat, mask, global_tokens, global_seqs, norm_length):
    # No divisor at all: the gradient grows with the number of tokens trained on (the scale is the caller's
    # choice, e.g. a smaller learning rate). Trivially invariant to micro-batch splitting.
    return (loss_mat * mask).sum()


LOSS_AGG_MODES: dict[str, Callable] = {
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def get_loss_agg(mode: str) -> Callable:
    try:
        return LOSS_AGG_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; allowed: {', '.join(LOSS_AGG_MODES)}") from None


def aggregate(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    global_tokens: Optional[float] = None,
    global_seqs: Optional[float] = None,
    norm_length: Optional[float] = None,
) -> torch.Tensor:
    """Reduce ``loss_mat`` ``[B, T]`` over valid ``mask`` positions according to ``mode``.

    * ``token-mean``: sum over valid tokens / ``global_tokens``
    * ``token-sum``: sum over valid tokens (no normalisation)
    * ``seq-mean-token-sum``: per-sequence sum, summed / ``global_seqs``
    * ``seq-mean-token-mean``: per-sequence mean, summed / ``global_seqs``
    * ``seq-mean-token-sum-norm``: per-sequence sum / ``norm_length``, summed / ``global_seqs``

    Counts left as ``None`` are taken from this batch. Masked entries contribute nothing, even if
    they are NaN or inf.
    """
    fn = get_loss_agg(mode)
    if loss_mat.shape != mask.shape or loss_mat.dim() != 2:
        raise ValueError(
            f"loss_mat and mask must both be [B, T]; got {tuple(loss_mat.shape)} and {tuple(mask.shape)}"
        )
    m = mask.to(loss_mat.dtype)
    safe = torch.where(mask.bool(), loss_mat, torch.zeros((), dtype=loss_mat.dtype, device=loss_mat.device))
    return fn(safe, m, global_tokens, global_seqs, norm_length)
