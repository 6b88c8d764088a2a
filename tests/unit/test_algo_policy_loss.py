"""PPO clipped surrogate: hand-computed values and gradients, dual clip, off-policy weights."""

import math

import pytest
import torch

from asyncppo.algo import combine_actor_loss, entropy_from_logits, policy_loss, aggregate

OLD = -1.0  # log-prob of the old policy for single-token cases


def _one(ratio: float, adv: float, **kw):
    """Loss, d loss / d logp and metrics for a single valid token with the given ratio and advantage."""
    logp = torch.tensor([[OLD + math.log(ratio)]], dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[OLD]], dtype=torch.float64)
    a = torch.tensor([[adv]], dtype=torch.float64)
    mask = torch.ones(1, 1)
    loss, metrics = policy_loss(logp, old, a, mask, **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), metrics


# (ratio, advantage, expected loss, expected d loss/d logp, clipfrac_low, clipfrac_high)
# d(-A r)/d logp = -A r (since dr/dlogp = r); zero where the clip is active.
CASES = [
    (0.5, +1.0, -0.5, -0.5, 0.0, 0.0),  # A>0 below range: unclipped (pessimistic) branch wins
    (1.1, +1.0, -1.1, -1.1, 0.0, 0.0),  # A>0 inside
    (1.5, +1.0, -1.2, 0.0, 0.0, 1.0),  # A>0 above: clipped at 1+eps, no gradient
    (0.5, -1.0, 0.8, 0.0, 1.0, 0.0),  # A<0 below: clipped at 1-eps, no gradient
    (1.1, -1.0, 1.1, 1.1, 0.0, 0.0),  # A<0 inside
    (1.5, -1.0, 1.5, 1.5, 0.0, 0.0),  # A<0 above: unclipped branch wins (no dual clip)
    (1.5, +2.0, -2.4, 0.0, 0.0, 1.0),  # advantage scales the clipped value
]


@pytest.mark.parametrize("ratio,adv,loss,grad,cf_low,cf_high", CASES)
def test_clipped_surrogate_by_hand(ratio, adv, loss, grad, cf_low, cf_high):
    got_loss, got_grad, m = _one(ratio, adv, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert got_loss == pytest.approx(loss, abs=1e-6)
    assert got_grad == pytest.approx(grad, abs=1e-6)
    assert float(m["clipfrac_low"]) == cf_low
    assert float(m["clipfrac_high"]) == cf_high
    assert float(m["clipfrac"]) == cf_low + cf_high
    assert float(m["ratio_mean"]) == pytest.approx(ratio, rel=1e-6)
    # k3 estimate of KL(old || new) with r = new/old: r - log r - 1
    assert float(m["approx_kl"]) == pytest.approx(ratio - math.log(ratio) - 1, rel=1e-5, abs=1e-7)


def test_asymmetric_clip_higher():
    # high = 0.28: ratio 1.25 is inside for A>0 (a symmetric 0.2 clip would cut it at 1.2)
    loss, grad, m = _one(1.25, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx(-1.25) and grad == pytest.approx(-1.25)
    assert float(m["clipfrac"]) == 0.0
    loss, grad, m = _one(1.25, 1.0, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert loss == pytest.approx(-1.2) and grad == 0.0
    # The low side still clips at 0.8 for A<0
    loss, grad, m = _one(0.75, -1.0, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert loss == pytest.approx(0.8) and grad == 0.0 and float(m["clipfrac_low"]) == 1.0
    # clip_ratio_high=None means symmetric
    loss, _, _ = _one(1.5, 1.0, clip_ratio_low=0.1)
    assert loss == pytest.approx(-1.1)


def test_dual_clip_bounds_negative_advantage():
    # A=-1, r=5, c=3: min(max(5, 1.2), 3) = 3 and the bound is a constant (no gradient)
    loss, grad, m = _one(5.0, -1.0, dual_clip=True, clip_ratio_c=3.0)
    assert loss == pytest.approx(3.0) and grad == 0.0
    assert float(m["clipfrac_dual"]) == 1.0 and float(m["clipfrac"]) == 0.0
    # Below c the dual clip is inactive: ordinary unclipped branch
    loss, grad, m = _one(2.0, -1.0, dual_clip=True, clip_ratio_c=3.0)
    assert loss == pytest.approx(2.0) and grad == pytest.approx(2.0)
    assert float(m["clipfrac_dual"]) == 0.0
    # Positive advantages are untouched by the dual clip
    loss, grad, _ = _one(5.0, 2.0, dual_clip=True, clip_ratio_c=3.0)
    assert loss == pytest.approx(-2.4) and grad == 0.0
    # Without dual clip the same negative-advantage token costs 5
    loss, _, _ = _one(5.0, -1.0)
    assert loss == pytest.approx(5.0)
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _one(1.0, 1.0, dual_clip=True, clip_ratio_c=1.0)


def _offpolicy_batch():
    # 3 tokens, all inside the clip range (ratio 1) with A = 1, 2, -1.
    # behaviour weights pi_prox / pi_behav = 1.5, 3.0 (over cap 2), 0.5
    prox = torch.tensor([[-1.0, -2.0, -0.5]], dtype=torch.float64)
    behav = prox - torch.log(torch.tensor([[1.5, 3.0, 0.5]], dtype=torch.float64))
    logp = prox.clone().requires_grad_(True)
    adv = torch.tensor([[1.0, 2.0, -1.0]], dtype=torch.float64)
    return logp, prox, behav, adv, torch.ones(1, 3)


@pytest.mark.parametrize("mode", ["decoupled", "tis"])
def test_off_policy_truncated_weights_by_hand(mode):
    logp, prox, behav, adv, mask = _offpolicy_batch()
    old = prox.clone().requires_grad_(True)
    behav = behav.clone().requires_grad_(True)
    loss, m = policy_loss(
        logp, old, adv, mask, behavior_logprobs=behav, off_policy_correction=mode, off_policy_cap=2.0
    )
    # per token -A * r * w with r = 1: -1*1.5, -2*2 (truncated), +1*0.5 -> mean
    assert loss.item() == pytest.approx((-1.5 - 4.0 + 0.5) / 3)
    loss.backward()
    # d/dlogp (-A r w) = -A w r; weights are constants
    assert logp.grad.tolist()[0] == pytest.approx([-1.5 / 3, -4.0 / 3, 0.5 / 3])
    # stop-gradient: nothing flows into the proximal or behaviour log-probs
    assert old.grad is None and behav.grad is None
    assert float(m["is_weight_mean"]) == pytest.approx((1.5 + 2.0 + 0.5) / 3)
    assert float(m["is_weight_max"]) == pytest.approx(2.0)
    assert float(m["is_truncated_frac"]) == pytest.approx(1 / 3)
    # mismatch KL (k3, samples from behaviour): w - log w - 1 with w = pi_prox / pi_behav
    k3 = [w - math.log(w) - 1 for w in (1.5, 3.0, 0.5)]
    assert float(m["mismatch_kl"]) == pytest.approx(sum(k3) / 3)


def test_off_policy_mask_truncation_drops_tokens():
    logp, prox, behav, adv, mask = _offpolicy_batch()
    loss, m = policy_loss(
        logp, prox, adv, mask, behavior_logprobs=behav, off_policy_correction="decoupled",
        off_policy_cap=2.0, off_policy_truncation="mask",
    )
    assert loss.item() == pytest.approx((-1.5 + 0.0 + 0.5) / 3)


def test_decoupled_clips_against_proximal_not_behaviour():
    # logp/prox ratio 1.5 with A>0 is clipped at 1.2 regardless of how stale the behaviour policy is
    prox = torch.tensor([[-1.0]], dtype=torch.float64)
    behav = prox - math.log(1.25)  # weight 1.25
    logp = (prox + math.log(1.5)).requires_grad_(True)
    loss, m = policy_loss(logp, prox, torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1),
                          behavior_logprobs=behav, off_policy_correction="decoupled")
    assert loss.item() == pytest.approx(-1.2 * 1.25)
    loss.backward()
    assert logp.grad.item() == 0.0
    assert float(m["clipfrac_high"]) == 1.0


def test_none_ignores_behaviour_and_masked_tokens():
    logp = torch.tensor([[-1.0, -1.0, 5.0]], requires_grad=True)
    old = torch.tensor([[-1.0, -1.0, float("nan")]])
    adv = torch.tensor([[1.0, 3.0, float("inf")]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # behaviour log-probs are ignored without an off-policy correction
    same, _ = policy_loss(logp, old, adv, mask, behavior_logprobs=torch.full((1, 3), -9.0))
    loss, m = policy_loss(logp, old, adv, mask)
    assert loss.item() == pytest.approx(-2.0) and same.item() == loss.item()
    assert "is_weight_mean" not in m
    loss.backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, -1.5, 0.0])
    assert float(m["ratio_max"]) == pytest.approx(1.0) and float(m["ratio_min"]) == pytest.approx(1.0)


def test_ratio_metrics_and_seq_aggregation():
    logp = torch.log(torch.tensor([[0.5, 0.8, 0.1], [0.2, 0.1, 0.1]]))
    old = torch.log(torch.tensor([[0.5, 0.4, 0.1], [0.4, 0.1, 0.1]]))
    adv = torch.tensor([[1.0, 1.0, 1.0], [-1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    loss, m = policy_loss(logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    # ratios: 1, 2 (clipped to 1.2 for A>0) | 0.5 (clipped to 0.8 for A<0)
    # seq 0 mean: (-1 - 1.2) / 2 = -1.1 ; seq 1: 0.8 ; mean over 2 seqs
    assert loss.item() == pytest.approx((-1.1 + 0.8) / 2)
    assert float(m["ratio_max"]) == pytest.approx(2.0)
    assert float(m["ratio_min"]) == pytest.approx(0.5)
    assert float(m["ratio_mean"]) == pytest.approx((1 + 2 + 0.5) / 3)
    assert float(m["clipfrac"]) == pytest.approx(2 / 3)


def test_entropy_bonus_combination():
    logits = torch.randn(2, 3, 7, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    ent = aggregate(entropy_from_logits(logits), mask, "token-mean")
    pg = torch.tensor(0.25)
    total = combine_actor_loss(pg, ent, entropy_coef=0.01, kl_loss=torch.tensor(2.0), kl_loss_coef=0.1)
    assert total.item() == pytest.approx(0.25 - 0.01 * ent.item() + 0.2, rel=1e-6)
    assert combine_actor_loss(pg, ent, entropy_coef=0.0) is pg


def test_bad_arguments_are_named():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="none, decoupled, tis"):
        policy_loss(x, x, x, torch.ones(1, 2), off_policy_correction="vtrace")
    with pytest.raises(ValueError, match="behavior_logprobs"):
        policy_loss(x, x, x, torch.ones(1, 2), off_policy_correction="tis")
    with pytest.raises(ValueError, match="advantages shape"):
        policy_loss(x, x, torch.zeros(2, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="token-mean"):
        policy_loss(x, x, x, torch.ones(1, 2), loss_agg_mode="mean")
