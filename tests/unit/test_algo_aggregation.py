"""Loss aggregation modes: hand numbers and invariance to micro-batch splitting (loss and gradient)."""

import pytest
import torch

from asyncppo.algo import LOSS_AGG_MODES, aggregate, count_tokens_and_seqs, loss_denominators, policy_loss, value_loss

LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.float32)  # row 2 is padding


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),  # the all-masked row is not a sequence
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", (3 / 3 + 4 / 3) / 2),  # default norm_length = T = 3
    ],
)
def test_modes_by_hand(mode, expected):
    assert aggregate(LOSS, MASK, mode).item() == pytest.approx(expected)


def test_explicit_counts_and_norm_length():
    assert aggregate(LOSS, MASK, "token-mean", global_tokens=14).item() == pytest.approx(7 / 14)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum", global_seqs=7).item() == pytest.approx(1.0)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_length=10).item() == pytest.approx(0.35)
    assert count_tokens_and_seqs(MASK) == (3, 2)


def test_masked_nan_does_not_leak():
    loss = LOSS.clone().requires_grad_(True)
    poisoned = torch.where(MASK.bool(), loss, torch.full_like(loss, float("nan")))
    for mode in LOSS_AGG_MODES:
        out = aggregate(poisoned, MASK, mode)
        assert torch.isfinite(out)


def _make_batch(seed=0, B=7, T=6):
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([1, 6, 3, 4, 6, 2, 5])[:B]
    mask = (torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)).float()
    x = torch.randn(B, T, 4, generator=gen, dtype=torch.float64)
    return x, mask


SPLITS = [[3, 4], [1, 1, 5], [2, 2, 2, 1]]


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
@pytest.mark.parametrize("split", SPLITS)
def test_micro_batch_invariance_loss_and_grad(mode, split):
    x, mask = _make_batch()
    w = torch.randn(4, dtype=torch.float64, requires_grad=True)

    def loss_mat(xs):
        return torch.tanh(xs @ w) ** 2 + xs[..., 0] * w[1]

    whole = aggregate(loss_mat(x), mask, mode, norm_length=6)
    (g_whole,) = torch.autograd.grad(whole, w)

    n_tok, n_seq = count_tokens_and_seqs(mask)
    total, grad = 0.0, torch.zeros_like(w)
    for xs, ms in zip(torch.split(x, split), torch.split(mask, split)):
        # each micro-batch trimmed to its own width: different padding must not matter
        width = int(ms.sum(-1).max().item())
        part = aggregate(loss_mat(xs[:, :width]), ms[:, :width], mode,
                         global_tokens=n_tok, global_seqs=n_seq, norm_length=6)
        (g,) = torch.autograd.grad(part, w)
        total, grad = total + part.item(), grad + g
    assert total == pytest.approx(whole.item(), rel=1e-12)
    assert torch.allclose(grad, g_whole, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", list(LOSS_AGG_MODES))
def test_policy_and_value_loss_micro_batch_invariance(mode):
    gen = torch.Generator().manual_seed(3)
    x, mask = _make_batch(1)
    old = -torch.rand(7, 6, generator=gen, dtype=torch.float64)
    behav = old + 0.3 * torch.randn(7, 6, generator=gen, dtype=torch.float64)
    adv = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    ret = torch.randn(7, 6, generator=gen, dtype=torch.float64)
    w = torch.zeros(4, dtype=torch.float64)
    w[0] = 0.4
    w.requires_grad_(True)

    def losses(sl):
        out = x[sl] @ w
        pl, _ = policy_loss(old[sl] + out, old[sl], adv[sl], mask[sl], clip_ratio_low=0.1, dual_clip=True,
                            behavior_logprobs=behav[sl], off_policy_correction="decoupled",
                            loss_agg_mode=mode, global_tokens=n_tok, global_seqs=n_seq, norm_length=6)
        vl, _ = value_loss(out, torch.zeros_like(out), ret[sl], mask[sl], value_clip=0.2, loss_agg_mode=mode,
                           global_tokens=n_tok, global_seqs=n_seq, norm_length=6)
        return pl + 0.5 * vl

    n_tok, n_seq = count_tokens_and_seqs(mask)
    whole = losses(slice(0, 7))
    (g_whole,) = torch.autograd.grad(whole, w)
    total, grad = 0.0, torch.zeros_like(w)
    for a, b in [(0, 2), (2, 3), (3, 7)]:
        part = losses(slice(a, b))
        (g,) = torch.autograd.grad(part, w)
        total, grad = total + part.item(), grad + g
    assert total == pytest.approx(whole.item(), rel=1e-10)
    assert torch.allclose(grad, g_whole, rtol=1e-9, atol=1e-12)
    assert g_whole.abs().sum() > 0


def test_unknown_mode_lists_allowed():
    with pytest.raises(ValueError) as e:
        aggregate(LOSS, MASK, "sum")
    for name in LOSS_AGG_MODES:
        assert name in str(e.value)
    with pytest.raises(ValueError, match="global_tokens"):
        aggregate(LOSS, MASK, "token-mean", global_tokens=0)


def test_token_sum_by_hand_and_split_invariant():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 1]])
    assert aggregate(loss, mask, "token-sum").item() == pytest.approx(1 + 2 + 4 + 6)
    # counts are ignored: the sum of the rows' sums is the whole sum
    parts = aggregate(loss[:1], mask[:1], "token-sum", global_tokens=4) + aggregate(loss[1:], mask[1:], "token-sum")
    assert parts.item() == pytest.approx(13.0)


def test_loss_denominators_count_rows_for_the_critic_and_drop_rejected_rows_for_the_policy():
    response = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.float32)
    kept = torch.tensor([[1, 0, 0], [0, 0, 0], [0, 0, 0], [1, 1, 1]], dtype=torch.bool)
    # critic: 2 + 1 + 0 + 3 = 6 tokens over all 4 rows (the empty row 2 is a sequence with loss 0);
    # policy: 1 + 3 = 4 kept tokens; row 1 lost its only token to rejection, so 4 - 1 = 3 sequences
    assert loss_denominators(response, kept) == (6.0, 4.0, 4.0, 3.0)
    assert loss_denominators(response, response.bool()) == (6.0, 4.0, 6.0, 4.0)
