"""``sdpa_varlen`` (asyncppo/learner/varlen_sdpa.py): causal attention inside each sequence of a packed row, checked
against attention written out by hand (softmax over each sequence's own earlier tokens), with grouped KV heads,
one-token sequences and several rows; the padded path through the same name equals sdpa; and which kernel the
learner's models get when ``model.attn_implementation`` is left null."""

from __future__ import annotations

import math

import pytest
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner.models import learner_attention, load_actor
from asyncppo.learner.varlen_sdpa import NAME, _runs, packed_attention, sequence_lengths


def _positions(rows: list[list[int]]) -> torch.Tensor:
    """Position ids of rows holding sequences of the given lengths, each restarting at 0."""
    return torch.tensor([[p for n in row for p in range(n)] for row in rows])


def _by_hand(q, k, v, rows: list[list[int]]) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v over each sequence's tokens up to and including the query, head by head
    (KV head h // group for query head h); [R, W, Hq, D]."""
    R, Hq, W, D = q.shape
    group = Hq // k.shape[1]
    out = torch.zeros(R, W, Hq, D, dtype=q.dtype)
    for r, row in enumerate(rows):
        start = 0
        for n in row:
            for h in range(Hq):
                for i in range(n):
                    a = start + i
                    keys = k[r, h // group, start : a + 1]
                    w = torch.softmax(keys @ q[r, h, a] / math.sqrt(D), dim=0)
                    out[r, a, h] = w @ v[r, h // group, start : a + 1]
            start += n
    return out


def test_sequence_lengths_and_one_token_runs():
    pos = _positions([[3, 1, 1, 2], [4, 1, 1, 1]])
    assert sequence_lengths(pos) == [3, 1, 1, 2, 4, 1, 1, 1]  # rows read end to end
    assert _runs([3, 1, 1, 2, 4, 1, 1, 1]) == [3, -2, 2, 4, -3]  # one-token runs merged, no kernel for them
    assert _runs([1, 5]) == [-1, 5]
    with pytest.raises(ValueError, match="position 0"):
        sequence_lengths(torch.tensor([[1, 2, 0]]))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])  # plain and grouped KV heads
def test_each_sequence_attends_only_to_its_own_earlier_tokens(heads):
    torch.manual_seed(0)
    rows = [[3, 1, 4, 1, 1], [2, 6, 1, 1], [4, 3, 3]]  # one-token sequences mid-row and as trailing padding,
    # equal lengths in one row and across rows
    hq, hkv = heads
    q = torch.randn(3, hq, 10, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(3, hkv, 10, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(3, hkv, 10, 8, dtype=torch.float64, requires_grad=True)
    out = packed_attention(q, k, v, _positions(rows))
    expected = _by_hand(q, k, v, rows)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    upstream = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), upstream)
    want = torch.autograd.grad(expected, (q, k, v), upstream)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-12)


def test_the_padded_path_through_the_same_name_is_sdpa(tmp_path):
    """With a padding mask (the padded layout) the forward is transformers' sdpa, so one kernel name serves both."""
    model_dir = build_tiny_model(str(tmp_path), hidden=64, heads=2, intermediate=128, seed=3)
    ids = torch.randint(4, 16, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    mask[2, :2] = 0
    outs = [load_actor(model_dir, torch.float64, torch.device("cpu"), attn_implementation=impl)(
        input_ids=ids, attention_mask=mask).logits for impl in ("sdpa", NAME)]
    keep = mask.bool()
    torch.testing.assert_close(outs[1][keep], outs[0][keep], rtol=1e-9, atol=1e-9)


def test_the_learners_kernel_when_left_null():
    m = AsyncPPOConfig().model
    assert learner_attention(m, torch.device("cpu")) == NAME  # packed rows filled up to the budget on CPU
    assert learner_attention(m, torch.device("cuda")) is None  # transformers' choice on a GPU
    m.trust_remote_code = True
    assert learner_attention(m, torch.device("cpu")) is None  # remote code keeps its own attention
    m.attn_implementation = "eager"
    assert learner_attention(m, torch.device("cpu")) == "eager"  # a choice is kept
