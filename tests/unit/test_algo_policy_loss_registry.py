"""The policy-loss registry: gspo, cispo, gmpo, clip_cov, kl_cov, reinforce_tis by hand (values and gradients,
zero gradients where a clip or a selection applies), micro-batch invariance of every loss, and the registry agreeing
with the configuration's allowed values."""

import math

import pytest
import torch

from asyncppo import algo
from asyncppo.algo import POLICY_LOSSES, cov_select, policy_loss
from asyncppo.config import choices


def _run(name, ratios, advs, mask=None, **kw):
    """Loss and d loss / d logp for one row of tokens with the given ratios (old log-prob -1)."""
    old = torch.full((1, len(ratios)), -1.0, dtype=torch.float64)
    logp = (old + torch.log(torch.tensor([ratios], dtype=torch.float64))).requires_grad_(True)
    adv = torch.tensor([advs], dtype=torch.float64)
    m = torch.ones_like(old) if mask is None else torch.tensor([mask], dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, m, loss_name=name, **kw)
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), metrics


def test_registry_matches_the_configuration_choices():
    assert tuple(POLICY_LOSSES) == choices.POLICY_LOSSES
    assert tuple(algo.LOSS_AGG_MODES) == choices.LOSS_AGG_MODES
    assert algo.IS_TRUNCATIONS == choices.OFF_POLICY_TRUNCATIONS
    assert algo.IS_LEVELS == choices.OFF_POLICY_LEVELS
    assert algo.REJECTION_LEVELS == choices.REJECTION_LEVELS and algo.REJECTION_STATS == choices.REJECTION_STATS
    with pytest.raises(ValueError, match="gspo, cispo"):
        _run("grpo", [1.0], [1.0])


def test_gspo_sequence_ratio_by_hand():
    agg = dict(loss_agg_mode="seq-mean-token-mean")
    # s = exp(mean(log 1.1, log 1.3)) = sqrt(1.43) < 1.2: unclipped; each token's gradient is -A s / n
    s = math.sqrt(1.1 * 1.3)
    loss, grad, m = _run("gspo", [1.1, 1.3], [1.0, 1.0], **agg)
    assert loss == pytest.approx(-s) and grad == pytest.approx([-s / 2, -s / 2])
    assert float(m["clipfrac"]) == 0.0
    # s = sqrt(1.1 * 1.5) = 1.2845 > 1.2 with A > 0: clipped as a whole, no token gets a gradient
    loss, grad, m = _run("gspo", [1.1, 1.5], [1.0, 1.0], **agg)
    assert loss == pytest.approx(-1.2) and grad == [0.0, 0.0] and float(m["clipfrac_high"]) == 1.0
    # the same sequence with A < 0 is on the pessimistic (unclipped) side: gradient s / n
    s = math.sqrt(1.1 * 1.5)
    loss, grad, _ = _run("gspo", [1.1, 1.5], [-1.0, -1.0], **agg)
    assert loss == pytest.approx(s) and grad == pytest.approx([s / 2, s / 2])
    # a token-level PPO would clip only the second token: the losses differ
    assert _run("ppo", [1.1, 1.5], [1.0, 1.0], **agg)[1] == pytest.approx([-1.1 / 2, 0.0])


def test_gmpo_clips_in_log_space_by_hand():
    # log ratios 0.0953 and 0.5878; clip_high=0.4 is a bound on the log ratio: the second becomes 0.4 (no gradient)
    kw = dict(clip_ratio_low=0.4, clip_ratio_high=0.4, loss_agg_mode="seq-mean-token-mean")
    g = math.exp((math.log(1.1) + 0.4) / 2)
    loss, grad, m = _run("gmpo", [1.1, 1.8], [1.0, 1.0], **kw)
    assert loss == pytest.approx(-g) and grad == pytest.approx([-g / 2, 0.0])
    assert float(m["clipfrac_high"]) == pytest.approx(0.5)
    # A < 0: the low side clips (log 0.5 = -0.693 < -0.4), the high side is unclipped (pessimistic)
    g = math.exp((-0.4 + math.log(1.8)) / 2)
    loss, grad, _ = _run("gmpo", [0.5, 1.8], [-1.0, -1.0], **kw)
    assert loss == pytest.approx(g) and grad == pytest.approx([0.0, g / 2])


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    # r = 1.5, A > 0: PPO gives no gradient; CISPO weights -A log pi by sg(clip(r)) = 1.2
    loss, grad, m = _run("cispo", [1.5], [1.0])
    assert loss == pytest.approx(-1.2) and grad == pytest.approx([-1.2]) and float(m["clipfrac_high"]) == 1.0
    assert _run("ppo", [1.5], [1.0])[1] == [0.0]
    # r = 0.5, A < 0: weight 0.8
    loss, grad, _ = _run("cispo", [0.5], [-1.0])
    assert loss == pytest.approx(0.8) and grad == pytest.approx([0.8])
    # inside the range it is plain REINFORCE weighted by r
    loss, grad, _ = _run("cispo", [1.1], [2.0])
    assert loss == pytest.approx(-2.2) and grad == pytest.approx([-2.2])


def test_reinforce_tis_truncates_the_stop_gradient_ratio():
    loss, grad, m = _run("reinforce_tis", [3.0, 0.5], [1.0, -1.0], tis_cap=2.0)
    # token-mean of (-1 * 2) and (+1 * 0.5); gradients -A min(r, 2) / 2
    assert loss == pytest.approx((-2.0 + 0.5) / 2) and grad == pytest.approx([-1.0, 0.25])
    assert float(m["clipfrac_high"]) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="tis_cap"):
        _run("reinforce_tis", [1.0], [1.0], tis_cap=0.0)


def test_cov_select_by_hand():
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0, 9.0]])
    logp = torch.tensor([[-0.5, -2.0, -3.0, -1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    # means over valid tokens: A 0, logp -1.625 -> covariances 1.125, 0.375, -1.375, -0.625 (the 5th is masked)
    assert cov_select(adv, logp, mask, "kl", 0.25).tolist() == [[True, False, False, False, False]]
    assert cov_select(adv, logp, mask, "kl", 0.5).tolist() == [[True, True, False, False, False]]
    assert cov_select(adv, logp, mask, "clip", 1.0, lb=0.3, ub=5.0).tolist() == [[True, True, False, False, False]]
    assert cov_select(adv, logp, mask, "clip", 1.0, lb=1.0, ub=5.0).tolist() == [[True, False, False, False, False]]
    # one token drawn at random among the two candidates, reproducibly from the generator
    picks = {tuple(cov_select(adv, logp, mask, "clip", 0.25, lb=0.3, generator=torch.Generator().manual_seed(s))
                   .nonzero()[:, 1].tolist()) for s in range(20)}
    assert picks == {(0,), (1,)}
    assert not cov_select(adv, logp, mask, "clip", 1.0, lb=2.0, ub=5.0).any()
    with pytest.raises(ValueError, match="ratio"):
        cov_select(adv, logp, mask, "kl", 0.0)


def test_clip_cov_and_kl_cov_on_selected_tokens():
    select = torch.tensor([[True, False]])
    # clip_cov: the selected token contributes nothing; the other is ordinary PPO (r = 1.1 inside the clip)
    loss, grad, m = _run("clip_cov", [1.5, 1.1], [1.0, 1.0], token_select=select)
    assert loss == pytest.approx(-1.1 / 2) and grad == pytest.approx([0.0, -1.1 / 2])
    assert float(m["cov_frac"]) == 0.5
    # kl_cov: unclipped -A r everywhere, + coef |log r| on the selected token (gradient -A r + coef sign(log r))
    loss, grad, _ = _run("kl_cov", [1.5, 1.1], [1.0, 1.0], token_select=select, kl_cov_coef=1.0)
    assert loss == pytest.approx((-1.5 + math.log(1.5) - 1.1) / 2)
    assert grad == pytest.approx([(-1.5 + 1.0) / 2, -1.1 / 2])
    # without a selection they are PPO and the unclipped surrogate
    assert _run("clip_cov", [1.5], [1.0])[0] == pytest.approx(-1.2)
    assert _run("kl_cov", [1.5], [1.0])[0] == pytest.approx(-1.5)


def test_is_weights_and_masked_tokens():
    # precomputed weights multiply the per-token loss; a masked token gets no gradient whatever its weight
    w = torch.tensor([[2.0, 0.0, 5.0]], dtype=torch.float64)
    loss, grad, _ = _run("ppo", [1.1, 1.1, 1.1], [1.0, 1.0, 1.0], mask=[1, 1, 0], is_weights=w)
    assert loss == pytest.approx((-2.2 + 0.0) / 2) and grad == pytest.approx([-2.2 / 2, 0.0, 0.0])


def _random_batch(seed, B=6, T=5):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 1, 3, 4, 2, 5])
    mask = (torch.arange(T) < lengths[:, None]).double()
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    logp = old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, T, generator=g, dtype=torch.float64)
    w = torch.rand(B, T, generator=g, dtype=torch.float64) * 2
    select = torch.rand(B, T, generator=g) < 0.3
    return logp, old, adv, mask, w, select


@pytest.mark.parametrize("name", list(POLICY_LOSSES))
@pytest.mark.parametrize("mode", list(algo.LOSS_AGG_MODES))
def test_every_loss_is_invariant_to_micro_batch_splitting(name, mode):
    logp, old, adv, mask, w, select = _random_batch(1)
    tokens, seqs = algo.count_tokens_and_seqs(mask)
    kw = dict(loss_name=name, loss_agg_mode=mode, global_tokens=tokens, global_seqs=seqs, norm_length=5,
              dual_clip=True, tis_cap=1.5)

    def loss_and_grad(rows_list):
        x = logp.clone().requires_grad_(True)
        total = 0.0
        for rows in rows_list:
            loss, _ = policy_loss(x[rows], old[rows], adv[rows], mask[rows], is_weights=w[rows],
                                  token_select=select[rows], **kw)
            total = total + loss
        total.backward()
        return float(total.detach()), x.grad

    whole_loss, whole_grad = loss_and_grad([torch.arange(6)])
    split_loss, split_grad = loss_and_grad([torch.tensor([0, 3]), torch.tensor([5]), torch.tensor([1, 2, 4])])
    assert split_loss == pytest.approx(whole_loss, rel=1e-12, abs=1e-12)
    torch.testing.assert_close(split_grad, whole_grad, rtol=1e-12, atol=1e-12)
    assert whole_grad[mask == 0].abs().max() == 0  # padding never receives a gradient
