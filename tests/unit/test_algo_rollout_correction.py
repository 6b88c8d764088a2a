"""Rollout correction by hand: token and sequence truncated IS, one- and two-sided masking (IcePop), rejection from
the loss mask by ratio and by KL statistics, normalisation to mean 1, and the ratio metrics."""

import math

import pytest
import torch

from asyncppo.algo import policy_loss, ratio_metrics, rollout_correction


def _lp(ratios_rows, mask_rows=None):
    """old / behaviour log-probs whose ratio old/behav is the given table; mask 1 where not None."""
    behav = torch.full((len(ratios_rows), len(ratios_rows[0])), -2.0, dtype=torch.float64)
    r = torch.tensor([[1.0 if x is None else x for x in row] for row in ratios_rows], dtype=torch.float64)
    mask = torch.tensor([[0.0 if x is None else 1.0 for x in row] for row in ratios_rows], dtype=torch.float64)
    return behav + torch.log(r), behav, mask


def _eq(t, rows):
    return torch.allclose(t.double(), torch.tensor(rows, dtype=torch.float64), rtol=1e-9, atol=1e-12)


def _rc(rows, **kw):
    old, behav, mask = _lp(rows)
    w, keep, m = rollout_correction(old, behav, mask, **kw)
    return w, keep, {k: float(v) for k, v in m.items()}


def test_token_truncation_modes():
    rows = [[0.3, 0.8, 1.5, 2.5]]
    w, keep, m = _rc(rows, truncation="clip", cap=2.0)
    assert _eq(w, [[0.3, 0.8, 1.5, 2.0]]) and keep.all()
    assert m["is_truncated_frac"] == 0.25 and m["is_masked_frac"] == 0.0 and m["is_weight_max"] == pytest.approx(2.0)
    w, keep, m = _rc(rows, truncation="mask", cap=2.0)
    assert _eq(w, [[0.3, 0.8, 1.5, 0.0]]) and keep.all()
    # two-sided IcePop: zero weights outside [0.5, 2]; the tokens stay in the mask (they still count in means)
    w, keep, m = _rc(rows, truncation="icepop", cap=2.0, cap_low=0.5)
    assert _eq(w, [[0.0, 0.8, 1.5, 0.0]]) and keep.all()
    assert m["is_truncated_frac"] == 0.5 and m["is_weight_mean"] == pytest.approx(2.3 / 4)


def test_sequence_level_truncated_is():
    # sequence ratios: 2 * 1.5 = 3 (capped at 2 on every token), 0.5 * 1 = 0.5; padding stays 0
    w, keep, m = _rc([[2.0, 1.5, None], [0.5, 1.0, 1.0]], level="sequence", cap=2.0)
    assert _eq(w, [[2.0, 2.0, 0.0], [0.5, 0.5, 0.5]])
    assert m["is_truncated_frac"] == pytest.approx(2 / 5)
    # the token-level weights of the same batch differ
    w, _, _ = _rc([[2.0, 1.5, None], [0.5, 1.0, 1.0]], level="token", cap=2.0)
    assert _eq(w, [[2.0, 1.5, 0.0], [0.5, 1.0, 1.0]])


def test_token_rejection_removes_tokens_from_the_loss_mask():
    w, keep, m = _rc([[0.3, 0.8, 1.5, 2.5]], rejection="token", rejection_low=0.5, rejection_high=2.0, cap=2.0)
    assert keep.tolist() == [[False, True, True, False]] and _eq(w, [[0.0, 0.8, 1.5, 0.0]])
    assert m["is_masked_frac"] == 0.5 and m["is_weight_mean"] == pytest.approx(1.15)
    # k3 = w - 1 - log w per token: 0.3 -> 0.504, 0.8 -> 0.023, 1.5 -> 0.095, 2.5 -> 0.584; keep k3 <= 0.1
    _, keep, _ = _rc([[0.3, 0.8, 1.5, 2.5]], rejection="token", rejection_stat="k3", rejection_low=0.0,
                     rejection_high=0.1)
    assert keep.tolist() == [[False, True, True, False]]
    # k1 = -log w: keep [-0.5, 0.5] -> ratios in [0.607, 1.649]
    _, keep, _ = _rc([[0.3, 0.8, 1.5, 2.5]], rejection="token", rejection_stat="k1", rejection_low=-0.5,
                     rejection_high=0.5)
    assert keep.tolist() == [[False, True, True, False]]


def test_sequence_rejection_by_product_and_by_mean_kl():
    rows = [[2.0, 1.5, None], [0.9, 1.1, 1.0], [0.5, 1.0, 1.0]]
    # product ratios 3, 0.99, 0.5: only the middle sequence lies in [0.6, 2]
    w, keep, m = _rc(rows, rejection="sequence", rejection_low=0.6, rejection_high=2.0)
    assert keep.tolist() == [[False, False, False], [True, True, True], [False, False, False]]
    assert m["is_masked_frac"] == pytest.approx(5 / 8) and w[0].abs().sum() == 0 and w[2].abs().sum() == 0
    # mean k2 = mean 0.5 log^2 w: seq 0 (0.120+0.041)/2 = 0.081, seq 1 ~0.005, seq 2 0.240/3 = 0.080
    expected = [(0.5 * math.log(2) ** 2 + 0.5 * math.log(1.5) ** 2) / 2,
                (0.5 * math.log(0.9) ** 2 + 0.5 * math.log(1.1) ** 2) / 3, 0.5 * math.log(0.5) ** 2 / 3]
    hi = (expected[0] + expected[2]) / 2  # between seq 2 (0.0801) and seq 0 (0.0806)
    assert expected[2] < hi < expected[0]
    _, keep, _ = _rc(rows, rejection="sequence", rejection_stat="k2", rejection_low=0.0, rejection_high=hi)
    assert keep.any(-1).tolist() == [False, True, True]


def test_normalisation_to_mean_one():
    w, keep, m = _rc([[0.3, 0.8, 1.5, 2.5]], rejection="token", rejection_low=0.5, rejection_high=2.0,
                     normalize=True)
    assert _eq(w, [[0.0, 0.8 / 1.15, 1.5 / 1.15, 0.0]])
    assert m["is_weight_mean"] == pytest.approx(1.0)
    # sequence level: the mean over kept sequences (3 -> capped 2, and 0.5) is 1.25
    w, _, _ = _rc([[2.0, 1.5, None], [0.5, 1.0, 1.0]], level="sequence", cap=2.0, normalize=True)
    assert _eq(w, [[1.6, 1.6, 0.0], [0.4, 0.4, 0.4]])


def test_ratio_metrics_by_hand():
    log_w = torch.log(torch.tensor([[0.5, 1.0, 2.0, 4.0, 99.0]], dtype=torch.float64))
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    m = {k: float(v) for k, v in ratio_metrics(log_w, mask).items()}
    # linear interpolation over [0.5, 1, 2, 4]: p50 at position 1.5, p25 at 0.75, p95 at 2.85
    assert m["is_ratio_p50"] == pytest.approx(1.5)
    assert m["is_ratio_p25"] == pytest.approx(0.5 + 0.75 * 0.5)
    assert m["is_ratio_p95"] == pytest.approx(2.0 + 0.85 * 2.0)
    assert m["is_chi2_token"] == pytest.approx((0.25 + 1 + 4 + 16) / 4 - 1)
    assert m["is_chi2_seq"] == pytest.approx(4.0 ** 2 - 1)  # one sequence, W = 0.5 * 1 * 2 * 4 = 4
    on_policy = {k: float(v) for k, v in ratio_metrics(torch.zeros(2, 3), torch.ones(2, 3)).items()}
    assert on_policy["is_chi2_token"] == 0.0 and on_policy["is_chi2_seq"] == 0.0 and on_policy["is_ratio_p05"] == 1


def test_weights_reach_the_loss_and_bad_arguments_are_named():
    old, behav, mask = _lp([[1.5, 3.0, 0.5]])
    w, keep, _ = rollout_correction(old, behav, mask, truncation="icepop", cap=2.0, cap_low=0.6)
    logp = old.clone().requires_grad_(True)
    loss, _ = policy_loss(logp, old, torch.ones_like(old), keep, is_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-1.5 / 3) and _eq(logp.grad, [[-0.5, 0.0, 0.0]])
    with pytest.raises(ValueError, match="clip, mask, icepop"):
        rollout_correction(old, behav, mask, truncation="cap")
    with pytest.raises(ValueError, match="icepop needs"):
        rollout_correction(old, behav, mask, truncation="icepop", cap=2.0, cap_low=3.0)
    with pytest.raises(ValueError, match="low < high"):
        rollout_correction(old, behav, mask, rejection="token", rejection_low=2.0, rejection_high=1.0)
    with pytest.raises(ValueError, match="ratio, k1, k2, k3"):
        rollout_correction(old, behav, mask, rejection="token", rejection_stat="k4")


@pytest.mark.parametrize("kw", [dict(truncation="clip", cap=2.0), dict(level="sequence", truncation="mask", cap=2.0),
                                dict(rejection="token", rejection_low=0.5, rejection_high=2.0, normalize=True)])
def test_without_figures_the_weights_and_mask_are_the_same(kw):
    """``figures=False`` (a micro-batch's share of a fused step) skips the metrics only, never the weights."""
    old, behav, mask = _lp([[0.3, 0.8, 1.5, 2.5], [1.1, 4.0, 0.9, None]])
    w, keep, m = rollout_correction(old, behav, mask, **kw)
    w2, keep2, m2 = rollout_correction(old, behav, mask, figures=False, **kw)
    assert m and m2 == {}
    assert torch.equal(w, w2) and torch.equal(keep, keep2)
