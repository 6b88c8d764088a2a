"""Reward clipping / normalisation, running moments and masked statistics."""

import numpy as np
import pytest
import torch

from asyncppo.algo import (
    overlong_penalty,
    RunningMeanStd,
    clip_rewards,
    group_mean_std,
    masked_mean,
    masked_var,
    normalize_rewards,
    scores_to_token_rewards,
)


def test_running_mean_std_matches_numpy_over_stream():
    rng = np.random.default_rng(0)
    rms = RunningMeanStd()
    seen = []
    for size in [1, 5, 17, 3, 64, 2]:
        batch = rng.normal(3.0, 2.5, size=size)
        rms.update(torch.tensor(batch))
        seen.append(batch)
        allv = np.concatenate(seen)
        assert rms.mean == pytest.approx(allv.mean(), rel=1e-12)
        assert rms.var == pytest.approx(allv.var(), rel=1e-10)
        assert rms.count == allv.size
    clone = RunningMeanStd()
    clone.load_state_dict(rms.state_dict())
    assert clone.state_dict() == rms.state_dict()
    with pytest.raises(ValueError, match="count"):
        clone.load_state_dict({"mean": 0.0, "var": 1.0})


def test_batch_normalisation_modes_by_hand():
    s = torch.tensor([1.0, 2.0, 3.0, 6.0])  # mean 3, unbiased std sqrt(14/3)
    std = (14 / 3) ** 0.5
    assert normalize_rewards(s, "batch", eps=0.0).tolist() == pytest.approx([-2 / std, -1 / std, 0.0, 3 / std])
    assert normalize_rewards(s, "batch", shift_only=True).tolist() == pytest.approx([-2.0, -1.0, 0.0, 3.0])
    assert normalize_rewards(s, "batch", scale_only=True, eps=0.0).tolist() == pytest.approx(
        [1 / std, 2 / std, 3 / std, 6 / std]
    )
    assert normalize_rewards(s, None) is s
    with pytest.raises(ValueError, match="mutually exclusive"):
        normalize_rewards(s, "batch", shift_only=True, scale_only=True)
    with pytest.raises(ValueError, match="batch, group, running"):
        normalize_rewards(s, "global")


def test_group_normalisation_by_hand():
    s = torch.tensor([1.0, 10.0, 3.0, 20.0, 7.0])
    g = torch.tensor([0, 1, 0, 1, 2])
    out = normalize_rewards(s, "group", group_index=g, shift_only=True)
    # groups: {1, 3} mean 2 ; {10, 20} mean 15 ; singleton keeps its score
    assert out.tolist() == pytest.approx([-1.0, -5.0, 1.0, 5.0, 7.0])
    mean, std, count = group_mean_std(s, g)
    assert std.tolist() == pytest.approx([2**0.5, 50**0.5, 2**0.5, 50**0.5, 1.0])
    assert count.tolist() == [2, 2, 2, 2, 1]
    with pytest.raises(ValueError, match="group_index"):
        normalize_rewards(s, "group")


def test_running_normalisation_uses_stream_statistics():
    rms = RunningMeanStd()
    first = torch.tensor([0.0, 2.0])
    normalize_rewards(first, "running", running=rms)
    second = torch.tensor([4.0, 6.0])
    out = normalize_rewards(second, "running", running=rms, scale_only=True, eps=0.0)
    allv = np.array([0.0, 2.0, 4.0, 6.0])
    assert out.tolist() == pytest.approx((second.numpy() / allv.std()).tolist())
    with pytest.raises(ValueError, match="RunningMeanStd"):
        normalize_rewards(second, "running")


def test_clip_rewards():
    assert clip_rewards(torch.tensor([-5.0, 0.5, 5.0]), 1.0).tolist() == [-1.0, 0.5, 1.0]
    with pytest.raises(ValueError, match="reward_clip"):
        clip_rewards(torch.zeros(1), 0.0)


def test_scores_on_last_valid_token_and_masked_stats():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 0, 1]])
    out = scores_to_token_rewards(torch.tensor([1.0, 2.0, 3.0, 4.0]), mask)
    assert out.tolist() == [[0, 1, 0], [0, 0, 2], [0, 0, 0], [0, 0, 4]]
    x = torch.tensor([[1.0, 3.0, float("inf")]])
    m = torch.tensor([[1, 1, 0]])
    assert masked_mean(x, m).item() == 2.0
    assert masked_var(x, m).item() == pytest.approx(2.0)
    assert masked_var(x, m, unbiased=False).item() == pytest.approx(1.0)
    assert masked_mean(x, torch.zeros_like(m)).item() == 0.0


def test_overlong_penalty_ramp_by_hand():
    # response_length 16, buffer 4: no penalty up to 12 tokens, then -1/4 per token to -factor at 16
    lengths = torch.tensor([1, 12, 13, 14, 16])
    assert overlong_penalty(lengths, 16, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -1.0]
    assert overlong_penalty(lengths, 16, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(lengths, 16, 0).tolist() == [0.0] * 5
    with pytest.raises(ValueError, match="buffer_len"):
        overlong_penalty(lengths, 16, 17)
