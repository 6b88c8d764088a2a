"""Advantage estimators against hand numbers and a plain-Python GAE reference."""

import math

import pytest
import torch

from asyncppo.algo import (
    ADV_ESTIMATORS,
    clip_advantages,
    compute_advantages,
    discounted_returns,
    masked_whiten,
    scores_to_token_rewards,
)


def _gae_reference(rewards, values, mask, gamma, lambd):
    """Textbook GAE over the valid positions of each row, in plain Python floats."""
    B, T = len(rewards), len(rewards[0])
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        idx = [t for t in range(T) if mask[b][t]]
        nxt_v, last = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b][t] + gamma * nxt_v - values[b][t]
            last = delta + gamma * lambd * last
            adv[b][t] = last
            nxt_v = values[b][t]
    return adv


def _random_prefix_mask(B, T, gen):
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    return (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()


@pytest.mark.parametrize("gamma,lambd", [(1.0, 1.0), (0.99, 0.95), (0.9, 0.0), (0.5, 0.7)])
def test_gae_matches_python_reference(gamma, lambd):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = _random_prefix_mask(B, T, gen)
    mask[2, 3] = 0.0  # a hole inside a response is skipped, like a cut-out token
    rewards = torch.randn(B, T, generator=gen, dtype=torch.float64)
    values = torch.randn(B, T, generator=gen, dtype=torch.float64)
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=gamma, lambd=lambd)
    ref = _gae_reference(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lambd)
    assert torch.allclose(adv.double(), torch.tensor(ref, dtype=torch.float64), atol=1e-5)
    assert torch.allclose(ret, (adv + values.float()) * mask, atol=1e-5)


def test_gae_constant_values_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.full((1, 3), 0.5)
    mask = torch.ones(1, 3)
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=1.0, lambd=1.0)
    # deltas 0, 0, 0.5 -> every advantage is 1 - 0.5; returns are the undiscounted reward 1
    assert adv.tolist() == [pytest.approx([0.5, 0.5, 0.5])]
    assert ret.tolist() == [pytest.approx([1.0, 1.0, 1.0])]
    adv, ret = compute_advantages("gae", rewards, mask, values=values, gamma=0.9, lambd=0.8)
    # deltas: t2 = 1 - .5 = .5 ; t1 = t0 = .9 * .5 - .5 = -.05 ; gamma*lambd = .72
    # A2 = .5 ; A1 = -.05 + .72 * .5 = .31 ; A0 = -.05 + .72 * .31 = .1732
    assert adv.tolist() == [pytest.approx([0.1732, 0.31, 0.5])]
    assert ret.tolist() == [pytest.approx([0.6732, 0.81, 1.0])]


def test_gae_concatenated_trajectories_equal_each_alone():
    gen = torch.Generator().manual_seed(1)
    ra, va = torch.randn(1, 4, generator=gen), torch.randn(1, 4, generator=gen)
    rb, vb = torch.randn(1, 7, generator=gen), torch.randn(1, 7, generator=gen)
    adv_a, _ = compute_advantages("gae", ra, torch.ones(1, 4), values=va, gamma=0.95, lambd=0.9)
    adv_b, _ = compute_advantages("gae", rb, torch.ones(1, 7), values=vb, gamma=0.95, lambd=0.9)
    pad = lambda x, n: torch.cat([x, torch.full((1, n), 123.0)], dim=1)  # noqa: E731
    rewards = torch.cat([pad(ra, 3), rb])
    values = torch.cat([pad(va, 3), vb])
    mask = torch.cat([pad(torch.ones(1, 4), 3) * (torch.arange(7) < 4), torch.ones(1, 7)])
    adv, _ = compute_advantages("gae", rewards, mask, values=values, gamma=0.95, lambd=0.9)
    assert torch.allclose(adv[0, :4], adv_a[0], atol=1e-6)
    assert torch.all(adv[0, 4:] == 0)
    assert torch.allclose(adv[1], adv_b[0], atol=1e-6)


def test_masked_values_and_rewards_do_not_matter():
    gen = torch.Generator().manual_seed(2)
    B, T = 5, 8
    mask = _random_prefix_mask(B, T, gen)
    mask[1, 2] = 0.0
    rewards = torch.randn(B, T, generator=gen)
    values = torch.randn(B, T, generator=gen)
    base = compute_advantages("gae", rewards, mask, values=values, gamma=0.99, lambd=0.95)
    junk = torch.where(mask.bool(), values, torch.full_like(values, float("nan")))
    junk_r = torch.where(mask.bool(), rewards, torch.full_like(rewards, 1e6))
    other = compute_advantages("gae", junk_r, mask, values=junk, gamma=0.99, lambd=0.95)
    for x, y in zip(base, other):
        assert torch.equal(x, y)
        assert torch.all(x[~mask.bool()] == 0)


def test_grpo_by_hand_with_interleaved_groups():
    # groups (ids 7 and 3, interleaved): scores 7 -> [1, 0, 0, 1]; 3 -> [2, 4]
    scores = torch.tensor([1.0, 2.0, 0.0, 0.0, 4.0, 1.0])
    group = torch.tensor([7, 3, 7, 7, 3, 7])
    mask = torch.tensor([[1, 1, 0]] * 6, dtype=torch.float32)
    rewards = scores_to_token_rewards(scores, mask)
    adv, _ = compute_advantages("grpo", rewards, mask, group_index=group, eps=0.0)
    # group 7: mean .5, unbiased std sqrt(1/3); group 3: mean 3, std sqrt(2)
    s7, s3 = 0.5 / math.sqrt(1 / 3), 1.0 / math.sqrt(2)
    expected = torch.tensor([s7, -s3, -s7, -s7, s3, s7])
    assert torch.allclose(adv[:, 0], expected, atol=1e-6)
    assert torch.allclose(adv[:, 1], expected, atol=1e-6)
    assert torch.all(adv[:, 2] == 0)
    adv, _ = compute_advantages("grpo", rewards, mask, group_index=group, norm_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -1.0, -0.5, -0.5, 1.0, 0.5])
    # a singleton group has no baseline: its advantage is its raw score
    adv, _ = compute_advantages("grpo", rewards[:1], mask[:1], group_index=group[:1])
    assert adv[0, 0].item() == pytest.approx(1.0, rel=1e-5)
    # identical scores -> zero advantage, not NaN
    same = scores_to_token_rewards(torch.ones(3), torch.ones(3, 2))
    adv, _ = compute_advantages("grpo", same, torch.ones(3, 2), group_index=torch.zeros(3, dtype=torch.long))
    assert torch.all(adv == 0)


def test_grpo_score_includes_per_token_rewards():
    # KL-in-reward: the GRPO score is the sum of all token rewards of the sample
    rewards = torch.tensor([[-0.1, -0.1, 1.0], [0.0, -0.2, 0.0]])
    mask = torch.ones(2, 3)
    adv, _ = compute_advantages("grpo", rewards, mask, group_index=torch.tensor([0, 0]), norm_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([0.5, -0.5])


def test_rloo_by_hand():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 5.0])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 2])
    mask = torch.ones(7, 2)
    adv, _ = compute_advantages("rloo", scores_to_token_rewards(scores, mask), mask, group_index=group)
    # score minus the mean of the *other* samples; a singleton keeps its raw score
    assert adv[:, 0].tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 5.0])
    assert torch.equal(adv[:, 0], adv[:, 1])


def test_reinforce_returns_by_hand():
    rewards = torch.tensor([[0.5, 0.0, 1.0, 9.0], [0.0, 7.0, 2.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1]], dtype=torch.float32)
    adv, ret = compute_advantages("reinforce", rewards, mask, gamma=0.9)
    # row 0: G2 = 1, G1 = .9, G0 = .5 + .81 ; row 1 skips the masked token: G3 = 0, G2 = 2, G0 = .9 * 2
    assert adv.tolist()[0] == pytest.approx([1.31, 0.9, 1.0, 0.0])
    assert adv.tolist()[1] == pytest.approx([1.8, 0.0, 2.0, 0.0])
    assert torch.equal(adv, ret)
    # REINFORCE is GAE with a zero critic and lambda = 1
    gae, _ = compute_advantages("gae", rewards, mask, values=torch.zeros(2, 4), gamma=0.9, lambd=1.0)
    assert torch.allclose(gae, adv)


def test_reinforce_plus_plus_whitens_returns_over_valid_tokens():
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.float32)
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=1.0)
    assert ret.tolist() == [[1.0, 1.0, 0.0], [3.0, 3.0, 3.0]]
    valid = torch.tensor([1.0, 1.0, 3.0, 3.0, 3.0])
    expected = (valid - valid.mean()) / valid.std()
    assert torch.allclose(adv[mask.bool()], expected, atol=1e-5)
    assert adv[0, 2] == 0


def test_reinforce_plus_plus_baseline_by_hand():
    scores = torch.tensor([1.0, 3.0, 10.0, 10.0])
    group = torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]], dtype=torch.float32)
    adv, _ = compute_advantages(
        "reinforce_plus_plus_baseline", scores_to_token_rewards(scores, mask), mask, group_index=group
    )
    # group-centred scores -1, +1, 0, 0 broadcast over valid tokens: [-1,-1, 1, 0,0, 0,0]; then whitened
    valid = torch.tensor([-1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0])
    expected = (valid - valid.mean()) / valid.std()
    assert torch.allclose(adv[mask.bool()], expected, atol=1e-5)
    assert adv[1, 1] == 0


def test_whitening_ignores_masked_positions():
    x = torch.tensor([[1.0, 2.0, 1e9], [3.0, float("nan"), -1e9]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    w = masked_whiten(x, mask, eps=0.0)
    v = torch.tensor([1.0, 2.0, 3.0])
    assert torch.allclose(w[mask.bool()], (v - 2.0) / 1.0)
    assert torch.all(w[~mask.bool()] == 0)
    # shift_mean=False keeps the mean, only rescales
    w2 = masked_whiten(x, mask, shift_mean=False, eps=0.0)
    assert torch.allclose(w2[mask.bool()], v / 1.0 - 2.0 + 2.0)


def test_whiten_and_clip_options():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 5.0]])
    mask = torch.ones(2, 2)
    adv, ret = compute_advantages("gae", rewards, mask, values=torch.zeros(2, 2), whiten=True, clip=0.5)
    assert adv.abs().max() <= 0.5 and ret.tolist() == [[1.0, 1.0], [5.0, 5.0]]
    assert clip_advantages(torch.tensor([-3.0, 0.1, 3.0]), 1.0).tolist() == pytest.approx([-1.0, 0.1, 1.0])
    assert discounted_returns(rewards, mask, 0.5).tolist() == [[0.5, 1.0], [2.5, 5.0]]


def test_registry_errors_are_clear():
    r, m = torch.zeros(2, 2), torch.ones(2, 2)
    with pytest.raises(ValueError) as e:
        compute_advantages("ppo", r, m)
    for name in ADV_ESTIMATORS:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="group_index"):
        compute_advantages("grpo", r, m)
    with pytest.raises(ValueError, match="values"):
        compute_advantages("gae", r, m)
    with pytest.raises(ValueError, match="lambd"):
        compute_advantages("gae", r, m, values=r, lambd=1.5)
    assert set(ADV_ESTIMATORS) == {
        "gae", "grpo", "rloo", "reinforce", "reinforce_plus_plus", "reinforce_plus_plus_baseline"
    }


@pytest.mark.parametrize("name", ["gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline"])
def test_whitening_uses_1e_8_on_the_variance(name):
    # Low-variance advantages: x = 0.5 +- 0.001 (unbiased var 2e-6 over 4 tokens, incl. Bessel). With eps 1e-8 on
    # the variance the scale is 1/sqrt(2.01e-6); the old GRPO epsilon 1e-6 would give 1/sqrt(3e-6): ~18% smaller.
    rewards = torch.tensor([[0.501], [0.499], [0.501], [0.499]], dtype=torch.float64)
    mask = torch.ones(4, 1, dtype=torch.float64)
    group = torch.tensor([0, 0, 1, 1])
    values = torch.full((4, 1), 0.0, dtype=torch.float64) if name == "gae" else None
    adv, _ = compute_advantages(name, rewards, mask, values=values, group_index=group, whiten=name == "gae")
    var = 4 * 0.001 ** 2 / 3
    expected = 0.001 / math.sqrt(var + 1e-8)
    assert adv[:, 0].tolist() == pytest.approx([expected, -expected, expected, -expected], rel=1e-9)
    assert expected / (0.001 / math.sqrt(var + 1e-6)) > 1.15


def test_grpo_keeps_its_std_epsilon():
    # an all-equal group gives 0, not NaN; a group (0, 1) gives +-0.5 / (std + 1e-6) with std = sqrt(0.5)
    rewards = torch.tensor([[1.0], [1.0], [0.0], [1.0]])
    adv, _ = compute_advantages("grpo", rewards, torch.ones(4, 1), group_index=torch.tensor([0, 0, 1, 1]))
    s = math.sqrt(0.5) + 1e-6
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.0, -0.5 / s, 0.5 / s], rel=1e-6)
