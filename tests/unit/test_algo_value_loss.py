"""Critic loss: clipped / unclipped, squared / Huber, by hand; explained variance."""

import pytest
import torch

from asyncppo.algo import explained_variance, value_loss


def _vl(values, old, returns, mask=None, **kw):
    v = torch.tensor([values], dtype=torch.float64, requires_grad=True)
    o = torch.tensor([old], dtype=torch.float64)
    r = torch.tensor([returns], dtype=torch.float64)
    m = torch.ones_like(o) if mask is None else torch.tensor([mask], dtype=torch.float64)
    loss, metrics = value_loss(v, o, r, m, **kw)
    loss.backward()
    return loss.item(), v.grad.tolist()[0], metrics


def test_clipped_value_loss_by_hand():
    # token 0: v=1, old=.5, R=2 -> unclipped .5*1^2 = .5 ; clipped v=.7 -> .5*1.3^2 = .845 (wins, no grad)
    # token 1: v=1, old=.5, R=0 -> unclipped .5 ; clipped .5*.7^2 = .245 -> unclipped wins, grad v-R = 1
    loss, grad, m = _vl([1.0, 1.0], [0.5, 0.5], [2.0, 0.0], value_clip=0.2)
    assert loss == pytest.approx((0.845 + 0.5) / 2)
    assert grad == pytest.approx([0.0, 0.5])  # token-mean over 2 tokens
    assert float(m["vf_clipfrac"]) == pytest.approx(0.5)


def test_unclipped_squared_by_hand():
    loss, grad, m = _vl([1.0, 3.0, 100.0], [0.0, 0.0, 0.0], [2.0, 2.0, 0.0], mask=[1, 1, 0])
    assert loss == pytest.approx((0.5 + 0.5) / 2)
    assert grad == pytest.approx([-0.5, 0.5, 0.0])
    assert float(m["vf_clipfrac"]) == 0.0


def test_huber_by_hand():
    # delta 1: |e|=3 -> 1*(3 - .5) = 2.5, grad sign(e)*delta ; |e|=.5 -> .125, grad e
    loss, grad, _ = _vl([3.0, 0.5], [0.0, 0.0], [0.0, 0.0], huber_delta=1.0)
    assert loss == pytest.approx((2.5 + 0.125) / 2)
    assert grad == pytest.approx([1.0 / 2, 0.5 / 2])


def test_huber_with_clip_by_hand():
    # v=3, old=0, clip .5 -> v_clip=.5; R=-2: unclipped |5| -> 4.5 ; clipped |2.5| -> 2.0 ; unclipped wins
    loss, grad, m = _vl([3.0], [0.0], [-2.0], value_clip=0.5, huber_delta=1.0)
    assert loss == pytest.approx(4.5) and grad == pytest.approx([1.0])
    # R=5: unclipped |2| -> 1.5 ; clipped |4.5| -> 4.0 wins, no gradient
    loss, grad, m = _vl([3.0], [0.0], [5.0], value_clip=0.5, huber_delta=1.0)
    assert loss == pytest.approx(4.0) and grad == [0.0] and float(m["vf_clipfrac"]) == 1.0


def test_explained_variance():
    ret = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask).item() == pytest.approx(0.0)
    # residuals [0, 0, 1]: var = 1/3 ; var(R) = 1 -> 1 - 1/3
    v = torch.tensor([[1.0, 2.0, 2.0, -7.0]])
    assert explained_variance(v, ret, mask).item() == pytest.approx(2 / 3)
    # constant returns: nothing to explain, undefined (NaN, logged as null) -- never a huge negative number
    assert torch.isnan(explained_variance(ret, torch.ones_like(ret), mask))


def test_explained_variance_of_constant_float32_returns_is_undefined():
    # float32 returns that are all 0.7: their computed variance is rounding noise (~1e-15), not 0; dividing the
    # critic's residual variance by it printed -1.6e15 in a run where every reward was equal
    returns = torch.full((64, 7), 0.7, dtype=torch.float32)
    values = torch.rand(64, 7, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(64, 7)
    assert torch.isnan(explained_variance(values, returns, mask))
    # a small but real spread is still measured
    returns[0, 0] = 0.8
    ev = explained_variance(returns, returns, mask)
    assert ev.item() == pytest.approx(1.0)


def test_bad_arguments():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="returns shape"):
        value_loss(x, x, torch.zeros(2, 2), torch.ones(1, 2))
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(x, x, x, torch.ones(1, 2), value_clip=0.0)
    with pytest.raises(ValueError, match="huber_delta"):
        value_loss(x, x, x, torch.ones(1, 2), huber_delta=-1.0)
