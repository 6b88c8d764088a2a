"""Masked statistics, whitening, reward clipping/normalisation and running moments.

Every statistic here is taken over *valid* positions only: padded response tokens exist because
sequences in a batch have different lengths, and letting their (arbitrary) values leak into a mean
or a variance would make the update depend on how the batch happened to be padded.

Reward shaping works on per-sample scalar scores ``[B]`` (the outcome rewards, before they are placed
on the last response token), because that is the quantity whose scale differs between reward
functions; per-token KL penalties are added afterwards and are left untouched.
"""

from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = [
    "masked_sum",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "group_mean_std",
    "RunningMeanStd",
    "clip_rewards",
    "normalize_rewards",
    "REWARD_NORM_MODES",
    "scores_to_token_rewards",
    "overlong_penalty",
]


def _as_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    if mask.shape != like.shape:
        raise ValueError(f"mask shape {tuple(mask.shape)} does not match values shape {tuple(like.shape)}")
    return mask.to(like.dtype)


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum of ``values`` where ``mask`` is set; masked entries contribute exactly 0 even if NaN/inf."""
    m = _as_mask(mask, values)
    vals = torch.where(m.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return vals.sum() if dim is None else vals.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over valid entries; 0 where there are none (an empty mean must not poison a loss with NaN)."""
    m = _as_mask(mask, values)
    count = m.sum() if dim is None else m.sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over all valid entries (Bessel-corrected by default, like ``torch.var``)."""
    m = _as_mask(mask, values)
    mean = masked_mean(values, mask)
    var = masked_sum((values - mean) ** 2, mask)
    n = m.sum()
    if unbiased:
        return var / (n - 1).clamp(min=1)
    return var / n.clamp(min=1)


def masked_whiten(
    values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` with mean/var over valid entries; masked entries come back 0.

    ``shift_mean=False`` rescales without centring (the mean is added back), which keeps the sign
    structure of the advantages when callers want only the scale fixed.
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    out = (values - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return torch.where(_as_mask(mask, values).bool(), out, torch.zeros_like(out))


def group_mean_std(scores: torch.Tensor, group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample mean, std (Bessel-corrected) and size of the sample's group.

    ``group_index`` is a LongTensor ``[B]`` naming each sample's prompt group (any integer labels,
    not necessarily contiguous). Singleton groups get mean 0 and std 1 so that a normalised score
    degrades to the raw score rather than to NaN: with one sample there is no baseline to subtract.
    """
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    if group_index is None:
        raise ValueError("group_index is required for group statistics (a LongTensor [B] of prompt-group ids)")
    group_index = torch.as_tensor(group_index, device=scores.device)
    if group_index.shape != scores.shape:
        raise ValueError(f"group_index shape {tuple(group_index.shape)} does not match scores shape {tuple(scores.shape)}")
    _, inverse = torch.unique(group_index, return_inverse=True)
    n_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, torch.ones_like(scores)
    )
    sums = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, inverse, scores)
    means = sums / counts
    sq = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, (scores - means[inverse]) ** 2
    )
    stds = torch.sqrt(sq / (counts - 1).clamp(min=1))
    single = counts <= 1
    means = torch.where(single, torch.zeros_like(means), means)
    stds = torch.where(single, torch.ones_like(stds), stds)
    return means[inverse], stds[inverse], counts[inverse]


class RunningMeanStd:
    """Streaming mean / population variance (Chan et al. parallel update), kept in float64.

    Used for ``reward_norm: running``: the scale of rewards is estimated over the whole run rather
    than per batch, so a batch where every sample got the same reward is not blown up to unit
    variance. ``state_dict`` / ``load_state_dict`` make it checkpointable.
    """

    def __init__(self, epsilon: float = 0.0):
        self.mean = 0.0
        self.var = 1.0
        self.count = float(epsilon)

    def update(self, x) -> None:
        x = torch.as_tensor(x).detach().to(torch.float64).reshape(-1)
        n = x.numel()
        if n == 0:
            return
        b_mean = x.mean().item()
        b_var = x.var(unbiased=False).item() if n > 1 else 0.0
        if self.count == 0:
            self.mean, self.var, self.count = b_mean, b_var, float(n)
            return
        tot = self.count + n
        delta = b_mean - self.mean
        m2 = self.var * self.count + b_var * n + delta * delta * self.count * n / tot
        self.mean = self.mean + delta * n / tot
        self.var = m2 / tot
        self.count = tot

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state_dict(self) -> dict:
        return {"mean": self.mean, "var": self.var, "count": self.count}

    def load_state_dict(self, state: dict) -> None:
        missing = {"mean", "var", "count"} - set(state)
        if missing:
            raise ValueError(f"RunningMeanStd state is missing keys {sorted(missing)}")
        self.mean, self.var, self.count = float(state["mean"]), float(state["var"]), float(state["count"])


def clip_rewards(scores: torch.Tensor, clip: Optional[float]) -> torch.Tensor:
    """Clamp scores to ``[-clip, clip]``; ``None`` leaves them unchanged."""
    if clip is None:
        return scores
    if clip <= 0:
        raise ValueError(f"reward_clip must be > 0 or None, got {clip}")
    return scores.clamp(-clip, clip)


def overlong_penalty(lengths: torch.Tensor, max_length: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft over-length punishment, added to each sample's score: ``[B]`` penalties, all ``<= 0``.

    ``0`` up to ``max_length - buffer_len`` tokens, then a linear ramp to ``-factor`` at ``max_length``
    (and beyond): ``min(0, -(L - (max_length - buffer_len)) / buffer_len * factor)``. A truncated answer is
    usually wrong *because* it ran out of room; a hard penalty would punish the reasoning before the cut as
    much as the length, the ramp tells the policy "shorter" smoothly. ``buffer_len=0`` turns it off.
    """
    if buffer_len < 0 or buffer_len > max_length:
        raise ValueError(f"overlong buffer_len must be in [0, max_length={max_length}], got {buffer_len}")
    if factor < 0:
        raise ValueError(f"overlong penalty factor must be >= 0, got {factor}")
    lengths = torch.as_tensor(lengths)
    if buffer_len == 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    exceed = lengths.to(torch.float32) - float(max_length - buffer_len)
    return (-exceed / buffer_len * factor).clamp(max=0.0, min=-float(factor))


REWARD_NORM_MODES = ("batch", "group", "running")


def normalize_rewards(
    scores: torch.Tensor,
    mode: Optional[str],
    *,
    group_index: Optional[torch.Tensor] = None,
    running: Optional[RunningMeanStd] = None,
    shift_only: bool = False,
    scale_only: bool = False,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Normalise per-sample scores ``[B]`` by batch, group or running statistics.

    ``shift_only`` subtracts the mean only (a baseline without changing the scale); ``scale_only``
    divides by the std only (keeps the sign of each reward, the usual PPO reward scaling); neither
    gives ``(x - mean) / (std + eps)``. ``mode=None`` returns the scores unchanged. For ``running``
    the tracker is updated with this batch first, so the first batch is normalised by its own stats.
    """
    if mode is None:
        return scores
    if shift_only and scale_only:
        raise ValueError("reward normalisation: shift_only and scale_only are mutually exclusive (set at most one)")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D [B], got shape {tuple(scores.shape)}")
    if mode == "batch":
        mean = scores.mean()
        std = scores.std() if scores.numel() > 1 else torch.ones((), dtype=scores.dtype, device=scores.device)
    elif mode == "group":
        mean, std, _ = group_mean_std(scores, group_index)
    elif mode == "running":
        if running is None:
            raise ValueError("reward_norm 'running' needs a RunningMeanStd instance (running=...)")
        running.update(scores)
        mean = torch.tensor(running.mean, dtype=scores.dtype, device=scores.device)
        std = torch.tensor(running.std, dtype=scores.dtype, device=scores.device)
    else:
        raise ValueError(f"unknown reward_norm {mode!r}; allowed: {', '.join(REWARD_NORM_MODES)} or None")
    if shift_only:
        return scores - mean
    if scale_only:
        return scores / (std + eps)
    return (scores - mean) / (std + eps)


def scores_to_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each sample's scalar score on its last valid response token (zeros elsewhere).

    This is the token-level reward layout every advantage estimator here consumes. A sample with no
    valid token gets no reward at all (there is no token to credit).
    """
    if scores.dim() != 1 or response_mask.dim() != 2 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"scores must be [B] and response_mask [B, T]; got {tuple(scores.shape)} and {tuple(response_mask.shape)}"
        )
    m = response_mask.bool()
    T = m.shape[1]
    positions = torch.arange(T, device=m.device).expand_as(m)
    last = torch.where(m, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(m.shape, dtype=scores.dtype, device=scores.device)
    has = last >= 0
    rows = torch.arange(m.shape[0], device=m.device)[has]
    out[rows, last[has]] = scores[has]
    return out
