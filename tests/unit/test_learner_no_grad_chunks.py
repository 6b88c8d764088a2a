"""No-grad forwards in chunks bounded by rows and by tokens (asyncppo/learner/forward.py: chunked): the bound is
on the float32 logits, which rows alone do not bound when the vocabulary is large (an H100 ran out of memory on
256 rows x 64 tokens of a 151,936-token vocabulary), and the results do not depend on how rows are chunked."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.validate import resolve_derived
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.forward import (
    NO_GRAD_LOGITS_GIB, chunk_bounds, chunked, count_chunks, logits_token_budget, policy_forward,
)
from asyncppo.learner.models import load_actor, load_reference
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.stream.records import Sample, TrajectoryGroup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=32, layers=2, heads=2, intermediate=64,
                            seed=11)


def _batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        samples = []
        for n in rng.integers(1, 24, size=4):
            samples.append(Sample(response_ids=rng.integers(4, 16, size=int(n)).astype(np.int32),
                                  behavior_logprobs=(-rng.random(int(n)) * 2).astype(np.float32),
                                  reward=float(rng.integers(0, 2)), finish_reason="stop", version_min=0,
                                  version_max=0))
        prompt = rng.integers(4, 16, size=int(rng.integers(2, 6))).astype(np.int32)
        groups.append(TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=prompt, samples=samples))
    return collate_groups(groups, pad_token_id=0)


def test_chunk_bounds_by_rows_and_by_tokens_worked_by_hand():
    lengths = [2, 3, 3, 5, 8, 8, 20]
    assert chunk_bounds(lengths, 3) == [(0, 3), (3, 6), (6, 7)]
    # 12 tokens: [2, 3, 3] is 3 x 3 = 9 (and 3 rows); [5, 8] would be 2 x 8 = 16; [8, 8] 16; 20 alone is over
    assert chunk_bounds(lengths, 3, 12) == [(0, 3), (3, 4), (4, 5), (5, 6), (6, 7)]
    assert chunk_bounds(lengths, 3, 16) == [(0, 3), (3, 5), (5, 6), (6, 7)]
    assert chunk_bounds(lengths, 100, 1) == [(i, i + 1) for i in range(7)]  # every row alone, none dropped
    assert chunk_bounds([], 3, 12) == []


def test_the_token_budget_follows_the_vocabulary():
    qwen = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=151_936))
    assert NO_GRAD_LOGITS_GIB == 1.0
    assert logits_token_budget(qwen) == 1766  # 2**30 bytes / (151,936 x 4 bytes) = 1,766.8
    assert logits_token_budget(types.SimpleNamespace()) == 0  # no config: rows are the only bound
    assert logits_token_budget(types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=2**31))) == 1


def test_chunks_under_a_token_bound_give_the_unbounded_result(model_dir):
    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    batch = _batch()
    calls: list[tuple[int, int]] = []

    def forward(b):
        calls.append((b.size, int(b.attention_mask.sum(dim=1).max())))
        return policy_forward(actor, b, 1.0, False)[0]

    whole = chunked(forward, batch, batch.size)
    assert calls == [(batch.size, int(batch.attention_mask.sum(dim=1).max()))]
    calls.clear()
    bounded = chunked(forward, batch, 4, 40)
    assert len(calls) == count_chunks(batch, 4, 40) > batch.size // 4  # the bound, not the rows, cut most chunks
    for rows, longest in calls:
        assert rows <= 4 and (rows == 1 or rows * longest <= 40)
    assert sum(rows for rows, _ in calls) == batch.size
    torch.testing.assert_close(bounded, whole, rtol=0, atol=1e-12)

    calls.clear()  # filler forwards up to a number of calls, their output dropped
    padded = chunked(forward, batch, 4, 40, forwards=len(calls) + count_chunks(batch, 4, 40) + 2)
    assert len(calls) == count_chunks(batch, 4, 40) + 2 and calls[-1][0] == 1
    torch.testing.assert_close(padded, whole, rtol=0, atol=1e-12)


def test_a_ppo_step_is_the_same_whatever_the_token_bound(model_dir):
    """The reference and proximal forwards of a step run under the bound; the update they lead to is unchanged."""
    def step(no_grad_tokens: int):
        cfg = AsyncPPOConfig()
        cfg.algorithm.adv_estimator = "grpo"
        cfg.algorithm.use_kl_loss = True
        cfg.algorithm.ppo_epochs = 2  # a second epoch: the proximal policy comes from the no-grad forward
        resolve_derived(cfg)
        torch.manual_seed(0)
        actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
        ref = load_reference(model_dir, torch.float64, torch.device("cpu"))
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))
        updater = PPOUpdate(cfg, actor, None, ref, torch.device("cpu"))
        assert updater.no_grad_tokens == logits_token_budget(actor) > 10_000  # a tiny vocabulary: rows bound it
        updater.no_grad_tokens = no_grad_tokens
        metrics = updater.step(_batch(1))
        return metrics, {k: v.clone() for k, v in actor.state_dict().items()}

    m0, w0 = step(0)
    m1, w1 = step(30)
    assert m0["actor/pg_loss"] == pytest.approx(m1["actor/pg_loss"], abs=1e-10)
    for key in w0:
        torch.testing.assert_close(w1[key], w0[key], rtol=0, atol=1e-10, msg=key)


def test_a_chunk_of_short_rows_is_narrowed_to_its_own_longest_response(model_dir):
    """One 200-token answer among eight of 8 tokens: the short rows' chunk must not be padded to 200 columns, or
    its float32 logits are 25x the bound (rows x the batch's width, not rows x its own)."""
    rng = np.random.default_rng(3)
    samples = [Sample(response_ids=rng.integers(4, 16, size=n).astype(np.int32),
                      behavior_logprobs=np.zeros(n, np.float32), reward=0.0, finish_reason="stop", version_min=0,
                      version_max=0) for n in [200] + [8] * 8]
    batch = collate_groups([TrajectoryGroup(group_id="0-0", worker_id=0, prompt_ids=np.array([5, 6], np.int32),
                                            samples=samples)], pad_token_id=0)
    assert batch.response_len == 200
    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    widths: list[tuple[int, int, int]] = []

    def forward(b):
        logprobs, _, logits = policy_forward(actor, b, 1.0, False)
        widths.append((b.size, b.response_len, int(logits.shape[0] * logits.shape[1])))
        return logprobs

    bounded = chunked(forward, batch, 64, 90)
    assert widths == [(8, 8, 64), (1, 200, 200)]  # 8 rows x 8 logit positions, then the long row alone
    whole = chunked(lambda b: policy_forward(actor, b, 1.0, False)[0], batch, 64)
    torch.testing.assert_close(bounded, whole, rtol=0, atol=1e-12)
    assert bounded.shape == (9, 200) and bool((bounded[1:, 8:] == 0).all())  # zeros on padding, whatever the chunk
    assert batch.narrow_response(8).input_ids.shape == (9, batch.prompt_len + 8)


def test_micro_batches_are_as_wide_as_their_own_longest_response():
    """The training forwards get the same narrowing: a micro-batch of short rows is not padded to the batch's
    longest response (its logits and their gradient would be rows x that width x vocab)."""
    from asyncppo.learner.batch import micro_batches

    batch = _batch(2)
    extent = batch.attention_mask[:, batch.prompt_len:].sum(dim=1)
    parts = micro_batches(batch, 4, 0)
    assert sum(p.size for p in parts) == batch.size
    for part in parts:
        own = int(part.attention_mask[:, part.prompt_len:].sum(dim=1).max())
        assert part.response_len == own and part.input_ids.shape[1] == part.prompt_len + own
        assert all(t is None or t.shape[1] == own for t in (part.response_mask, part.behavior_logprobs,
                                                             part.token_versions))
    assert min(p.response_len for p in parts) < int(extent.max()) == batch.response_len
