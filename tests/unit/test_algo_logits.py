"""Log-probs and entropy from logits: values, temperature, gradients, half precision."""

import math

import pytest
import torch

from asyncppo.algo import entropy_from_logits, logprobs_from_logits


def test_logprobs_match_log_softmax_with_temperature_and_grad():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=gen)
    ref_logits = logits.detach().clone().requires_grad_(True)
    got = logprobs_from_logits(logits, labels, temperature=0.7)
    ref = torch.log_softmax(ref_logits / 0.7, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got.double(), ref, atol=1e-12)
    got.sum().backward()
    ref.sum().backward()
    assert torch.allclose(logits.grad, ref_logits.grad, atol=1e-12)


def test_logprobs_by_hand():
    logits = torch.log(torch.tensor([[[0.5, 0.25, 0.25]]]))
    assert logprobs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.25))
    # temperature 2 over probabilities (.5, .25, .25): p^(1/2) renormalised
    z = math.sqrt(0.5) + 2 * math.sqrt(0.25)
    assert logprobs_from_logits(logits, torch.tensor([[0]]), temperature=2.0).item() == pytest.approx(
        math.log(math.sqrt(0.5) / z), rel=1e-6
    )
    with pytest.raises(ValueError, match="temperature"):
        logprobs_from_logits(logits, torch.tensor([[0]]), temperature=0.0)


def test_half_precision_path_close_to_float32():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 257, generator=gen) * 4
    labels = torch.randint(0, 257, (3, 4), generator=gen)
    ref = logprobs_from_logits(logits, labels)
    half = logprobs_from_logits(logits.bfloat16(), labels)
    assert half.dtype == torch.float32 and half.shape == (3, 4)
    # bf16 logits have ~3 significant digits; the log-softmax itself is done in float32
    assert torch.allclose(half, ref, atol=0.1)


def test_entropy_by_hand():
    V = 8
    assert entropy_from_logits(torch.zeros(1, V)).item() == pytest.approx(math.log(V), rel=1e-6)
    assert entropy_from_logits(torch.tensor([[100.0, 0.0, 0.0]])).item() == pytest.approx(0.0, abs=1e-6)
    p = torch.tensor([0.5, 0.25, 0.25])
    h = -(p * p.log()).sum().item()
    assert entropy_from_logits(p.log().view(1, 1, 3) + 3.0).item() == pytest.approx(h, rel=1e-6)
