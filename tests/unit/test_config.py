"""Config composition, overrides, presets, derived defaults and validation."""

from __future__ import annotations

import copy
import re
import warnings
from pathlib import Path

import pytest

from asyncppo.config import (
    CONFIG_DIR,
    AsyncPPOConfig,
    ConfigError,
    ConfigWarning,
    check_config,
    config_from_yaml,
    config_to_yaml,
    load_config,
    resolve_derived,
)
from asyncppo.config import choices

REPO = Path(__file__).resolve().parents[2]


def _error(overrides: list[str]) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(overrides)
    return info.value


# --- composition and overrides -------------------------------------------------------------------------------


def test_defaults_compose_to_typed_ppo_config():
    cfg = load_config([])
    assert type(cfg) is AsyncPPOConfig
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.use_critic is True
    assert cfg.data.task == "addition" and cfg.model.path == "builtin:tiny-addition"
    # ${now:...} resolved to a timestamp
    assert re.fullmatch(r"runs/\d{8}-\d{6}", cfg.trainer.output_dir), cfg.trainer.output_dir


def test_command_line_overrides_take_effect():
    cfg = load_config(["algorithm.pg_clip=0.28", "rollout.max_staleness=4", "trainer.betas=[0.8,0.95]",
                       "+extra.note=hello"])
    assert cfg.algorithm.pg_clip == 0.28
    assert cfg.rollout.max_staleness == 4
    assert cfg.trainer.betas == [0.8, 0.95]
    assert cfg.extra == {"note": "hello"}


@pytest.mark.parametrize(
    "preset, expect",
    [
        ("ppo", dict(adv_estimator="gae", use_critic=True, use_kl_loss=False)),
        ("grpo", dict(adv_estimator="grpo", use_critic=False, use_kl_loss=True, whiten_advantages=False)),
        ("rloo", dict(adv_estimator="rloo", use_critic=False, add_token_level_kl=True, use_kl_loss=False)),
        ("reinforce_plus_plus", dict(adv_estimator="reinforce_plus_plus", use_critic=False, kl_penalty="mse")),
    ],
)
def test_algorithm_presets(preset, expect):
    cfg = load_config([f"algorithm={preset}"])
    for key, value in expect.items():
        assert getattr(cfg.algorithm, key) == value, key


def test_preset_then_field_override_compose():
    cfg = load_config(["algorithm=grpo", "algorithm.kl_loss_coef=0.05", "data=gsm8k", "model.path=/m",
                       "data.train_files=[a.jsonl]"])
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.kl_loss_coef == 0.05
    assert cfg.data.prompt_key == "question" and cfg.data.answer_key == "answer"
    assert cfg.data.train_files == ["a.jsonl"] and cfg.rollout.reward_fn == "math"
    assert cfg.model.path == "/m"


def test_gsm8k_requires_a_model_path():
    err = _error(["data=gsm8k"])
    assert "model.path=''" in str(err) and "required" in str(err)


def test_derived_defaults_resolved():
    cfg = load_config(["algorithm.pg_clip=0.3", "rollout.response_length=20", "rollout.rollout_batch_size=16"])
    a = cfg.algorithm
    assert (a.clip_ratio_low, a.clip_ratio_high) == (0.3, 0.3)
    assert a.loss_agg_norm_length == 20
    assert a.ppo_mini_batch_size == 4 and cfg.rollout.prompts_per_call == 16  # the built-in recipe: 4 mini-batches
    assert cfg.cluster.advertise_address == cfg.cluster.bind_address
    cfg = load_config(["algorithm.clip_ratio_high=0.28", "algorithm.ppo_mini_batch_size=8"])
    assert (cfg.algorithm.clip_ratio_low, cfg.algorithm.clip_ratio_high) == (0.2, 0.28)
    assert cfg.algorithm.ppo_mini_batch_size == 8
    # resolving twice changes nothing
    assert resolve_derived(copy.deepcopy(cfg)) == cfg


def test_yaml_round_trip_is_exact():
    cfg = load_config(["algorithm=rloo", "rollout.sampling.seed=3", "cluster.rollout_workers=3"])
    text = config_to_yaml(cfg)
    assert config_from_yaml(text) == cfg
    assert config_to_yaml(config_from_yaml(text)) == text


def test_custom_config_dir(tmp_path):
    (tmp_path / "mine.yaml").write_text("defaults:\n  - asyncppo_schema\n  - _self_\nrollout:\n  max_staleness: 7\n")
    cfg = load_config([], config_dir=tmp_path, config_name="mine")
    assert cfg.rollout.max_staleness == 7


def test_top_level_configs_is_the_packaged_dir():
    assert (REPO / "configs" / "config.yaml").is_file()
    assert (REPO / "configs").resolve() == CONFIG_DIR.resolve()


# --- override errors -----------------------------------------------------------------------------------------


def test_unknown_keys_are_all_named_with_suggestions():
    msg = str(_error(["algorithm.pg_clp=0.1", "rollout.bogus=1", "+trainer.nope=2"]))
    assert "algorithm.pg_clp: unknown key" in msg and "did you mean 'algorithm.pg_clip'" in msg
    assert "rollout.bogus: unknown key" in msg
    assert "trainer.nope: unknown key" in msg and "extra.*" in msg
    assert "3 problems" in msg


def test_bad_type_names_key_and_value():
    msg = str(_error(["algorithm.pg_clip=abc"]))
    assert "algorithm.pg_clip" in msg and "'abc'" in msg


def test_unknown_preset_lists_available():
    msg = str(_error(["algorithm=ppo2"]))
    assert "algorithm/ppo2" in msg and "grpo" in msg and "rloo" in msg


def test_sub_key_of_a_value():
    assert "has no sub-key" in str(_error(["algorithm.pg_clip.x=1"]))


# --- validation: every rule names key and value ----------------------------------------------------------------

INVALID = [
    (["rollout.sampling.min_p=0.1"], "rollout.sampling.min_p=0.1"),
    (["rollout.sampling.repetition_penalty=1.2"], "rollout.sampling.repetition_penalty=1.2"),
    (["rollout.sampling.stop=[END]"], "rollout.sampling.stop=['END']"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo'"),
    (["algorithm.loss_agg_mode=mean"], "algorithm.loss_agg_mode='mean'"),
    (["algorithm.kl_penalty=k4"], "algorithm.kl_penalty='k4'"),
    (["algorithm.kl_penalty=k3++"], "algorithm.kl_penalty='k3++'"),
    (["algorithm.kl_ctrl.type=pid"], "algorithm.kl_ctrl.type='pid'"),
    (["algorithm.reward_norm=global"], "algorithm.reward_norm='global'"),
    (["algorithm.off_policy_correction=vtrace"], "algorithm.off_policy_correction='vtrace'"),
    (["rollout.engine=sglang"], "rollout.engine='sglang'"),
    (["trainer.cpu_threads=0"], "trainer.cpu_threads=0"),
    (["rollout.dtype=int8"], "rollout.dtype='int8'"),
    (["model.dtype=float16"], "model.dtype='float16'"),
    (["algorithm.clip_ratio_c=1.0"], "algorithm.clip_ratio_c=1.0"),
    (["algorithm.clip_ratio_c=0.5"], "algorithm.clip_ratio_c=0.5"),
    (["algorithm.lambd=1.5"], "algorithm.lambd=1.5"),
    (["algorithm.lambd=-0.1"], "algorithm.lambd=-0.1"),
    (["algorithm.gamma=1.01"], "algorithm.gamma=1.01"),
    (["rollout.response_length=0"], "rollout.response_length=0"),
    (["rollout.prompt_length=-4"], "rollout.prompt_length=-4"),
    (["rollout.rollout_batch_size=0"], "rollout.rollout_batch_size=0"),
    (["rollout.num_return_sequences_in_group=0"], "rollout.num_return_sequences_in_group=0"),
    (["algorithm.ppo_mini_batch_size=-1"], "algorithm.ppo_mini_batch_size=-1"),
    (["algorithm.pg_clip=0"], "algorithm.pg_clip=0.0"),
    (["algorithm.pg_clip=-0.2"], "algorithm.pg_clip=-0.2"),
    (["algorithm.clip_ratio_low=1.0"], "algorithm.clip_ratio_low=1.0"),
    (["rollout.max_staleness=-1"], "rollout.max_staleness=-1"),
    (["rollout.sync_every=0"], "rollout.sync_every=0"),
    (["rollout.sync_every=4", "rollout.max_staleness=2"], "rollout.max_staleness=2"),
    (["algorithm.ppo_mini_batch_size=5"], "algorithm.ppo_mini_batch_size=5"),
    (["algorithm.micro_batch_size=3"], "algorithm.micro_batch_size=3"),
    (["algorithm=rloo", "rollout.num_return_sequences_in_group=1"], "rollout.num_return_sequences_in_group=1"),
    (["algorithm=grpo", "rollout.num_return_sequences_in_group=1"], "rollout.num_return_sequences_in_group=1"),
    (["algorithm.use_critic=false"], "algorithm.use_critic=False"),
    (["rollout.sampling.temperature=0", "algorithm.temperature=0"], "rollout.sampling.temperature=0.0"),
    (["algorithm.temperature=-1"], "algorithm.temperature=-1.0"),
    (["rollout.sampling.temperature=0.7"], "algorithm.temperature=1.0"),
    (["algorithm.entropy_coef=-0.01"], "algorithm.entropy_coef=-0.01"),
    (["cluster.rollout_gpus=-1"], "cluster.rollout_gpus=-1"),
    (["cluster.train_gpus=-2"], "cluster.train_gpus=-2"),
    (["cluster.train_gpus=3"], "cluster.train_gpus=3"),
    (["cluster.rollout_workers=0"], "cluster.rollout_workers=0"),
    (["cluster.stop_grace_s=-1"], "cluster.stop_grace_s=-1"),
    (["cluster.control_port=70000"], "cluster.control_port=70000"),
    (["cluster.control_port=5555", "cluster.sync_port=5555"], "cluster.sync_port=5555"),
    (["rollout.reward_fn=not a path"], "rollout.reward_fn='not a path'"),
    (["data.train_files=[a.csv]"], "data.train_files[0]='a.csv'"),
    (["trainer.betas=[0.9]"], "trainer.betas=[0.9]"),
    (["trainer.logger.wandb_mode=cloud"], "trainer.logger.wandb_mode='cloud'"),
    (["algorithm.max_tokens_per_micro_batch=10"], "algorithm.max_tokens_per_micro_batch=10"),
    (["algorithm.reward_shift=true", "algorithm.reward_scale=true", "algorithm.reward_norm=batch"],
     "algorithm.reward_scale=True"),
    (["algorithm.off_policy_cap=0.5"], "algorithm.off_policy_cap=0.5"),
    (["rollout.sampling.top_p=0"], "rollout.sampling.top_p=0.0"),
    (["rollout.max_staleness=2", "rollout.admission_lookahead=3"], "rollout.admission_lookahead=3"),
    (["rollout.admission_lookahead=-1"], "rollout.admission_lookahead=-1"),
    (["rollout.sync_every=3", "rollout.max_staleness=4", "rollout.admission_lookahead=1"],
     "rollout.admission_lookahead=1"),
]


@pytest.mark.parametrize("overrides, needle", INVALID, ids=[" ".join(o) for o, _ in INVALID])
def test_invalid_value_is_named(overrides, needle):
    err = _error(overrides)
    assert needle in str(err), str(err)
    line = next(p for p in err.problems if needle in p)
    assert ":" in line.split(needle, 1)[1], "the line must say what is allowed"


def test_allowed_values_are_listed():
    msg = str(_error(["algorithm.loss_agg_mode=mean"]))
    for mode in choices.LOSS_AGG_MODES:
        assert mode in msg


def test_all_problems_collected_in_one_error():
    err = _error(["algorithm.gamma=2", "algorithm.pg_clip=-1", "rollout.sync_every=0", "cluster.train_gpus=-1"])
    assert len(err.problems) >= 4
    assert "4 problems" in str(err) or f"{len(err.problems)} problems" in str(err)


@pytest.mark.parametrize("good", [
    ["rollout.sync_every=3", "rollout.max_staleness=2"],  # exactly sync_every - 1
    ["rollout.max_staleness=0"],  # synchronous PPO
    ["algorithm.kl_penalty=low_var_kl+"],
    ["algorithm.kl_penalty=k2+"],
    ["algorithm.reward_norm=null"],
    ["algorithm.reward_norm=group", "algorithm=grpo"],
    ["algorithm.ppo_mini_batch_size=8", "algorithm.micro_batch_size=16"],
    ["cluster.train_gpus=4", "cluster.rollout_gpus=4"],
    ["rollout.reward_fn=my_pkg.rewards:score"],
    ["algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.28", "algorithm.dual_clip_loss=true"],
    ["rollout.sampling.temperature=0.7", "algorithm.temperature=0.7"],
    ["rollout.max_staleness=4", "rollout.admission_lookahead=0"],
    ["rollout.max_staleness=4", "rollout.admission_lookahead=4"],
    ["rollout.sync_every=3", "rollout.max_staleness=4", "rollout.admission_lookahead=2"],  # exactly sync_every - 1
])
def test_valid_edge_cases_pass(good):
    load_config(good)


def test_both_kl_terms_warn_not_fail():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config(["algorithm.use_kl_loss=true", "algorithm.add_token_level_kl=true"])
    msgs = [str(w.message) for w in caught if issubclass(w.category, ConfigWarning)]
    assert any("penalised twice" in m for m in msgs), msgs


def test_check_config_on_a_plain_dataclass():
    cfg = AsyncPPOConfig()
    cfg.algorithm.clip_ratio_c = 1.0
    cfg.rollout.sync_every = 2
    cfg.rollout.max_staleness = 0
    errors, _ = check_config(cfg)
    assert any(e.startswith("algorithm.clip_ratio_c=1.0:") for e in errors)
    assert any(e.startswith("rollout.max_staleness=0:") for e in errors)
    assert check_config(AsyncPPOConfig()) == ([], [])


def test_shared_value_head_is_refused_where_it_cannot_work():
    assert "model.critic_path" in str(_error(["model.shared_backbone=true", "model.critic_path=/some/critic"]))
    # no effect without a critic or with several learner ranks: allowed (the built-in recipe sets it for every
    # algorithm and GPU count)
    assert load_config(["model.shared_backbone=true", "algorithm=grpo"]).model.shared_backbone is True
    cfg = load_config(["model.shared_backbone=true"])
    assert cfg.model.shared_backbone is True
    cfg.cluster.train_gpus = 2  # several learner ranks train a separate critic
    errors, _ = check_config(cfg)
    assert not errors


@pytest.mark.parametrize("batch, expect", [(128, 32), (64, 16), (8, 2), (4, 1), (2, 1), (1, 1)])
def test_num_mini_batches_splits_whatever_batch_size(batch, expect):
    """The built-in recipe asks for 4 mini-batches, so overriding only the batch size keeps a valid split (a batch
    of fewer prompts gets one per mini-batch); an explicit ppo_mini_batch_size wins, and a split that does not
    divide the batch is refused."""
    cfg = load_config([f"rollout.rollout_batch_size={batch}"])
    assert cfg.algorithm.ppo_num_mini_batches == 4 and cfg.algorithm.ppo_mini_batch_size == expect
    assert load_config(["rollout.rollout_batch_size=8", "algorithm.ppo_mini_batch_size=8"]
                       ).algorithm.ppo_mini_batch_size == 8
    assert "algorithm.ppo_num_mini_batches" in str(_error(["rollout.rollout_batch_size=6"]))


def test_admission_lookahead_defaults_to_max_staleness():
    assert load_config(["rollout.max_staleness=3"]).rollout.admission_lookahead == 3
    assert load_config(["rollout.max_staleness=3", "rollout.admission_lookahead=1"]).rollout.admission_lookahead == 1
