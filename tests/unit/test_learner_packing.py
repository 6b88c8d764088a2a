"""Packed learner forwards (asyncppo/learner/packing.py) on a real tiny Qwen2: the same update as the padded layout,
position ids restarting per sequence, no attention across a sequence boundary, and the padded-token fraction."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner.batch import collate_groups, micro_batches
from asyncppo.learner.forward import forward_footprint, policy_forward, value_forward
from asyncppo.learner.models import learner_attention, load_actor, load_critic, load_reference
from asyncppo.learner.packing import (
    LONGEST, ONE_ROW, PADDED, pack_capacity, pack_rows, pad_fraction, uses_varlen_attention,
)
from asyncppo.config.checks import uses_critic, uses_reference
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.learner.value_head import build_critic
from asyncppo.stream.records import Sample, TrajectoryGroup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=2, intermediate=128, seed=5)


def _group(gid: int, prompt_len: int, response_lens: list[int], rng, vocab: int = 16) -> TrajectoryGroup:
    samples = [
        Sample(response_ids=rng.integers(4, vocab, size=n).astype(np.int32),
               behavior_logprobs=(-rng.random(n) * 2).astype(np.float32), reward=float(rng.integers(0, 2)),
               finish_reason="stop", version_min=0, version_max=0)
        for n in response_lens
    ]
    prompt = rng.integers(4, vocab, size=prompt_len).astype(np.int32)
    return TrajectoryGroup(group_id=f"0-{gid}", worker_id=0, prompt_ids=prompt, samples=samples)


def _long_tailed_groups(seed: int = 0) -> list[TrajectoryGroup]:
    """4 groups of 4 with long-tailed response lengths (most short, a few long) and unequal prompts."""
    rng = np.random.default_rng(seed)
    lengths = [[2, 3, 17, 4], [1, 5, 2, 29], [6, 2, 3, 1], [11, 2, 4, 3]]
    return [_group(g, int(rng.integers(2, 7)), lens, rng) for g, lens in enumerate(lengths)]


def _cfg(**algorithm) -> AsyncPPOConfig:
    cfg = AsyncPPOConfig()
    cfg.algorithm.clip_ratio_low = cfg.algorithm.clip_ratio_high = cfg.algorithm.pg_clip
    cfg.algorithm.loss_agg_norm_length = 32
    for key, value in algorithm.items():
        if key == "shared_backbone":
            cfg.model.shared_backbone = value
        else:
            setattr(cfg.algorithm, key, value)
    return cfg


def _updater(cfg, model_dir) -> PPOUpdate:
    dev = torch.device("cpu")
    torch.manual_seed(0)
    actor = load_actor(model_dir, torch.float64, dev, attn_implementation=learner_attention(cfg.model, dev))
    critic = build_critic(cfg, model_dir, torch.float64, dev, False) if uses_critic(cfg) else None
    ref = (load_reference(model_dir, torch.float64, dev, attn_implementation=learner_attention(cfg.model, dev))
           if uses_reference(cfg) else None)
    if ref is not None:  # a reference that differs, so that every KL term is non-zero
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.02 * torch.randn_like(p))
    if critic is not None:
        critic.double()
        with torch.no_grad():  # a non-zero value head, so values depend on the hidden states
            for p in critic.value_head.parameters():
                p.copy_(0.1 * torch.randn_like(p))
    return PPOUpdate(cfg, actor, critic, ref, dev)


def _grads(module) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None])


@pytest.mark.parametrize("attention", ["sdpa", "sdpa_varlen"])
@pytest.mark.parametrize("options", [
    dict(adv_estimator="gae", entropy_coef=0.01),  # separate value model
    dict(adv_estimator="gae", shared_backbone=True),  # value head on the actor's body
    dict(adv_estimator="grpo", use_kl_loss=True, kl_penalty="low_var_kl"),
    dict(adv_estimator="grpo", use_kl_loss=True, kl_penalty="full", loss_agg_mode="seq-mean-token-sum-norm"),
    dict(adv_estimator="grpo", add_token_level_kl=True, kl_penalty="kl", loss_agg_mode="seq-mean-token-mean"),
])
def test_packed_and_padded_micro_batches_give_the_same_loss_and_gradients(model_dir, options, attention):
    """sdpa: rows as wide as each micro-batch's longest sequence; sdpa_varlen (the CPU learner's default): rows
    filled up to the token budget, one causal sdpa call per sequence. The padded side runs plain sdpa."""
    padded_cfg = _cfg(max_tokens_per_micro_batch=48, pack_sequences=False, **options)
    padded_cfg.model.attn_implementation = "sdpa"
    packed_cfg = copy.deepcopy(padded_cfg)
    packed_cfg.model.attn_implementation = attention
    packed_cfg.algorithm.pack_sequences = None  # auto: on, since a token budget is set
    padded, packed = _updater(padded_cfg, model_dir), _updater(packed_cfg, model_dir)
    batch = collate_groups(_long_tailed_groups(), pad_token_id=0)
    assert len(micro_batches(batch, 0, 48)) >= 3  # several micro-batches, each packing several sequences
    m_pad, m_pack = padded.step(batch), packed.step(collate_groups(_long_tailed_groups(), pad_token_id=0))
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/vf_loss", "actor/reward_kl", "actor/grad_norm",
                "critic/grad_norm", "actor/entropy"):
        if key in m_pad:
            assert m_pack[key] == pytest.approx(m_pad[key], rel=1e-7, abs=1e-10), key
    torch.testing.assert_close(_grads(packed.actor), _grads(padded.actor), rtol=1e-7, atol=1e-10)
    if padded.critic is not None:
        torch.testing.assert_close(_grads(packed.critic), _grads(padded.critic), rtol=1e-7, atol=1e-10)
    assert m_pad["perf/pad_fraction"] > 0.2  # long-tailed lengths: a fifth of the padded forwards is padding
    if attention == "sdpa":  # rows as wide as the longest
        assert m_pack["perf/pad_fraction"] < 0.6 * m_pad["perf/pad_fraction"]
    else:  # rows filled up to the budget: a micro-batch of <= 48 tokens is one row of exactly its tokens
        assert m_pack["perf/pad_fraction"] == 0.0


def test_position_ids_restart_per_sequence_and_tokens_are_the_valid_ones():
    batch = collate_groups(_long_tailed_groups(seed=1), pad_token_id=0)
    batch.pack_capacity = 48
    packed = pack_rows(batch, 48)
    lengths = batch.attention_mask.sum(dim=1).tolist()
    assert packed.real_tokens == sum(lengths)
    assert packed.input_ids.shape[1] <= 48
    seen = []
    for r in range(packed.input_ids.shape[0]):
        pos = packed.position_ids[r].tolist()
        starts = [c for c, p in enumerate(pos) if p == 0]
        for a, b in zip(starts, starts[1:] + [len(pos)]):
            assert pos[a:b] == list(range(b - a))  # 0, 1, 2, ... within each sequence (or padding slot)
            seen.append(packed.input_ids[r, a:b].tolist())
    for i in range(batch.size):  # every sequence's valid tokens appear as one run, in order
        assert batch.input_ids[i][batch.attention_mask[i].bool()].tolist() in seen


def test_no_sequence_attends_across_a_boundary(model_dir):
    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    critic = load_critic(model_dir, torch.float64, torch.device("cpu")).double()
    with torch.no_grad():
        critic.value_head.weight.normal_()
    batch = collate_groups(_long_tailed_groups(seed=2), pad_token_id=0)
    batch.pack_capacity = ONE_ROW  # all sixteen sequences in one row
    assert pack_rows(batch, ONE_ROW).input_ids.shape[0] == 1
    lp, values = policy_forward(actor, batch, 1.0, False)[0], value_forward(critic, batch)
    victim = 5
    changed = batch.select(torch.arange(batch.size))
    changed.input_ids = batch.input_ids.clone()
    cols = batch.attention_mask[victim].bool()
    changed.input_ids[victim, cols] = (batch.input_ids[victim, cols] - 1) % 12 + 4  # every token of one sequence
    lp2, values2 = policy_forward(actor, changed, 1.0, False)[0], value_forward(critic, changed)
    others = torch.arange(batch.size) != victim
    torch.testing.assert_close(lp2[others], lp[others], rtol=0, atol=1e-12)
    torch.testing.assert_close(values2[others], values[others], rtol=0, atol=1e-12)
    assert (lp2[victim] - lp[victim]).abs().max() > 1e-3 and (values2[victim] - values[victim]).abs().max() > 1e-3
    for capacity in (PADDED, LONGEST, 40):  # each sequence's outputs are the same however the rows are laid out
        batch.pack_capacity = capacity
        torch.testing.assert_close(policy_forward(actor, batch, 1.0, False)[0], lp, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(value_forward(critic, batch), values, rtol=1e-9, atol=1e-11)


def test_pad_fraction_by_hand():
    rng = np.random.default_rng(0)
    # prompts 2 and 4 tokens (P = 4), responses 1, 3 | 2, 6: sequence lengths 3, 5, 6, 10 = 24 real tokens
    batch = collate_groups([_group(0, 2, [1, 3], rng), _group(1, 4, [2, 6], rng)], pad_token_id=0)
    # padded: every column holds a token of some row (P = 4, longest response 6): 4 rows x 10 columns
    assert forward_footprint(batch) == (40, 24)
    batch.pack_capacity = 11  # first fit decreasing: [10], [6, 5], [3] -> 3 rows x width 11
    assert forward_footprint(batch) == (33, 24)
    batch.pack_capacity = 16  # [10, 6], [5, 3] -> 2 rows x 16
    assert forward_footprint(batch) == (32, 24)
    batch.pack_capacity = ONE_ROW  # one row of 24
    assert forward_footprint(batch) == (24, 24)
    batch.pack_capacity = LONGEST  # rows of 10: [10], [6, 3], [5] -> 3 x 10
    assert forward_footprint(batch) == (30, 24)
    assert pad_fraction([(40, 24), (33, 24)]) == pytest.approx(1 - 48 / 73)
    assert pad_fraction([]) == 0.0


def test_step_reports_the_pad_fraction_of_its_forwards(model_dir):
    rng = np.random.default_rng(0)
    groups = [_group(0, 2, [1, 3], rng), _group(1, 4, [2, 6], rng)]
    upd = _updater(_cfg(adv_estimator="grpo", ppo_epochs=2), model_dir)  # two passes over one 40-slot forward
    assert upd.step(collate_groups(groups, pad_token_id=0))["perf/pad_fraction"] == pytest.approx(16 / 40)
    cfg = _cfg(adv_estimator="grpo", pack_sequences=True)
    cfg.model.attn_implementation = "sdpa"  # rows as wide as the longest: [10], [6, 3], [5], 24 tokens in 3 x 10 slots
    assert _updater(cfg, model_dir).step(collate_groups(groups, pad_token_id=0))["perf/pad_fraction"] \
        == pytest.approx(6 / 30)
    cfg.model.attn_implementation = None  # the CPU default, sdpa_varlen: no budget, so all 24 tokens in one row
    assert _updater(cfg, model_dir).step(collate_groups(groups, pad_token_id=0))["perf/pad_fraction"] == 0.0


def test_pack_sequences_option(model_dir):
    alg = AsyncPPOConfig().algorithm
    assert pack_capacity(alg, varlen=True) == PADDED  # auto without a token budget: padded
    alg.max_tokens_per_micro_batch = 4096
    assert pack_capacity(alg, varlen=True) == 4096  # auto with a budget: varlen rows of that many tokens
    assert pack_capacity(alg, varlen=False) == LONGEST  # masked attention: rows as wide as the longest sequence
    alg.pack_sequences = False
    assert pack_capacity(alg, varlen=True) == PADDED
    alg.pack_sequences, alg.max_tokens_per_micro_batch = True, 0
    assert pack_capacity(alg, varlen=True) == ONE_ROW
    assert not uses_varlen_attention(load_actor(model_dir, torch.float32, torch.device("cpu")))  # sdpa on CPU


def test_multi_turn_episode_packed_and_padded_agree_to_its_last_model_token(model_dir):
    """A multi-turn response is longer than its model-token count (environment tokens are masked out of the
    loss but read): both layouts must cover it to its end, where its last turn's model tokens sit."""
    from tests.unit.test_learner_turns import MODEL_POS, arrived

    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    batch = collate_groups([arrived()], pad_token_id=0)
    batch.input_ids = batch.input_ids % actor.config.vocab_size
    padded = policy_forward(actor, batch, 1.0, False)[0]
    batch.pack_capacity = ONE_ROW
    packed = policy_forward(actor, batch, 1.0, False)[0]
    torch.testing.assert_close(packed, padded, rtol=1e-9, atol=1e-11)
    assert (padded[0, MODEL_POS] != 0).all()  # every model token has its log-prob, the last turn's included
