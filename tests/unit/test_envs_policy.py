"""The MLP actor-critic, environment checks, configuration rules and the embodied update's pieces."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncppo.config import ConfigError, load_config
from asyncppo.models.actor_critic import ActorCritic, PolicySpec
from asyncppo.envs.spaces import EnvError, describe_env, describe_spaces

REPO = Path(__file__).resolve().parents[2]


def test_unknown_env_id_is_a_clear_error():
    cfg = load_config(["env=NoSuchEnvironment-v0"])
    assert cfg.env.id == "NoSuchEnvironment-v0"
    with pytest.raises(EnvError, match="env.id='NoSuchEnvironment-v0': not a registered gymnasium environment"):
        describe_env(cfg.env)


def test_a_module_qualified_env_id_imports_its_module_and_a_missing_module_is_named():
    """gymnasium's ``module:id`` form: the import registers the environment (tests/gym_envs.py), in the driver's
    check as in every env worker's ``make_vec``; a module that cannot be imported is named in the error."""
    cfg = load_config(["env=cartpole", "env.id=tests.gym_envs:FaultyCartPole-v1"])
    desc = describe_env(cfg.env)
    assert desc.obs_shape == (4,) and desc.discrete and desc.action_dim == 2
    cfg = load_config(["env=cartpole", "env.id=no_such_package.envs:Thing-v0"])
    with pytest.raises(EnvError, match="the module 'no_such_package.envs' that should register 'Thing-v0' could "
                                       "not be imported"):
        describe_env(cfg.env)
    cfg = load_config(["env=cartpole", "env.id=tests.gym_envs:NotRegistered-v0"])  # imported, but no such id
    with pytest.raises(EnvError, match="not a registered gymnasium environment"):
        describe_env(cfg.env)


def test_launch_refuses_an_unknown_env_before_starting_ray(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "asyncppo", "launch", "env=CartPoel-v1",
                           f"trainer.output_dir={tmp_path}", "trainer.logger.wandb=false"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "not a registered gymnasium environment" in proc.stderr
    assert "CartPole" in proc.stderr  # gymnasium's own suggestion is passed on


def test_unsupported_spaces_are_clear_errors():
    from gymnasium import spaces

    box = spaces.Box(-1, 1, (3,), np.float32)
    with pytest.raises(EnvError, match=r"action space MultiDiscrete\(\[3 4\]\) is not supported"):
        describe_spaces("X-v0", box, spaces.MultiDiscrete([3, 4]))
    with pytest.raises(EnvError, match="action space"):
        describe_spaces("X-v0", box, spaces.Box(-1, 1, (2, 2), np.float32))
    with pytest.raises(EnvError, match="observation space"):
        describe_spaces("X-v0", spaces.Discrete(5), spaces.Discrete(2))
    # a registered environment whose observations are a Tuple
    with pytest.raises(EnvError, match="observation space Tuple"):
        describe_env(load_config(["env=Blackjack-v1"]).env)
    d = describe_spaces("X-v0", box, spaces.Box(-2, 2, (2,), np.float32))
    assert (d.discrete, d.action_dim, d.action_low.tolist()) == (False, 2, [-2.0, -2.0])


def test_configuration_rules():
    with pytest.raises(ConfigError, match="model.shared_backbone=True: needs algorithm.loss_type=actor_critic"):
        load_config(["env=cartpole", "model.shared_backbone=true", "algorithm.loss_type=actor"])
    with pytest.raises(ConfigError, match="algorithm.loss_type='actor_critic': needs an embodied run"):
        load_config(["algorithm.loss_type=actor_critic"])
    with pytest.raises(ConfigError, match="env.num_minibatches=3: must divide the 256 transitions"):
        load_config(["env=cartpole", "env.num_minibatches=3"])
    with pytest.raises(ConfigError, match="algorithm.adv_estimator='grpo': embodied runs use gae"):
        load_config(["env=cartpole", "algorithm.adv_estimator=grpo"])
    cfg = load_config(["env=HalfCheetah-v5"])  # any id: the generic preset, continuous-control defaults
    assert (cfg.env.id, cfg.env.normalize_obs, cfg.algorithm.loss_type) == ("HalfCheetah-v5", True, "actor_critic")
    assert load_config([]).env.id is None  # LLM runs are unchanged


def _spec(**kw) -> PolicySpec:
    base = dict(obs_dim=3, discrete=False, action_dim=2, hidden_sizes=(8, 8))
    base.update(kw)
    return PolicySpec(**base)


def test_behaviour_logprobs_match_the_learners_evaluation():
    torch.manual_seed(0)
    obs = torch.randn(16, 3)
    for spec in (_spec(), _spec(discrete=True, action_dim=4, shared_backbone=True)):
        pol = ActorCritic(spec)
        a, lp = pol.act(obs.numpy(), torch.Generator().manual_seed(1))
        lp2, ent, v = pol.evaluate(obs, torch.as_tensor(a))
        assert np.allclose(lp, lp2.detach().numpy(), atol=1e-5)
        assert v.shape == (16,)
        if not spec.discrete:  # a diagonal Gaussian with std 1 (log-std 0): entropy is 2 * 0.5 * log(2 pi e)
            assert torch.allclose(ent, torch.full((16,), math.log(2 * math.pi * math.e)))
    names = {n for n, _ in ActorCritic(_spec(shared_backbone=True)).named_parameters()}
    assert any(n.startswith("trunk.") for n in names) and not any("actor_trunk" in n for n in names)
    names = {n for n, _ in ActorCritic(_spec()).named_parameters()}
    assert any(n.startswith("actor_trunk.") for n in names) and any(n.startswith("critic_trunk.") for n in names)


def test_observation_statistics_travel_with_the_weights():
    torch.manual_seed(0)
    learner = ActorCritic(_spec(normalize_obs=True))
    data = torch.randn(1000, 3, dtype=torch.float64) * torch.tensor([1.0, 10.0, 0.1]) + 5
    learner.obs_norm.update(data[:600].float())
    learner.obs_norm.update(data[600:].float())
    assert torch.allclose(learner.obs_norm.mean, data.float().double().mean(0), atol=1e-6)
    assert torch.allclose(learner.obs_norm.var, data.float().double().var(0, unbiased=False), rtol=1e-6)
    state = learner.state_dict()  # what the weight broadcast ships
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(state)
    worker = ActorCritic(_spec(normalize_obs=True))
    worker.load_state_dict({k: v.clone() for k, v in state.items()})
    x = data[:5].float()
    assert torch.equal(worker.evaluate(x, torch.zeros(5, 2))[0], learner.evaluate(x, torch.zeros(5, 2))[0])
    z = worker.obs_norm(x)
    assert z.abs().max() < 4  # normalised: the raw values are ~5 +- 10


def test_return_scaler_and_learning_rate_schedule():
    from asyncppo.learner.embodied_update import ReturnScaler
    from asyncppo.learner.schedule import lr_lambda as _lr_lambda
    from asyncppo.stream.segments import EnvSegment

    z = np.zeros((1, 3))
    seg = EnvSegment(obs=np.zeros((1, 3, 1), np.float32), actions=np.zeros((1, 3), np.int64),
                     logprobs=np.zeros((1, 3), np.float32), rewards=np.ones((1, 3), np.float32),
                     terminated=np.array([[False, True, False]]), truncated=z.astype(bool),
                     versions=np.zeros(3, np.int64), bootstrap_obs=np.zeros((1, 1), np.float32),
                     final_index=np.zeros(0, np.int64), final_obs=np.zeros((0, 1), np.float32))
    s = ReturnScaler(gamma=0.5, eps=0.0)
    out = s(seg, np.array([[1.0, 2.0, 4.0]]))
    # discounted returns 1, 0.5 + 2 = 2.5, then the episode ended: 4  -> population std of (1, 2.5, 4) = sqrt(1.5)
    assert np.allclose(out, np.array([[1.0, 2.0, 4.0]]) / math.sqrt(1.5))
    lin = _lr_lambda(0, 10, "linear")
    assert [lin(s) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    warm = _lr_lambda(4, 10, "constant")
    assert [warm(s) for s in (0, 3, 9)] == [0.25, 1.0, 1.0]
