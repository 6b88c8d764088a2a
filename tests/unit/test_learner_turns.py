"""A hand-built 3-turn episode through encode -> decode -> door -> collate -> the PPO loss: environment tokens are
read by the model but trained on by nothing. The loss and its gradient equal those of the model tokens alone (the
environment positions of the logits get exactly zero gradient), turn rewards land where their turns ended, and
GAE chains from one model token to the next, skipping environment tokens (hand-computed)."""

import dataclasses
import functools

import numpy as np
import pytest
import torch

from asyncppo import algo
from asyncppo.config import load_config
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.ppo_losses import LossNorms, actor_loss, loss_mask
from asyncppo.learner.ppo_targets import outcome_token_rewards, set_advantages
from asyncppo.stream.records import TrajectoryGroup
from asyncppo.stream.validate import GroupValidator
from asyncppo.stream.wire import decode_group, encode_group
from tests.unit.test_learner import _cfg, _updater, model_dir  # noqa: F401 (model_dir: a fixture)
from tests.unit.test_stream_turns import ENV_POS, LIMITS, MODEL_POS, episode, group, single

V = 48


def arrived():
    """The episode and a single-turn sample of the same prompt, as the learner receives them."""
    g = decode_group(encode_group(group([episode(), single()])))
    assert GroupValidator(LIMITS, lambda: 5).check(g) is None
    return g


def test_collate_masks_environment_tokens_and_places_turn_rewards():
    b = collate_groups([arrived()], pad_token_id=0)
    P = b.prompt_len
    assert b.response_mask[0].nonzero().squeeze(1).tolist() == MODEL_POS
    assert b.response_mask[1].tolist() == [1.0] * 4 + [0.0] * 8
    # the model still reads the environment's tokens: they are in the input and attended to
    assert b.input_ids[0, P:].tolist() == list(range(20, 32)) and b.attention_mask[0].sum() == 3 + 12
    assert b.token_versions[0].tolist() == [4] * 5 + [5] * 7
    assert b.turn_rewards[0].nonzero().squeeze(1).tolist() == [6, 11]  # turn 1's reward is 0.0
    assert b.turn_rewards[0, [2, 6, 11]].tolist() == [0.0, 0.5, 1.0] and b.turn_rewards[1].abs().sum() == 0
    assert b.behavior_logprobs[0, ENV_POS].abs().sum() == 0


@functools.lru_cache(maxsize=None)
def _config(*extra):
    return load_config(["algorithm=grpo", "algorithm.entropy_coef=0.01", "algorithm.use_kl_loss=true", *extra])


def test_outcome_rewards_sum_the_turns_and_gae_sees_them_where_the_turns_ended():
    cfg = _config()
    b = collate_groups([arrived()], pad_token_id=0)
    tok = outcome_token_rewards(cfg.algorithm, b, 12, None, {})
    assert tok.sum(dim=1).tolist() == pytest.approx([1.5, 0.0])  # GRPO reads the sum of the turn rewards
    assert tok[0, [6, 11]].tolist() == pytest.approx([0.5, 1.0]) and tok[1, 3] == 0.0
    set_advantages(cfg.algorithm, b, tok, {})
    adv = b.advantages
    assert adv[0, ENV_POS].abs().sum() == 0 and adv[0, MODEL_POS].tolist() == pytest.approx([2 ** -0.5] * 7, abs=1e-5)
    # processing that moves the score (here a clip to 1) moves it on the last model token; the turns stay put
    clipped = outcome_token_rewards(_config("algorithm.reward_clip=1.0").algorithm, b, 12, None, {})
    assert clipped[0, [6, 11]].tolist() == pytest.approx([0.5, 0.5]) and clipped[0].sum() == pytest.approx(1.0)


def _gather(x, index):
    return torch.gather(x, 1, index) if x.dim() == 2 else torch.gather(x, 1, index[..., None].expand(-1, -1, V))


def test_the_loss_and_its_gradient_are_those_of_the_model_tokens_alone():
    cfg = _config()
    alg = cfg.algorithm
    b = collate_groups([arrived()], pad_token_id=0)
    set_advantages(alg, b, outcome_token_rewards(alg, b, 12, None, {}), {})
    gen = torch.Generator().manual_seed(0)
    b.old_logprobs = b.behavior_logprobs + 0.05 * torch.randn(b.behavior_logprobs.shape, generator=gen)
    b.ref_logprobs = b.old_logprobs - 0.1 * torch.rand(b.behavior_logprobs.shape, generator=gen)
    logits = torch.randn((2, 12, V), generator=gen, dtype=torch.float32)
    labels = b.input_ids[:, b.prompt_len:] % V

    def loss_of(batch, lg, lab):
        lg = lg.clone().requires_grad_(True)
        norms = LossNorms.for_mini_batch(alg, list(algo.loss_denominators(batch.response_mask, loss_mask(batch))))
        out = actor_loss(alg, batch, algo.logprobs_from_logits(lg, lab), algo.entropy_from_logits(lg), lg, None,
                         norms)
        out.loss.backward()
        return out, lg.grad

    full, grad = loss_of(b, logits, labels)
    # the same episode with its environment tokens cut out: row 0 keeps its 7 model tokens, row 1 its 4 tokens
    index = torch.tensor([MODEL_POS, [0, 1, 2, 3, 4, 5, 6]])
    cut = dataclasses.replace(
        b, response_mask=torch.tensor([[1.0] * 7, [1.0] * 4 + [0.0] * 3]),
        **{k: _gather(getattr(b, k), index) for k in ("old_logprobs", "ref_logprobs", "advantages")})
    alone, grad_alone = loss_of(cut, _gather(logits, index), _gather(labels, index))
    assert float(full.loss.detach()) == pytest.approx(float(alone.loss.detach()), rel=1e-6, abs=1e-7)
    assert full.kept_tokens == alone.kept_tokens == 11
    assert grad[0, ENV_POS].abs().max() == 0.0  # exactly zero, not small
    assert grad[0, MODEL_POS].abs().min() > 0
    torch.testing.assert_close(grad[0, MODEL_POS], grad_alone[0], rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(grad[1, :4], grad_alone[1, :4], rtol=1e-5, atol=1e-8)
    assert full.metrics["actor/entropy"] == pytest.approx(alone.metrics["actor/entropy"], rel=1e-6)


def test_masked_gae_by_hand():
    # tokens: model, env, model; the env token's value (9.0) and reward (5.0) must not matter
    rewards = torch.tensor([[0.0, 5.0, 1.0]])
    values = torch.tensor([[0.5, 9.0, 0.8]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    adv, ret = algo.gae_advantages(rewards, mask, values=values, gamma=0.9, lambd=0.8)
    # t=2: delta = 1 + 0.9*0 - 0.8 = 0.2 ;  t=0 (next model token is t=2): delta = 0 + 0.9*0.8 - 0.5 = 0.22,
    # A0 = 0.22 + 0.9*0.8*0.2 = 0.364
    assert adv.tolist() == [pytest.approx([0.364, 0.0, 0.2])]
    assert ret.tolist() == [pytest.approx([0.864, 0.0, 1.0])]
    cut, cut_ret = algo.gae_advantages(rewards[:, [0, 2]], mask[:, [0, 2]], values=values[:, [0, 2]], gamma=0.9,
                                       lambd=0.8)
    torch.testing.assert_close(adv[:, [0, 2]], cut)
    # three turns with a reward each, two env segments of different lengths, gamma = lambda = 1: A_t = G_t - V_t
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 0, 0, 1.0]])
    rewards = torch.tensor([[0, 0.5, 0, 0, 0.25, 0, 0, 0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 7, 7, 0.3, 7, 7, 7, 0.4]])
    adv, _ = algo.gae_advantages(rewards, mask, values=values)
    assert adv[0].tolist() == pytest.approx([1.75 - 0.1, 1.75 - 0.2, 0, 0, 1.25 - 0.3, 0, 0, 0, 1.0 - 0.4])


def test_place_turn_rewards_keeps_each_row_summing_to_its_score():
    mask = torch.tensor([[1, 0, 1, 1.0], [1, 1, 0, 0]])
    turns = torch.tensor([[0.5, 0, 0, 0.0], [0, 0, 0, 0]])  # row 0: turn 1 ends at token 0; row 1 has none
    out = algo.place_turn_rewards(torch.tensor([2.0, -1.0]), turns, mask)
    assert out.tolist() == [[0.5, 0, 0, 1.5], [0, -1.0, 0, 0]]
    with pytest.raises(ValueError, match="turn_rewards shape"):
        algo.place_turn_rewards(torch.zeros(2), turns[:, :3], mask)


def _episodes(num_groups=3, n=3, seed=0, vocab=16):
    """Groups of 2-turn episodes (model 3, env 2, model 3 tokens) with a reward per turn."""
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        samples = []
        for _ in range(n):
            lps = (-rng.random(8) * 3).astype(np.float32)
            lps[3:5] = 0.0
            turns = np.array([0.5 * rng.integers(0, 2), float(rng.integers(0, 2))])
            samples.append(episode(response_ids=rng.integers(4, vocab, 8).astype(np.int32), behavior_logprobs=lps,
                                   reward=float(turns.sum()), version_min=0, version_max=0, version_spans=None,
                                   env_runs=np.array([[3, 2]]), turn_rewards=turns))
        prompt = rng.integers(4, vocab, size=4).astype(np.int32)
        groups.append(decode_group(encode_group(TrajectoryGroup(f"0-{g}", 0, prompt, samples))))
    return groups


@pytest.mark.parametrize("options", [dict(adv_estimator="gae"), dict(adv_estimator="grpo", use_kl_loss=True)])
def test_a_ppo_step_on_multi_turn_groups(model_dir, options):  # noqa: F811 (the fixture)
    cfg = _cfg(**options)
    upd = _updater(cfg, model_dir)
    before = torch.cat([p.detach().flatten() for p in upd.actor.parameters()]).clone()
    batch = collate_groups(_episodes(), pad_token_id=0)
    assert int(batch.response_mask.sum()) == 9 * 6
    metrics = upd.step(batch)
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in upd.actor.parameters()]))
    for key in ("actor/approx_kl", "actor/entropy", "reward/mean"):
        assert np.isfinite(metrics[key]), key
    if options["adv_estimator"] == "gae":
        assert "critic/vf_loss" in metrics
