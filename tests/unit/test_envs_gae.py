"""GAE over env transitions: termination zeroes the bootstrap, truncation bootstraps from the final observation's
value, both cut the recursion; numbers computed by hand on short segments."""

from __future__ import annotations

import pytest
import torch

from asyncppo.algo.transitions import flat_whiten, transition_gae


def _t(*rows):
    return torch.tensor(rows, dtype=torch.float64)


def test_no_episode_end_bootstraps_from_the_next_value():
    # gamma 0.5, lambda 1: deltas d0 = 1 + .5*2 - 1 = 1, d1 = 1 + .5*4 - 2 = 1; A1 = 1, A0 = 1 + .5*1 = 1.5
    adv, ret = transition_gae(_t([1, 1]), _t([1, 2]), _t([2, 4]), _t([0, 0]).bool(), _t([0, 0]).bool(),
                              gamma=0.5, lambd=1.0)
    assert adv.tolist() == [[1.5, 1.0]]
    assert ret.tolist() == [[2.5, 3.0]]


def test_termination_versus_truncation_on_the_same_numbers():
    rewards, values = _t([1, 1, 1]), _t([1, 2, 3])
    # next_values: step 0 -> V(s1)=2; step 1 ends the episode, its final observation's value is 10; the env reset,
    # so step 2 is a new episode whose next value (segment bootstrap) is 4.
    next_values = _t([2, 10, 4])
    gamma, lambd = 0.5, 0.5
    d2 = 1 + gamma * 4 - 3  # = 0
    # terminated at step 1: no bootstrap, recursion cut
    adv_term, _ = transition_gae(rewards, values, next_values, _t([0, 1, 0]).bool(), _t([0, 0, 0]).bool(),
                                 gamma=gamma, lambd=lambd)
    d1_term = 1 + 0 - 2  # = -1
    d0 = 1 + gamma * 2 - 1  # = 1
    assert adv_term.tolist() == [[d0 + gamma * lambd * d1_term, d1_term, d2]]  # [0.75, -1, 0]
    # truncated at step 1: bootstrap from V(final obs) = 10, recursion cut all the same
    adv_trunc, ret_trunc = transition_gae(rewards, values, next_values, _t([0, 0, 0]).bool(), _t([0, 1, 0]).bool(),
                                          gamma=gamma, lambd=lambd)
    d1_trunc = 1 + gamma * 10 - 2  # = 4
    assert adv_trunc.tolist() == [[d0 + gamma * lambd * d1_trunc, d1_trunc, d2]]  # [2.0, 4, 0]
    assert ret_trunc.tolist() == [[3.0, 6.0, 3.0]]
    # both flags: termination wins (no bootstrap)
    adv_both, _ = transition_gae(rewards, values, next_values, _t([0, 1, 0]).bool(), _t([0, 1, 0]).bool(),
                                 gamma=gamma, lambd=lambd)
    assert adv_both.tolist() == adv_term.tolist()


def test_two_segments_equal_one_long_segment():
    """Cutting a trajectory into segments (bootstrapping the first from the second's first value) changes nothing."""
    g = torch.Generator().manual_seed(0)
    T = 12
    r = torch.randn(3, T, generator=g, dtype=torch.float64)
    v = torch.randn(3, T + 1, generator=g, dtype=torch.float64)
    term = torch.rand(3, T, generator=g) < 0.15
    trunc = (torch.rand(3, T, generator=g) < 0.15) & ~term
    nv = v[:, 1:].clone()
    finals = torch.randn(3, T, generator=g, dtype=torch.float64)
    nv = torch.where(trunc, finals, nv)  # truncated steps bootstrap from their own final observation
    whole, _ = transition_gae(r, v[:, :T], nv, term, trunc, gamma=0.9, lambd=0.8)
    cut = 5
    first, _ = transition_gae(r[:, :cut], v[:, :cut], nv[:, :cut], term[:, :cut], trunc[:, :cut],
                              gamma=0.9, lambd=0.8)
    second, _ = transition_gae(r[:, cut:], v[:, cut:T], nv[:, cut:], term[:, cut:], trunc[:, cut:],
                               gamma=0.9, lambd=0.8)
    # the first part's recursion stops at the cut: add back the discounted tail, as a longer segment would
    cont = (~(term | trunc)).double()
    tail = second[:, 0].clone()
    carry = torch.zeros_like(first)
    for t in range(cut - 1, -1, -1):
        tail = tail * 0.9 * 0.8 * cont[:, t]
        carry[:, t] = tail
    assert torch.allclose(first + carry, whole[:, :cut])
    assert torch.allclose(second, whole[:, cut:])


def test_shape_and_range_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="next_values shape"):
        transition_gae(x, x, torch.zeros(2, 4), x.bool(), x.bool())
    with pytest.raises(ValueError, match="gamma"):
        transition_gae(x, x, x, x.bool(), x.bool(), gamma=1.5)


def test_flat_whiten_adds_eps_to_the_std_not_the_variance():
    # [0, 2]: mean 1, unbiased std sqrt(2); with eps=1 the divisor is sqrt(2) + 1 = 2.414214 (masked_whiten would
    # divide by sqrt(2 + 1) = 1.732051), so the whitened values are -/+ 1 / 2.414214 = -/+ 0.414214
    out = flat_whiten(torch.tensor([0.0, 2.0], dtype=torch.float64), eps=1.0)
    torch.testing.assert_close(out, torch.tensor([-0.41421356, 0.41421356], dtype=torch.float64), atol=1e-8, rtol=0)
    # [1, 2, 3, 4]: mean 2.5, std sqrt(5/3) = 1.290994 -> -1.161895, -0.387298, 0.387298, 1.161895
    out = flat_whiten(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([-1.161895, -0.387298, 0.387298, 1.161895], dtype=torch.float64),
                               atol=1e-6, rtol=0)
    # a constant batch whitens to 0, not NaN
    assert torch.equal(flat_whiten(torch.full((3,), 7.0)), torch.zeros(3))
