"""The learner's PPO step on a real (tiny) transformers model: every option takes effect, and the update is invariant
to how a mini-batch is split into micro-batches."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner.batch import collate_groups, micro_batches
from asyncppo.learner.forward import policy_forward
from asyncppo.learner.models import load_actor, load_reference
from asyncppo.config.checks import uses_critic, uses_reference
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.learner.ppo_targets import correct_rollout, outcome_token_rewards
from asyncppo.learner.value_head import SharedValueHead, build_critic
from asyncppo.stream.records import Sample, TrajectoryGroup


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=1, intermediate=128, seed=3)


def _groups(num_groups=4, n=4, seed=0, vocab=16, eos=1):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(4, vocab, size=int(rng.integers(3, 7))).astype(np.int32)
        samples = []
        for _ in range(n):
            length = int(rng.integers(1, 6))
            ids = rng.integers(4, vocab, size=length).astype(np.int32)
            ids[-1] = eos if rng.random() < 0.5 else ids[-1]
            samples.append(Sample(
                response_ids=ids,
                behavior_logprobs=(-rng.random(length) * 3).astype(np.float32),
                reward=float(rng.integers(0, 2)),
                finish_reason="stop" if ids[-1] == eos else "length",
                version_min=0, version_max=0,
            ))
        groups.append(TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=prompt, samples=samples))
    return groups


def _cfg(**algorithm) -> AsyncPPOConfig:
    cfg = AsyncPPOConfig()
    cfg.algorithm.clip_ratio_low = cfg.algorithm.clip_ratio_high = cfg.algorithm.pg_clip
    cfg.algorithm.loss_agg_norm_length = 8
    for key, value in algorithm.items():
        setattr(cfg.algorithm, key, value)
    return cfg


def _updater(cfg, model_dir):
    dev = torch.device("cpu")
    torch.manual_seed(0)
    actor = load_actor(model_dir, torch.float64, dev)
    critic = build_critic(cfg, model_dir, torch.float64, dev, False) if uses_critic(cfg) else None
    ref = load_reference(model_dir, torch.float64, dev) if uses_reference(cfg) else None
    if ref is not None:  # make the reference differ so that KL terms are non-zero
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.01 * torch.randn_like(p))
    if critic is not None:
        critic.double()
    return PPOUpdate(cfg, actor, critic, ref, dev)


def _params(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


@pytest.mark.parametrize(
    "options",
    [
        dict(adv_estimator="gae"),
        dict(adv_estimator="grpo"),
        dict(adv_estimator="rloo"),
        dict(adv_estimator="reinforce"),
        dict(adv_estimator="reinforce_plus_plus"),
        dict(adv_estimator="reinforce_plus_plus_baseline"),
        dict(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum"),
        dict(adv_estimator="grpo", loss_agg_mode="seq-mean-token-mean"),
        dict(adv_estimator="grpo", loss_agg_mode="seq-mean-token-sum-norm"),
        dict(adv_estimator="grpo", use_kl_loss=True, kl_penalty="low_var_kl"),
        dict(adv_estimator="grpo", use_kl_loss=True, kl_penalty="full"),
        dict(adv_estimator="grpo", add_token_level_kl=True, kl_penalty="kl"),
        dict(adv_estimator="grpo", off_policy_correction="none"),
        dict(adv_estimator="grpo", off_policy_correction="decoupled"),
        dict(adv_estimator="grpo", off_policy_correction="tis"),
        dict(adv_estimator="gae", dual_clip_loss=True, value_clip=None, huber_delta=1.0, entropy_coef=0.01),
        dict(adv_estimator="grpo", reward_norm="running", reward_clip=0.5, ppo_epochs=2, ppo_mini_batch_size=2),
    ],
)
def test_one_step_per_option(model_dir, options):
    cfg = _cfg(**options)
    upd = _updater(cfg, model_dir)
    before = _params(upd.actor).clone()
    metrics = upd.step(collate_groups(_groups(), pad_token_id=0))
    assert not torch.equal(before, _params(upd.actor)), "the actor did not move"
    for key in ("actor/approx_kl", "actor/clipfrac", "actor/entropy", "actor/mismatch_kl", "reward/mean"):
        assert np.isfinite(metrics[key]), key
    if cfg.algorithm.use_kl_loss:
        assert metrics["actor/kl_loss"] > 0
    if cfg.algorithm.add_token_level_kl:
        assert metrics["actor/reward_kl"] != 0
    if uses_critic(cfg):
        assert "critic/vf_loss" in metrics and "critic/explained_variance" in metrics
    expected_steps = cfg.algorithm.ppo_epochs * (2 if cfg.algorithm.ppo_mini_batch_size == 2 else 1)
    assert metrics["actor/optimizer_steps"] == expected_steps


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("split", [dict(micro_batch_size=3), dict(max_tokens_per_micro_batch=20)])
def test_micro_batching_does_not_change_the_update(model_dir, mode, split):
    base = _cfg(adv_estimator="gae", loss_agg_mode=mode, dual_clip_loss=True)
    split_cfg = copy.deepcopy(base)
    for key, value in split.items():
        setattr(split_cfg.algorithm, key, value)
    whole, parts = _updater(base, model_dir), _updater(split_cfg, model_dir)
    batch = collate_groups(_groups(seed=5), pad_token_id=0)
    assert len(micro_batches(batch, split_cfg.algorithm.micro_batch_size,
                             split_cfg.algorithm.max_tokens_per_micro_batch)) > 2
    m1, m2 = whole.step(batch), parts.step(batch)
    torch.testing.assert_close(_params(whole.actor), _params(parts.actor), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(_params(whole.critic), _params(parts.critic), rtol=1e-9, atol=1e-10)
    assert m1["actor/grad_norm"] == pytest.approx(m2["actor/grad_norm"], rel=1e-9)


def test_padding_does_not_change_log_probs(model_dir):
    """A sample's response log-probs are the same alone or batched with longer prompts/responses (pad + mask)."""
    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    groups = _groups(seed=9)
    full = collate_groups(groups, pad_token_id=0)
    lp_full = policy_forward(actor, full, 1.0, False)[0]
    alone = collate_groups([TrajectoryGroup(group_id="x", worker_id=0, prompt_ids=groups[2].prompt_ids,
                                            samples=[groups[2].samples[1]])], pad_token_id=0)
    lp_alone = policy_forward(actor, alone, 1.0, False)[0]
    row = 2 * 4 + 1
    n = groups[2].samples[1].num_tokens
    torch.testing.assert_close(lp_full[row, :n], lp_alone[0, :n], rtol=1e-7, atol=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# every KL estimator, as a loss and in the reward: the logged value equals the estimator computed independently on
# the step's proximal policy (the actor before the update) and the reference


@pytest.mark.parametrize("place", ["loss", "reward"])
@pytest.mark.parametrize("kind", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full"])
def test_every_kl_estimator_in_the_loss_and_in_the_reward(model_dir, kind, place):
    from asyncppo import algo
    from asyncppo.learner.forward import response_logits

    opts = dict(use_kl_loss=True) if place == "loss" else dict(add_token_level_kl=True)
    cfg = _cfg(adv_estimator="grpo", kl_penalty=kind, **opts)
    upd = _updater(cfg, model_dir)
    batch = collate_groups(_groups(seed=2), pad_token_id=0)
    with torch.no_grad():
        lp, _, logits = policy_forward(upd.actor, batch, 1.0, False)
        ref_lp, _, _ = policy_forward(upd.reference, batch, 1.0, False)
        ref_logits = response_logits(upd.reference, batch, 1.0)
        per_token = algo.kl_penalty(lp, ref_lp, kind, logits=logits, ref_logits=ref_logits)
    mask = batch.response_mask
    before = _params(upd.actor).clone()
    metrics = upd.step(batch)
    assert not torch.equal(before, _params(upd.actor))
    if place == "loss":  # one mini-batch, one micro-batch, token-mean: the loss is the masked mean
        assert metrics["actor/kl_loss"] == pytest.approx(float(algo.masked_mean(per_token, mask)), rel=1e-6)
    else:  # the batch mean of each sequence's mean per-token KL
        seq = (per_token * mask).sum(-1) / mask.sum(-1)
        assert metrics["actor/reward_kl"] == pytest.approx(float(seq.mean()), rel=1e-6)
    assert metrics["actor/kl_loss" if place == "loss" else "actor/reward_kl"] != 0


def test_straight_through_kl_loss_reports_the_named_value(model_dir):
    m_plain = _updater(_cfg(adv_estimator="grpo", use_kl_loss=True, kl_penalty="k3"), model_dir).step(
        collate_groups(_groups(seed=2), pad_token_id=0))
    m_st = _updater(_cfg(adv_estimator="grpo", use_kl_loss=True, kl_penalty="k3+"), model_dir).step(
        collate_groups(_groups(seed=2), pad_token_id=0))
    assert m_st["actor/kl_loss"] == pytest.approx(m_plain["actor/kl_loss"], rel=1e-9)


# ---------------------------------------------------------------------------------------------------------------
# the algorithm family in the learner


@pytest.mark.parametrize(
    "options",
    [
        dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
        dict(policy_loss="gmpo", loss_agg_mode="seq-mean-token-mean"),
        dict(policy_loss="cispo", clip_ratio_high=0.28),
        dict(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0),
        dict(policy_loss="kl_cov", kl_cov_ratio=0.2),
        dict(policy_loss="reinforce_tis", off_policy_correction="none"),
        dict(loss_agg_mode="token-sum"),
        dict(off_policy_level="sequence", off_policy_normalize=True),
        dict(off_policy_truncation="icepop", off_policy_cap_low=0.5),
        dict(rejection="token", rejection_stat="k3", rejection_low=0.0, rejection_high=0.05),
        dict(rejection="sequence", rejection_stat="k1", rejection_low=0.0, rejection_high=1.2),
        dict(overlong_buffer_len=2, overlong_penalty_factor=1.0),
    ],
)
def test_family_options_train(model_dir, options):
    cfg = _cfg(adv_estimator="grpo", **options)
    cfg.rollout.response_length = 5
    upd = _updater(cfg, model_dir)
    before = _params(upd.actor).clone()
    metrics = upd.step(collate_groups(_groups(), pad_token_id=0))
    assert not torch.equal(before, _params(upd.actor)), "the actor did not move"
    assert np.isfinite(metrics["actor/pg_loss"]) and np.isfinite(metrics["actor/grad_norm"])
    if options.get("policy_loss") in ("clip_cov", "kl_cov"):
        assert metrics["actor/cov_frac"] > 0
    if "rejection" in options:
        assert 0 < metrics["actor/is_masked_frac"] < 1
    if "overlong_buffer_len" in options:  # lengths 4 and 5 of 5 are penalised -0.5 and -1
        assert metrics["reward/overlong_penalty_mean"] < 0


@pytest.mark.parametrize("options", [
    dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
    dict(policy_loss="kl_cov", kl_cov_ratio=0.2),
    dict(policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0),
    dict(rejection="token", rejection_stat="k3", rejection_low=0.0, rejection_high=0.05, off_policy_normalize=True,
         loss_agg_mode="seq-mean-token-sum"),
    dict(policy_loss="cispo", off_policy_level="sequence", loss_agg_mode="token-sum", use_kl_loss=True),
])
def test_family_is_invariant_to_micro_batching(model_dir, options):
    base = _cfg(adv_estimator="grpo", ppo_mini_batch_size=2, ppo_epochs=2, **options)
    split_cfg = copy.deepcopy(base)
    split_cfg.algorithm.micro_batch_size = 3
    whole, parts = _updater(base, model_dir), _updater(split_cfg, model_dir)
    batch = collate_groups(_groups(seed=5), pad_token_id=0)
    m1, m2 = whole.step(batch), parts.step(batch)
    torch.testing.assert_close(_params(whole.actor), _params(parts.actor), rtol=1e-9, atol=1e-10)
    # (log-probs pass through float32 logits, so logged losses agree to float32 precision)
    assert m1["actor/pg_loss"] == pytest.approx(m2["actor/pg_loss"], rel=1e-6, abs=1e-9)


@pytest.mark.parametrize("threshold,steps", [(1e-12, 2), (1e9, 4)])
def test_early_stop_kl_counts_the_updates_that_ran(model_dir, threshold, steps):
    # 2 epochs x 2 mini-batches. The first mini-batch measures KL 0 (the proximal policy is the actor), every later
    # one measures the KL the previous updates made (> 1e-12): a tiny threshold stops after the second update.
    cfg = _cfg(adv_estimator="grpo", ppo_epochs=2, ppo_mini_batch_size=2, early_stop_kl=threshold)
    metrics = _updater(cfg, model_dir).step(collate_groups(_groups(), pad_token_id=0))
    assert metrics["actor/optimizer_steps"] == steps
    assert metrics["actor/optimizer_steps_planned"] == 4
    assert metrics["actor/early_stopped"] == float(steps < 4)


@pytest.mark.parametrize("schedule, factors", [("linear", [0.75, 0.5, 0.25, 0.0]), ("constant", [1.0] * 4)])
def test_lr_schedule_steps_once_per_version_for_every_optimizer(model_dir, schedule, factors):
    # 2 mini-batches per step: the schedule counts learner versions, not optimizer steps; the critic follows it too
    cfg = _cfg(adv_estimator="gae", ppo_mini_batch_size=2)
    cfg.trainer.lr_schedule, cfg.trainer.total_steps = schedule, 4
    update = _updater(cfg, model_dir)
    seen = []
    for step in range(4):
        metrics = update.step(collate_groups(_groups(seed=step), pad_token_id=0))
        assert metrics["actor/optimizer_steps"] == 2
        seen += [metrics["actor/lr"], update.critic_opt.param_groups[0]["lr"]]
    t = cfg.trainer
    assert seen == pytest.approx([x for f in factors for x in (t.lr * f, t.critic_lr * f)])


def test_explained_variance_is_undefined_when_every_reward_is_equal(model_dir):
    groups = _groups()
    for g in groups:
        for s in g.samples:
            s.reward = 1.0
    metrics = _updater(_cfg(adv_estimator="gae"), model_dir).step(collate_groups(groups, pad_token_id=0))
    assert np.isnan(metrics["critic/explained_variance"])
    assert "critic/vf_explained_var" not in metrics  # left out of the micro-batch means, not averaged as NaN


@pytest.mark.parametrize("options", [
    dict(adv_estimator="gae", value_clip=0.2, entropy_coef=0.01),
    dict(adv_estimator="gae", off_policy_normalize=True, rejection="token", rejection_stat="k3",
         rejection_low=0.0, rejection_high=0.5),
    dict(adv_estimator="grpo", use_kl_loss=True, kl_penalty="full", policy_loss="clip_cov", clip_cov_ratio=0.2,
         clip_cov_lb=-10.0, clip_cov_ub=10.0),
    dict(adv_estimator="gae", add_token_level_kl=True, kl_penalty="k3", off_policy_correction="tis"),
    dict(adv_estimator="gae", shared_backbone=True, entropy_coef=0.01),
])
def test_single_pass_step_equals_the_separate_passes(model_dir, options):
    """One optimizer step over one micro-batch takes the proximal log-probs and old values from its own training
    forward: the same update as separate no-grad passes (forced here by splitting the batch into micro-batches)."""
    shared = options.pop("shared_backbone", False)
    base = _cfg(**options)
    base.model.shared_backbone = shared
    split_cfg = copy.deepcopy(base)
    split_cfg.algorithm.micro_batch_size = 5
    fused, separate = _updater(base, model_dir), _updater(split_cfg, model_dir)
    batch = collate_groups(_groups(seed=11), pad_token_id=0)
    m1, m2 = fused.step(batch), separate.step(batch)
    assert (m1["actor/single_pass"], m2["actor/single_pass"]) == (1.0, 0.0)
    torch.testing.assert_close(_params(fused.actor), _params(separate.actor), rtol=1e-9, atol=1e-10)
    if fused.critic is not None:
        torch.testing.assert_close(_params(fused.critic), _params(separate.critic), rtol=1e-9, atol=1e-10)
    for key in ("actor/mismatch_kl", "actor/pg_loss", "reward/mean", "actor/advantages_mean"):
        assert m1[key] == pytest.approx(m2[key], rel=1e-6, abs=1e-9), key
    # a second step starts from the same weights, so it must agree as well (nothing stale was kept)
    m1, m2 = fused.step(collate_groups(_groups(seed=12), pad_token_id=0)), separate.step(
        collate_groups(_groups(seed=12), pad_token_id=0))
    torch.testing.assert_close(_params(fused.actor), _params(separate.actor), rtol=1e-9, atol=1e-10)
    if fused.critic is not None:
        torch.testing.assert_close(_params(fused.critic), _params(separate.critic), rtol=1e-9, atol=1e-10)


FUSED_IS_METRICS = ("actor/is_weight_mean", "actor/is_weight_max", "actor/is_truncated_frac", "actor/is_ratio_p05",
                    "actor/is_ratio_p95", "actor/is_chi2_token", "actor/is_chi2_seq")


@pytest.mark.parametrize("options", [
    dict(adv_estimator="grpo", micro_batch_size=5),
    dict(adv_estimator="grpo", micro_batch_size=3, off_policy_correction="tis", off_policy_level="sequence",
         off_policy_truncation="mask", off_policy_cap=1.5),
    dict(adv_estimator="grpo", micro_batch_size=6, off_policy_correction="none", entropy_coef=0.01),
    dict(adv_estimator="grpo", micro_batch_size=4, use_kl_loss=True, kl_penalty="full", mask_truncated=True),
    dict(adv_estimator="rloo", max_tokens_per_micro_batch=40, pack_sequences=True, use_kl_loss=True,
         kl_penalty="low_var_kl", loss_agg_mode="seq-mean-token-mean"),
])
def test_fused_proximal_step_equals_the_separate_passes(model_dir, options):
    """One optimizer step over several micro-batches takes each micro-batch's proximal log-probs from its own
    training forward (the weights do not move until the step): the same update, loss terms and correction figures
    as the separate no-grad actor forward over the whole batch, step after step."""
    cfg = _cfg(**options)
    fused, separate = _updater(cfg, model_dir), _updater(cfg, model_dir)
    separate._fuses_proximal = lambda batch: False  # the separate no-grad pass, everything else the same
    for seed in (21, 22):
        batch = collate_groups(_groups(seed=seed), pad_token_id=0)
        m1, m2 = fused.step(batch), separate.step(collate_groups(_groups(seed=seed), pad_token_id=0))
        assert (m1["actor/fused_proximal"], m2["actor/fused_proximal"]) == (1.0, 0.0)
        assert m1["actor/single_pass"] == m2["actor/single_pass"] == 0.0
        torch.testing.assert_close(_params(fused.actor), _params(separate.actor), rtol=1e-9, atol=1e-10)
        keys = ["actor/pg_loss", "actor/approx_kl", "actor/grad_norm", "reward/mean"]
        if m1["actor/untrained_rows"] == 0:  # else the fused figures cover the trained rows only (next test)
            keys.append("actor/mismatch_kl")
            if options.get("off_policy_correction") != "none":
                keys += FUSED_IS_METRICS
        for key in keys:
            assert m1[key] == pytest.approx(m2[key], rel=1e-6, abs=1e-9), key
    assert abs(m1["actor/mismatch_kl"]) > 1e-3  # the behaviour log-probs are random: the figure is not trivially 0


@pytest.mark.parametrize("options, left_out", [
    (dict(micro_batch_size=4, use_kl_loss=True, kl_penalty="low_var_kl"), True),  # fused, reference pass too
    (dict(micro_batch_size=4, ppo_mini_batch_size=2, ppo_epochs=2, entropy_coef=0.01), True),  # separate passes
    (dict(max_tokens_per_micro_batch=40, pack_sequences=True, use_kl_loss=True, kl_penalty="k3"), True),
    (dict(micro_batch_size=4, mask_truncated=False), False),  # cut answers are trained: every row goes through
    (dict(adv_estimator="gae", micro_batch_size=4), False),  # the critic trains on every response
])
def test_rows_without_a_loss_token_leave_the_training_forwards(model_dir, monkeypatch, options, left_out):
    """``mask_truncated``: an answer cut at the length limit adds nothing to the actor's loss or its denominators, so
    its row skips the training forwards (and a fused step's reference forward): the same parameters to 1e-9 over
    two steps, with fewer tokens through the forwards. Kept where a critic trains on it or where it is trained."""
    from asyncppo.learner import ppo

    options = dict(dict(adv_estimator="grpo", mask_truncated=True), **options)
    skipping, every_row = _updater(_cfg(**options), model_dir), _updater(_cfg(**options), model_dir)
    real = ppo.trained_rows
    for seed in (31, 32):
        groups = _groups(seed=seed)
        cut = sum(s.finish_reason == "length" for g in groups for s in g.samples)
        assert 0 < cut < sum(len(g.samples) for g in groups)  # the batch has cut answers and finished ones
        m1 = skipping.step(collate_groups(groups, pad_token_id=0))
        tokens1 = sum(real_tokens for _, real_tokens in skipping._footprints)
        monkeypatch.setattr(ppo, "trained_rows", lambda *a: None)  # every row through every forward
        m2 = every_row.step(collate_groups(_groups(seed=seed), pad_token_id=0))
        tokens2 = sum(real_tokens for _, real_tokens in every_row._footprints)
        monkeypatch.setattr(ppo, "trained_rows", real)
        torch.testing.assert_close(_params(skipping.actor), _params(every_row.actor), rtol=1e-9, atol=1e-10)
        # the loss terms (summed over other micro-batches: float32 summation order); ratio-type figures such as
        # approx_kl are means weighted by each micro-batch's response tokens, which other micro-batches change
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"):
            if key in m2:
                assert m1[key] == pytest.approx(m2[key], rel=1e-5, abs=1e-8), key
        assert m1["actor/untrained_rows"] == (cut if left_out else 0) and m2["actor/untrained_rows"] == 0
        assert (tokens1 < tokens2) == left_out


@pytest.mark.parametrize("options", [
    dict(adv_estimator="gae"),  # old values feed the advantages
    dict(adv_estimator="grpo", add_token_level_kl=True, kl_penalty="k3"),  # KL in the reward, before advantages
    dict(adv_estimator="grpo", off_policy_normalize=True),  # weights normalised over the batch
    dict(adv_estimator="grpo", rejection="sequence", rejection_stat="k3", rejection_low=0.0, rejection_high=0.5),
    dict(adv_estimator="grpo", policy_loss="clip_cov", clip_cov_ratio=0.2, clip_cov_lb=-10.0, clip_cov_ub=10.0),
    dict(adv_estimator="grpo", ppo_mini_batch_size=2),  # two optimizer steps
    dict(adv_estimator="grpo", ppo_epochs=2),
])
def test_fused_proximal_is_off_where_the_batch_needs_its_proximal_log_probs_first(model_dir, options):
    metrics = _updater(_cfg(micro_batch_size=5, **options), model_dir).step(collate_groups(_groups(), pad_token_id=0))
    assert metrics["actor/fused_proximal"] == 0.0 and metrics["actor/single_pass"] == 0.0


def _shared_updater(model_dir, **options):
    cfg = _cfg(adv_estimator="gae", **options)
    cfg.model.shared_backbone = True
    return _updater(cfg, model_dir)


def test_shared_value_head_lives_beside_the_actor_and_couples_through_its_body(model_dir):
    """model.shared_backbone: the critic is a linear head on the actor's final hidden states. Its values are the
    head applied to the hidden state before each response token; the value loss moves the actor's body (vf_coef
    > 0 changes the actor's update), and the head is not part of the actor's state dict (pushes are unchanged)."""
    upd = _shared_updater(model_dir)
    assert isinstance(upd.critic, SharedValueHead) and upd.shared_critic
    assert not any("value_head" in k for k in upd.actor.state_dict())
    batch = collate_groups(_groups(seed=3), pad_token_id=0)
    with torch.no_grad():  # hand-check the head on the hidden states transformers reports
        upd.critic.value_head.weight.normal_()
        upd.critic.value_head.bias.fill_(0.25)
        from asyncppo.learner.forward import policy_value_forward

        values = policy_value_forward(upd.actor, upd.critic, batch, 1.0, False)[3]
        out = upd.actor(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                        position_ids=batch.position_ids, output_hidden_states=True)
        P, T = batch.prompt_len, batch.response_len
        expect = (out.hidden_states[-1][:, P - 1 : P - 1 + T] @ upd.critic.value_head.weight[0] + 0.25)
        expect = expect * batch.response_mask
    torch.testing.assert_close(values.double(), expect.double(), rtol=1e-5, atol=1e-6)

    moved = []
    for vf_coef in (0.0, 0.5):
        u = _shared_updater(model_dir, vf_coef=vf_coef)
        with torch.no_grad():
            # a non-zero head (the zero-initialised one passes no gradient to the body until its weight moves)
            u.critic.value_head.weight.copy_(torch.linspace(-1, 1, u.critic.value_head.weight.numel()).view(1, -1))
            u.critic.value_head.bias.fill_(0.7)
        u.step(collate_groups(_groups(seed=3), pad_token_id=0))
        moved.append(_params(u.actor))
    assert not torch.allclose(moved[0], moved[1], rtol=0, atol=1e-9), "the value loss did not reach the shared body"


def test_shared_value_head_learns_the_returns(model_dir):
    """With the actor frozen (lr 0) the head alone is fitted: its value loss on a fixed batch falls steadily."""
    upd = _shared_updater(model_dir, value_clip=None)
    upd.cfg.trainer.lr = 0.0
    for group in upd.actor_opt.param_groups:
        group["lr"] = 0.0
    for group in upd.critic_opt.param_groups:
        group["lr"] = 0.05
    upd.actor_sched.base_lrs = [0.0]
    upd.critic_sched.base_lrs = [0.05]
    groups = _groups(seed=4, num_groups=8)
    losses = [upd.step(collate_groups(groups, pad_token_id=0))["critic/vf_loss"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_batch_targets_are_computed_without_a_model():
    """ppo_targets: the over-length penalty, clip and group normalisation land on each response's last token; with
    no off-policy correction the trust region is around the behaviour log-probs and every response token trains."""
    groups = _groups(num_groups=1, n=2)
    for sample, reward, length in zip(groups[0].samples, (1.0, 3.0), (2, 5)):
        sample.reward = reward
        sample.response_ids = sample.response_ids[:1].repeat(length)
        sample.behavior_logprobs = np.full(length, -0.5, dtype=np.float32)
    batch = collate_groups(groups, pad_token_id=0)
    alg = _cfg(overlong_buffer_len=2, overlong_penalty_factor=1.0, reward_clip=1.5, reward_norm="group",
               off_policy_correction="none").algorithm
    metrics: dict = {}
    correct_rollout(alg, batch, batch.behavior_logprobs + 0.25, metrics)
    assert torch.equal(batch.old_logprobs, batch.behavior_logprobs)
    assert torch.equal(batch.loss_mask, batch.response_mask.bool())
    # the proximal policy sits 0.25 above the behaviour on every token: k3 = e^0.25 - 0.25 - 1 = 0.034025
    assert metrics["actor/mismatch_kl"] == pytest.approx(0.0340254, abs=1e-6)
    rewards = outcome_token_rewards(alg, batch, response_length=5, running=None, metrics=metrics)
    # lengths 2 and 5 of 5 with a buffer of 2: penalties 0 and -1 -> scores 1, 2 -> clipped 1, 1.5 -> group mean
    # 1.25, std sqrt(0.125) = 0.353553 -> -/+ 0.707104 (eps 1e-6 in the divisor), on tokens 1 and 4
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-0.5)
    expected = torch.zeros_like(rewards)
    expected[0, 1], expected[1, 4] = -0.25 / (0.125 ** 0.5 + 1e-6), 0.25 / (0.125 ** 0.5 + 1e-6)
    torch.testing.assert_close(rewards, expected)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_truncated_responses_leave_the_policy_loss(model_dir, estimator):
    """``mask_truncated``: what a cut response says (its tokens, its behaviour log-probs) no longer moves the actor;
    only its reward does, through its group's baseline. Without the option the same change moves it."""
    groups = _groups(seed=7)
    cut = [s.finish_reason == "length" for g in groups for s in g.samples]
    assert 0 < sum(cut) < len(cut)
    other = copy.deepcopy(groups)
    for g in other:
        for s in g.samples:
            if s.finish_reason == "length":  # same length and reward, other tokens and log-probs
                s.response_ids = (s.response_ids % 11 + 4).astype(np.int32)
                s.behavior_logprobs = s.behavior_logprobs - 0.7
    a, b = collate_groups(groups, pad_token_id=0), collate_groups(other, pad_token_id=0)
    assert a.truncated.tolist() == cut
    for masked in (True, False):
        cfg = _cfg(adv_estimator=estimator, mask_truncated=masked)
        first, second = _updater(cfg, model_dir), _updater(cfg, model_dir)
        metrics = first.step(a)
        second.step(b)
        assert metrics["response_length/clip_ratio"] == pytest.approx(sum(cut) / len(cut))
        if masked:
            torch.testing.assert_close(_params(first.actor), _params(second.actor), rtol=1e-9, atol=1e-10)
        else:
            assert (_params(first.actor) - _params(second.actor)).abs().max() > 1e-6


def test_a_batch_without_signal_leaves_the_weights_where_they_are(model_dir):
    """GRPO on groups whose rewards are all equal has a zero gradient. Adam would still move the weights along its
    first moment (the previous step's gradient); the update skips that step, the next real batch steps again."""
    upd = _updater(_cfg(adv_estimator="grpo"), model_dir)
    first = upd.step(collate_groups(_groups(seed=1), pad_token_id=0))
    assert first["actor/skipped_step_frac"] == 0.0 and first["actor/grad_norm"] > 0
    flat = _groups(seed=2)
    for g in flat:
        for s in g.samples:
            s.reward = 0.0
    before = _params(upd.actor).clone()
    metrics = upd.step(collate_groups(flat, pad_token_id=0))
    assert metrics["actor/grad_norm"] == 0.0 and metrics["actor/skipped_step_frac"] == 1.0
    assert torch.equal(before, _params(upd.actor))
    # what the skipped step would have done: Adam's moment alone moves every weight the last step moved
    ghost = copy.deepcopy(upd.actor_opt.state_dict())
    probe = copy.deepcopy(upd.actor)
    opt = torch.optim.AdamW(probe.parameters(), lr=upd.actor_opt.param_groups[0]["lr"])
    opt.load_state_dict(ghost)
    for p in probe.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    assert (_params(probe) - before).abs().max() > 1e-7
    assert upd.step(collate_groups(_groups(seed=3), pad_token_id=0))["actor/skipped_step_frac"] == 0.0
    assert not torch.equal(before, _params(upd.actor))


def test_a_non_finite_gradient_is_not_applied():
    from asyncppo.learner.optim_step import clip_and_step

    layer = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=0.1)
    before = [p.detach().clone() for p in layer.parameters()]
    (layer(torch.tensor([[1.0, float("nan"), 0.0]])).sum()).backward()
    norm, stepped = clip_and_step(opt, layer.parameters(), 1.0)
    assert not stepped and not np.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, layer.parameters()))
    layer(torch.ones(1, 3)).sum().backward()
    norm, stepped = clip_and_step(opt, layer.parameters(), 1.0)
    assert stepped and norm == pytest.approx(float(np.sqrt(2 * 3 + 2)))  # d/dW = 1 (2x3), d/db = 1 (2)
    assert not torch.equal(before[1], layer.bias)
