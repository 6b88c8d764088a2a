"""KL estimators against closed forms, straight-through gradients, KL-in-reward and controllers."""

import math
from types import SimpleNamespace

import pytest
import torch

from asyncppo.algo import (
    AdaptiveKLController,
    FixedKLController,
    KL_ESTIMATORS,
    apply_kl_to_rewards,
    get_kl_controller,
    kl_controller_from_config,
    kl_loss,
    kl_penalty,
    mismatch_kl,
)


def _pair(seed=0):
    gen = torch.Generator().manual_seed(seed)
    logp = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    ref = -torch.rand(3, 5, generator=gen, dtype=torch.float64) * 3
    return logp, ref


CLOSED_FORMS = {
    "kl": lambda d: d,
    "k1": lambda d: d,
    "abs": lambda d: d.abs(),
    "mse": lambda d: 0.5 * d * d,
    "k2": lambda d: 0.5 * d * d,
    "low_var_kl": lambda d: torch.exp(-d) + d - 1,
    "k3": lambda d: torch.exp(-d) + d - 1,
}


@pytest.mark.parametrize("kind", sorted(CLOSED_FORMS))
def test_estimators_match_closed_form(kind):
    logp, ref = _pair()
    d = logp - ref
    assert torch.allclose(kl_penalty(logp, ref, kind), CLOSED_FORMS[kind](d), atol=1e-12)
    # the '+' variant reports the same value
    assert torch.allclose(kl_penalty(logp, ref, kind + "+"), CLOSED_FORMS[kind](d), atol=1e-12)


def test_k3_single_value_by_hand_and_clamp():
    # d = log 2: exp(-d) + d - 1 = 0.5 + ln 2 - 1
    v = kl_penalty(torch.tensor([[math.log(2.0)]]), torch.tensor([[0.0]]), "low_var_kl")
    assert v.item() == pytest.approx(0.5 + math.log(2) - 1, rel=1e-6)
    # an extreme token is capped at 10 rather than exp(30)
    big = kl_penalty(torch.tensor([[-30.0]]), torch.tensor([[0.0]]), "k3")
    assert big.item() == pytest.approx(10.0)


def test_full_kl_over_tiny_vocab_by_hand():
    # p = [.5, .25, .25], q uniform: KL = .5 ln 1.5 + 2 * .25 ln .75
    p = torch.log(torch.tensor([0.5, 0.25, 0.25])) + 1.7  # logits up to an additive constant
    q = torch.zeros(3)
    logits = p.view(1, 1, 3).expand(2, 2, 3)
    ref_logits = q.view(1, 1, 3).expand(2, 2, 3)
    dummy = torch.zeros(2, 2)
    v = kl_penalty(dummy, dummy, "full", logits=logits, ref_logits=ref_logits)
    expected = 0.5 * math.log(1.5) + 0.5 * math.log(0.75)
    assert v.shape == (2, 2)
    assert torch.allclose(v, torch.full((2, 2), expected), atol=1e-6)
    with pytest.raises(ValueError, match="logits"):
        kl_penalty(dummy, dummy, "full")


@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "low_var_kl", "k3", "mse", "full"])
def test_plus_variants_have_k2_gradient(kind):
    logp, ref = _pair(1)
    a = logp.clone().requires_grad_(True)
    b = logp.clone().requires_grad_(True)
    kw = {}
    if kind == "full":
        kw = dict(logits=torch.randn(3, 5, 4, dtype=torch.float64), ref_logits=torch.randn(3, 5, 4, dtype=torch.float64))
    kl_penalty(a, ref, kind + "+", **kw).sum().backward()
    kl_penalty(b, ref, "k2").sum().backward()
    assert torch.allclose(a.grad, b.grad)
    assert torch.allclose(a.grad, logp - ref)  # d/dlogp 0.5 d^2 = d


def test_apply_kl_to_rewards_by_hand():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.6, 99.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.float32)
    shaped, m = apply_kl_to_rewards(rewards, kl, 0.5, mask)
    assert shaped.tolist()[0] == pytest.approx([-0.05, -0.1, 0.85])
    assert shaped.tolist()[1] == pytest.approx([-0.2, 1.7, 0.0])
    assert not shaped.requires_grad
    # per-sequence mean KL, then batch mean: (0.2 + 0.5) / 2
    assert float(m["kl"]) == pytest.approx(0.35)
    assert m["kl_coef"] == 0.5


def test_kl_loss_aggregates_like_policy_loss():
    logp = torch.log(torch.tensor([[0.5, 0.5], [0.25, 0.9]]))
    ref = torch.log(torch.tensor([[0.25, 0.5], [0.5, 0.1]]))
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.float32)
    loss, m = kl_loss(logp, ref, mask, "k1")
    assert loss.item() == pytest.approx((math.log(2) + 0 + math.log(0.5)) / 3, abs=1e-6)


def test_adaptive_controller_follows_formula():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    expected = 0.1
    for kl, n in [(7.2, 256), (6.3, 256), (3.0, 512), (6.0, 100)]:
        err = min(max(kl / 6.0 - 1, -0.2), 0.2)
        expected *= 1 + err * n / 10000
        ctl.update(kl, n)
        assert ctl.value == pytest.approx(expected, rel=1e-12)
    # by hand for the first step: clip(0.2) -> 0.1 * (1 + 0.2 * 256 / 10000)
    first = AdaptiveKLController(0.1, 6.0, 10000)
    first.update(7.2, 256)
    assert first.value == pytest.approx(0.100512)
    restored = AdaptiveKLController(1.0, 1.0, 1)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value and restored.target == 6.0 and restored.horizon == 10000


def test_fixed_controller_and_registry():
    ctl = get_kl_controller("fixed", 0.05)
    assert isinstance(ctl, FixedKLController)
    ctl.update(100.0, 1000)
    assert ctl.value == 0.05
    cfg = SimpleNamespace(type="adaptive", init_kl_coef=0.2, target_kl=0.1, kl_horizon=100)
    assert isinstance(kl_controller_from_config(cfg), AdaptiveKLController)
    with pytest.raises(ValueError, match="fixed, adaptive"):
        get_kl_controller("pid", 0.1)
    with pytest.raises(ValueError, match="target_kl"):
        AdaptiveKLController(0.1, 0.0, 10)


def test_unknown_kl_kind_lists_allowed():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError) as e:
        kl_penalty(x, x, "k4")
    for name in KL_ESTIMATORS:
        assert name in str(e.value)
    assert "'+'" in str(e.value)


def test_full_kl_from_logits_alone_and_other_estimators_refuse_none():
    logits = torch.tensor([[[0.0, 1.0, 2.0]]])
    ref = torch.tensor([[[2.0, 1.0, 0.0]]])
    p = torch.softmax(logits, -1)[0, 0]
    q = torch.softmax(ref, -1)[0, 0]
    expected = float((p * (p.log() - q.log())).sum())
    # the KL-in-reward path passes no sampled log-probs
    assert kl_penalty(None, None, "full", logits=logits, ref_logits=ref).item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError, match="only 'full'"):
        kl_penalty(None, None, "k3")


def test_mismatch_kl_is_the_masked_mean_of_k3_from_the_behaviour_side():
    behaviour = torch.zeros(1, 3, dtype=torch.float64)
    proximal = torch.tensor([[math.log(2.0), 0.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0]])
    # token 0: d = behav - prox = -log 2, k3 = e^{log 2} - log 2 - 1 = 1 - log 2 = 0.306853; token 1: 0; token 2 masked
    assert float(mismatch_kl(behaviour, proximal, mask)) == pytest.approx((1 - math.log(2.0)) / 2, abs=1e-12)
    assert float(mismatch_kl(behaviour, proximal, mask)) == pytest.approx(0.1534264097, abs=1e-9)
    # the order matters: KL(proximal || behaviour) would give k3(log 2) = 1/2 - 1 + log 2 = 0.193147 on token 0
    assert float(mismatch_kl(proximal, behaviour, mask)) == pytest.approx(0.0965735903, abs=1e-9)
