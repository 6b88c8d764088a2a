"""`asyncppo convert` and `asyncppo launch --config-file`.

The inputs in tests/convert_inputs/ are configs written for these tests in each project's own format, from its
documentation, covering the keys of its PPO and GRPO examples. Every expected value below was derived by hand from
the input and the project's semantics (comments name the non-obvious ones), and each conversion is compared
*completely*: no asyncppo key may be written that the test does not expect.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

from asyncppo.cli import main
from asyncppo.config import ConfigError, config_to_yaml, load_config
from asyncppo.config.convert import convert
from asyncppo.config.convert.engine import Context, read_foreign, schema_defaults

INPUTS = Path(__file__).resolve().parents[1] / "convert_inputs"
REPO = Path(__file__).resolve().parents[2]


def _convert(name: str):
    return convert((INPUTS / f"{name}.yaml").read_text(), name.split("_")[0], f"{name}.yaml")


EXPECTED = {
    "verl_ppo": {
        "algorithm.adv_estimator": "gae", "algorithm.whiten_advantages": True,  # verl whitens GAE, always
        "algorithm.gamma": 1.0, "algorithm.lambd": 0.95, "algorithm.add_token_level_kl": False,
        "algorithm.use_kl_loss": False, "algorithm.pg_clip": 0.2,
        # clip_ratio_low/high default to 0.2 in verl (not null), and dual clip is always on with c = 3:
        "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.2, "algorithm.dual_clip_loss": True,
        "algorithm.ppo_mini_batch_size": 64, "algorithm.micro_batch_size": 4, "algorithm.temperature": 1.0,
        "algorithm.pack_sequences": True,  # model.use_remove_padding: true
        "rollout.engine": "vllm", "rollout.num_return_sequences_in_group": 1, "rollout.prompt_length": 512,
        "rollout.response_length": 256, "rollout.rollout_batch_size": 256, "rollout.overlong_prompt": "skip",
        "rollout.gpu_memory_utilization": 0.4, "rollout.reward_fn": "math", "rollout.sampling.temperature": 1.0,
        "rollout.max_staleness": 0,  # verl's PPO trainer is synchronous
        "model.path": "/models/Qwen2.5-0.5B-Instruct", "model.critic_path": "/models/Qwen2.5-0.5B-Instruct",
        "model.gradient_checkpointing": True,
        "data.train_files": ["/data/gsm8k/train.parquet"], "data.eval_files": ["/data/gsm8k/test.parquet"],
        "trainer.lr": 1e-6, "trainer.critic_lr": 1e-5, "trainer.weight_decay": 0.01,  # verl's AdamW default
        "trainer.save_every": 10, "trainer.eval_every": 10, "trainer.total_steps": 105,
        "trainer.logger.console": True, "trainer.logger.wandb": True,
        "trainer.logger.wandb_project": "verl_examples", "trainer.logger.wandb_run_name": "gsm8k_ppo",
    },
    "verl_grpo": {
        "trainer.eval_at_start": False,  # val_before_train: false
        "algorithm.adv_estimator": "grpo", "algorithm.whiten_advantages": False, "algorithm.add_token_level_kl": False,
        "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.28,
        "algorithm.dual_clip_loss": True, "algorithm.clip_ratio_c": 10.0, "algorithm.entropy_coef": 0.0,
        "algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.001, "algorithm.kl_penalty": "low_var_kl",
        "algorithm.loss_agg_mode": "seq-mean-token-sum-norm", "algorithm.loss_agg_norm_length": 1024,
        "algorithm.ppo_mini_batch_size": 8, "algorithm.micro_batch_size": 8,
        "algorithm.max_tokens_per_micro_batch": 8192,  # use_dynamic_bsz: true
        "algorithm.off_policy_correction": "decoupled", "algorithm.off_policy_cap": 3.0,  # token IS, decoupled mode
        "algorithm.temperature": 0.7, "rollout.sampling.temperature": 0.7, "rollout.sampling.top_p": 0.95,
        "rollout.sampling.top_k": -1, "rollout.engine": "vllm", "rollout.num_return_sequences_in_group": 8,
        "rollout.prompt_length": 256, "rollout.response_length": 1024, "rollout.rollout_batch_size": 32,
        "rollout.overlong_prompt": "truncate", "rollout.reward_fn": "math", "rollout.weight_bucket_mb": 512,
        # fully-async: sync every 2 steps; staleness 0.5 of a sync period -> 1 + int(0.5 * 2) = 2 versions
        "rollout.sync_every": 2, "rollout.max_staleness": 2, "rollout.inflight_update": "keep",
        "model.path": "/models/Qwen2.5-1.5B-Instruct", "model.trust_remote_code": True,
        "model.gradient_checkpointing": True, "trainer.critic_lr": 1e-5,  # verl defaults, not in the file
        "data.train_files": ["/data/math/train.parquet"], "data.eval_files": ["/data/math/test.parquet"],
        "data.prompt_key": "prompt", "data.seed": 3,
        "trainer.lr": 1e-6, "trainer.weight_decay": 0.0, "trainer.warmup_steps": 10, "trainer.total_steps": 100,
        "trainer.save_every": 20, "trainer.eval_every": 5, "trainer.keep_checkpoints": 3,
        "trainer.logger.console": True, "trainer.logger.wandb": False,  # logger: [console, file]
        "trainer.logger.wandb_project": "grpo_math", "trainer.logger.wandb_run_name": "qwen_grpo",
    },
    "roll_ppo": {
        "algorithm.adv_estimator": "gae", "algorithm.gamma": 1.0, "algorithm.lambd": 0.95, "algorithm.pg_clip": 0.2,
        "algorithm.value_clip": 0.5, "algorithm.dual_clip_loss": False, "algorithm.whiten_advantages": True,
        # norm_mean_type: batch, norm_std_type: null -> subtract the batch mean only
        "algorithm.reward_norm": "batch", "algorithm.reward_shift": True, "algorithm.reward_scale": False,
        "algorithm.add_token_level_kl": True, "algorithm.kl_penalty": "kl", "algorithm.kl_ctrl.type": "adaptive",
        "algorithm.kl_ctrl.init_kl_coef": 0.05, "algorithm.kl_ctrl.target_kl": 0.1,
        "algorithm.kl_ctrl.kl_horizon": 5000,
        "algorithm.kl_loss_coef": 0.0, "algorithm.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.off_policy_correction": "none", "algorithm.temperature": 1.0,
        # 4 per device x 2 accumulation x 2 devices = 16 samples per optimiser step = 16 prompts of 1
        "algorithm.micro_batch_size": 4, "algorithm.ppo_mini_batch_size": 16,
        "data.prompt_key": "messages", "data.seed": 42, "data.train_files": ["data/train.jsonl"],
        "model.path": "/models/Qwen2.5-0.5B", "model.critic_path": "/models/Qwen2.5-0.5B",
        "rollout.engine": "vllm", "rollout.num_return_sequences_in_group": 1, "rollout.prompt_length": 256,
        "rollout.response_length": 512,  # sequence_length 768 - prompt_length 256
        "rollout.rollout_batch_size": 16, "rollout.sampling.temperature": 1.0, "rollout.sampling.top_k": 50,
        "rollout.sampling.top_p": 1.0, "rollout.max_staleness": 0,  # async_generation_ratio defaults to 0
        "trainer.lr": 1e-6, "trainer.critic_lr": 1e-5, "trainer.lr_schedule": "linear",  # ROLL's default schedule
        "trainer.warmup_steps": 10,  # warmup_ratio 0.1 x max_steps 100
        "trainer.eval_every": 10, "trainer.save_every": 25, "trainer.seed": 42, "trainer.total_steps": 100,
        "trainer.logger.console": True, "trainer.logger.wandb": False,
    },
    "roll_grpo": {
        "algorithm.adv_estimator": "grpo", "algorithm.advantage_clip": 2.0, "algorithm.add_token_level_kl": False,
        "algorithm.pg_clip": 0.2, "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.28,
        "algorithm.dual_clip_loss": True, "algorithm.clip_ratio_c": 1.4,  # ROLL's bound: 1 + 2 x pg_clip
        "algorithm.entropy_coef": 0.0, "algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.001,
        "algorithm.kl_penalty": "k3",  # ROLL's KL loss is always k3
        "algorithm.lambd": 0.95, "algorithm.value_clip": None,  # ROLL defaults
        "algorithm.loss_agg_mode": "token-mean", "algorithm.max_tokens_per_micro_batch": 8192,
        # 2 per device x 16 accumulation x 8 devices (list(range(0,8))) = 256 samples = 32 prompts of 8
        "algorithm.micro_batch_size": 2, "algorithm.ppo_mini_batch_size": 32,
        "algorithm.off_policy_correction": "decoupled", "algorithm.off_policy_cap": 2.0, "algorithm.ppo_epochs": 1,
        "algorithm.reward_clip": 10.0, "algorithm.temperature": 0.99, "algorithm.whiten_advantages": True,
        "data.apply_chat_template": True, "data.prompt_key": "prompt", "data.seed": 7,
        "data.train_files": ["data/math_train.jsonl"],
        "model.dtype": "bfloat16", "model.gradient_checkpointing": True, "model.path": "/models/Qwen2.5-0.5B-Instruct",
        "rollout.dtype": "bfloat16", "rollout.engine": "vllm", "rollout.gpu_memory_utilization": 0.6,
        "rollout.max_num_seqs": 128, "rollout.max_staleness": 1, "rollout.sync_every": 1,
        "rollout.num_return_sequences_in_group": 8, "rollout.prompt_length": 512, "rollout.response_length": 1024,
        "rollout.reward_fn": "math", "rollout.rollout_batch_size": 32, "rollout.sampling.temperature": 0.99,
        "rollout.sampling.top_k": 100, "rollout.sampling.top_p": 0.99,
        "trainer.critic_lr": 5e-5, "trainer.eval_every": 20, "trainer.keep_checkpoints": 3,
        "trainer.logger.console": True, "trainer.logger.log_every": 1, "trainer.logger.wandb": True,
        "trainer.logger.wandb_project": "roll_examples", "trainer.logger.wandb_run_name": "grpo-run-1",
        "trainer.lr": 1e-6, "trainer.lr_schedule": "constant", "trainer.output_dir": "./output",
        "trainer.save_every": 50, "trainer.seed": 7, "trainer.total_steps": 200, "trainer.warmup_steps": 10,
        "trainer.weight_decay": 0.0,
    },
    "rlinf_ppo": {
        "algorithm.adv_estimator": "gae", "algorithm.clip_ratio_low": None, "algorithm.clip_ratio_high": None,
        "algorithm.dual_clip_loss": False,  # clip_ratio_c: null
        "algorithm.entropy_coef": 0.0, "algorithm.gamma": 1.0, "algorithm.lambd": 0.95,
        "algorithm.kl_penalty": "low_var_kl", "algorithm.use_kl_loss": False, "algorithm.loss_agg_mode": "token-mean",
        "algorithm.loss_type": "actor", "algorithm.max_tokens_per_micro_batch": 4096, "algorithm.micro_batch_size": 8,
        "algorithm.off_policy_correction": "decoupled", "algorithm.pg_clip": 0.2,
        "algorithm.ppo_mini_batch_size": 16,  # rollout_batch_size 64 / n_minibatches 4
        "algorithm.temperature": 1.0, "algorithm.use_critic": True, "algorithm.value_clip": 0.5,
        "algorithm.whiten_advantages": True,
        "data.answer_key": "solutions", "data.apply_chat_template": True, "data.eval_files": ["/data/math/test.jsonl"],
        "data.prompt_key": "prompt", "data.seed": 42, "data.shuffle": True,
        "data.train_files": ["/data/math/train.jsonl"],
        "model.dtype": "bfloat16", "model.path": "/models/Qwen2.5-1.5B-Instruct",
        "rollout.dtype": "bfloat16", "rollout.enforce_eager": False, "rollout.engine": "vllm",
        "rollout.gpu_memory_utilization": 0.5, "rollout.max_num_seqs": 64, "rollout.max_staleness": 0,
        "rollout.num_return_sequences_in_group": 1, "rollout.overlong_prompt": "skip", "rollout.prompt_length": 512,
        "rollout.response_length": 1536,  # ${subtract:${runner.seq_length}, ${data.max_prompt_length}} = 2048 - 512
        "rollout.reward_fn": "math", "rollout.rollout_batch_size": 64, "rollout.sampling.repetition_penalty": 1.0,
        "rollout.sampling.temperature": 1.0, "rollout.sampling.top_k": -1,  # top_k 1000000 keeps every token
        "rollout.sampling.top_p": 1.0,
        "trainer.betas": [0.9, 0.999], "trainer.critic_lr": 1e-5, "trainer.eval_every": 10, "trainer.grad_clip": 1.0,
        "trainer.logger.wandb": True, "trainer.logger.wandb_project": "rlinf",
        "trainer.logger.wandb_run_name": "ppo-math",
        "trainer.lr": 1e-6, "trainer.lr_schedule": "constant", "trainer.output_dir": "/tmp/rlinf_out",
        "trainer.save_every": 50, "trainer.seed": 42, "trainer.total_steps": 300, "trainer.warmup_steps": 0,
        "trainer.weight_decay": 0.01,
    },
    "rlinf_grpo": {
        "algorithm.adv_estimator": "grpo", "algorithm.clip_ratio_low": 0.2, "algorithm.clip_ratio_high": 0.28,
        "algorithm.dual_clip_loss": True,  # clip_ratio_c absent: RLinf applies c = 3 (asyncppo's default c)
        "algorithm.entropy_coef": 0.001, "algorithm.use_kl_loss": True, "algorithm.kl_loss_coef": 0.001,
        "algorithm.kl_penalty": "low_var_kl", "algorithm.loss_agg_mode": "seq-mean-token-mean",
        "algorithm.loss_type": "actor", "algorithm.micro_batch_size": 2, "algorithm.ppo_mini_batch_size": 8,
        "algorithm.off_policy_correction": "decoupled", "algorithm.off_policy_cap": 2.0,  # importance_sampling_fix
        "algorithm.pg_clip": 0.2, "algorithm.temperature": 0.8, "algorithm.whiten_advantages": False,
        "data.answer_key": "solutions", "data.apply_chat_template": False, "data.prompt_key": "prompt",
        "data.seed": 1234, "data.train_files": ["/data/boba/train.jsonl"],
        "model.dtype": "float32", "model.path": "/models/DeepSeek-R1-Distill-Qwen-1.5B",
        "rollout.dtype": "bfloat16", "rollout.engine": "vllm", "rollout.gpu_memory_utilization": 0.55,
        "rollout.max_num_seqs": 128, "rollout.max_staleness": 0, "rollout.num_return_sequences_in_group": 8,
        "rollout.prompt_length": 512, "rollout.response_length": 1024, "rollout.reward_fn": "math",
        "rollout.rollout_batch_size": 16, "rollout.sampling.temperature": 0.8, "rollout.sampling.top_k": 50,
        "rollout.sampling.top_p": 0.95,
        "trainer.betas": [0.9, 0.95], "trainer.eval_every": 5, "trainer.grad_clip": 0.8, "trainer.logger.wandb": False,
        "trainer.logger.wandb_project": "rlinf", "trainer.logger.wandb_run_name": "grpo-math", "trainer.lr": 2e-6,
        "trainer.lr_schedule": "constant", "trainer.output_dir": "../results", "trainer.save_every": 20,
        "trainer.seed": 1234, "trainer.warmup_steps": 5, "trainer.weight_decay": 0.05,
    },
}


if "algorithm.policy_loss" in schema_defaults():  # asyncppo's loss registry, where this build has it
    EXPECTED["verl_grpo"]["algorithm.policy_loss"] = "ppo"  # loss_mode: vanilla


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_converted_values_are_exactly_the_expected_ones(name):
    result = _convert(name)
    assert result.problems == [], result.problems
    assert result.values == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_input_key_is_accounted_for_and_the_yaml_says_the_same(name):
    text = (INPUTS / f"{name}.yaml").read_text()
    result = _convert(name)
    assert set(result.entries) == set(read_foreign(text))
    assert not [e.key for e in result.entries.values() if e.status == "unknown"]
    for entry in result.entries.values():  # every key appears in the report's full table
        assert f"| `{entry.key}` |" in result.report
    written = yaml.safe_load(result.yaml)
    for key, value in EXPECTED[name].items():
        node = written
        for part in key.split("."):
            node = node[part]
        assert node == value, key


def test_silent_behaviour_changes_are_flagged():
    flagged = {e.key: e for e in _convert("roll_grpo").flagged}
    assert "approximate" == flagged["reward_clip"].status  # ROLL clips after normalising, asyncppo before
    assert flagged["train_infer_correction.filters"].status == "unsupported"
    assert flagged["async_generation_ratio"].targets == ["rollout.max_staleness"]
    # a setting equal to the project's default and without effect on learning is listed, not flagged
    entries = _convert("roll_grpo").entries
    assert entries["actor_train.strategy_args.strategy_name"].status == "unsupported"
    assert not entries["actor_train.strategy_args.strategy_name"].flagged
    rlinf = _convert("rlinf_grpo")
    assert rlinf.entries["reward.reward_scale"].flagged  # 5x rewards are not reproduced
    assert rlinf.entries["runner.max_steps"].flagged  # -1: epochs-based, asyncppo needs a step count
    assert rlinf.entries["algorithm.kl_penalty_type"].status == "approximate"  # FSDP actor swaps the arguments
    verl = _convert("verl_grpo")
    # val_before_train: false maps onto trainer.eval_at_start exactly (no point-0 evaluation)
    assert verl.entries["trainer.val_before_train"].targets == ["trainer.eval_at_start"]
    assert not verl.entries["trainer.val_before_train"].flagged
    assert verl.values["trainer.eval_at_start"] is False
    # verl defaults that differ from asyncppo's are carried over and listed as such
    assert "| `algorithm.dual_clip_loss` | `True` | `False` |" in _convert("verl_ppo").report


def test_values_that_do_not_fit_are_flagged_not_dropped():
    text = """
algorithm: {adv_estimator: remax}
actor_rollout_ref:
  actor: {policy_loss: {loss_mode: sapo}}
  rollout: {stop_everything: true}
trainer: {logger: [console, tensorboard]}
"""
    result = convert(text, "verl")
    e = result.entries
    assert e["algorithm.adv_estimator"].status == "unsupported" and e["algorithm.adv_estimator"].flagged
    assert "remax" in e["algorithm.adv_estimator"].why
    assert e["actor_rollout_ref.actor.policy_loss.loss_mode"].flagged
    assert e["actor_rollout_ref.rollout.stop_everything"].status == "unknown" and \
        e["actor_rollout_ref.rollout.stop_everything"].flagged
    assert e["trainer.logger"].status == "approximate"
    assert "algorithm.adv_estimator" not in result.values  # asyncppo's default stays, and the report says why


def test_policy_losses_convert_by_name_where_asyncppo_has_them():
    text = ("actor_rollout_ref:\n  actor:\n"
            "    policy_loss: {loss_mode: clip_cov, clip_cov_ratio: 0.001, kl_cov_ratio: 0.3}\n")
    result = convert(text, "verl")
    mode = result.entries["actor_rollout_ref.actor.policy_loss.loss_mode"]
    if "clip_cov" in Context.choices("POLICY_LOSSES"):
        assert mode.status == "mapped" and result.values["algorithm.policy_loss"] == "clip_cov"
        assert result.values["algorithm.clip_cov_ratio"] == 0.001
    else:
        assert mode.status == "unsupported" and mode.flagged
    # the kl_cov parameter has no effect under clip_cov: listed, not converted, not flagged
    unused = result.entries["actor_rollout_ref.actor.policy_loss.kl_cov_ratio"]
    assert unused.status == "unsupported" and not unused.flagged and "algorithm.kl_cov_ratio" not in result.values


def test_dapo_keys_convert_where_asyncppo_has_them():
    text = """
algorithm:
  adv_estimator: grpo
  filter_groups: {enable: true, metric: acc, max_num_gen_batches: 10}
actor_rollout_ref: {rollout: {n: 4}}
reward_model:
  reward_manager: dapo
  reward_kwargs: {overlong_buffer_cfg: {enable: true, len: 4, penalty_factor: 0.5, log: false}}
"""
    result = convert(text, "verl")
    ours = schema_defaults()
    for key, target, value in (("algorithm.filter_groups.enable", "algorithm.dynamic_sampling", True),
                               ("reward_model.reward_kwargs.overlong_buffer_cfg.len",
                                "algorithm.overlong_buffer_len", 4),
                               ("reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
                                "algorithm.overlong_penalty_factor", 0.5)):
        if target in ours:
            assert result.values[target] == value and result.entries[key].status == "mapped"
        else:
            assert result.entries[key].status == "unsupported" and result.entries[key].flagged
    assert result.entries["algorithm.filter_groups.max_num_gen_batches"].flagged  # different unit: not converted


def test_credentials_are_never_copied():
    result = _convert("roll_grpo")
    assert "SECRET" not in result.yaml
    assert result.entries["tracker_kwargs.api_key"].flagged


def test_reserved_sampling_options_are_refused_by_the_converter_too():
    result = convert("actor_infer:\n  generating_args:\n    stop_strings: ['</s>']\n    repetition_penalty: 1.1\n",
                     "roll")
    assert result.problems == []
    for key in ("actor_infer.generating_args.stop_strings", "actor_infer.generating_args.repetition_penalty"):
        assert result.entries[key].status == "unsupported" and result.entries[key].flagged


def test_invalid_conversion_reports_the_problem(tmp_path, capsys):
    src = tmp_path / "grpo_n1.yaml"
    src.write_text("algorithm:\n  adv_estimator: grpo\n")  # verl's default rollout.n is 1: no group baseline
    assert main(["convert", "--from", "verl", str(src)]) == 1
    report = (tmp_path / "grpo_n1.asyncppo.report.md").read_text()
    assert "does not validate" in report and "num_return_sequences_in_group" in report


def test_bad_input_is_a_clear_usage_error(tmp_path, capsys):
    src = tmp_path / "list.yaml"
    src.write_text("- a\n- b\n")
    assert main(["convert", "--from", "rlinf", str(src)]) == 2
    assert "expected a mapping" in capsys.readouterr().err
    assert main(["convert", "--from", "rlinf", str(tmp_path / "missing.yaml")]) == 2


def test_cli_convert_then_dry_run_launch_in_a_fresh_process(tmp_path):
    out = tmp_path / "run.yaml"
    cmd = [sys.executable, "-m", "asyncppo", "convert", "--from", "rlinf", str(INPUTS / "rlinf_grpo.yaml"),
           "-o", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "run.report.md").is_file()
    done = subprocess.run([sys.executable, "-m", "asyncppo", "launch", "--config-file", str(out), "--dry-run",
                           "rollout.max_staleness=3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = yaml.safe_load(done.stdout)  # the plan is printed as YAML comments
    assert shown["algorithm"]["off_policy_cap"] == 2.0
    assert shown["rollout"]["response_length"] == 1024
    assert shown["rollout"]["max_staleness"] == 3  # a KEY=VALUE override wins over the file
    assert shown["trainer"]["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_dry_run_launch_of_each_conversion(name, tmp_path, capsys):
    path = tmp_path / f"{name}.asyncppo.yaml"
    path.write_text(_convert(name).yaml)
    assert main(["launch", "--config-file", str(path), "--dry-run"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    for key, value in EXPECTED[name].items():
        node = shown
        for part in key.split("."):
            node = node[part]
        if key.startswith("algorithm.clip_ratio_") and value is None:
            value = shown["algorithm"]["pg_clip"]  # derived default filled after validation
        assert node == value, key


def _quiet_load(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(*args, **kwargs)


def test_config_file_layering(tmp_path):
    f = tmp_path / "f.yaml"
    f.write_text("algorithm:\n  adv_estimator: rloo\n  lambd: 0.9\nrollout:\n  response_length: 12\n")
    cfg = _quiet_load([], config_file=f)
    # no preset unless named: schema defaults under the file (the ppo preset would set whiten_advantages too)
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.lambd, cfg.rollout.response_length) == ("rloo", 0.9, 12)
    assert cfg.rollout.prompt_length == 64  # schema default, not the addition preset's 16
    # a named preset goes under the file; KEY=VALUE goes over it
    cfg = _quiet_load(["algorithm=grpo", "algorithm.lambd=0.5", "data=addition"], config_file=f)
    assert cfg.algorithm.adv_estimator == "rloo" and cfg.algorithm.lambd == 0.5
    assert cfg.algorithm.use_kl_loss is True  # from the grpo preset, which the file does not touch
    assert cfg.rollout.prompt_length == 16 and cfg.rollout.response_length == 12


def test_config_file_round_trips_a_dry_run_dump(tmp_path):
    cfg = _quiet_load(["algorithm=grpo", "algorithm.pg_clip=0.3", "trainer.output_dir=runs/x"])
    f = tmp_path / "dump.yaml"
    f.write_text(config_to_yaml(cfg))
    assert _quiet_load([], config_file=f) == cfg


def test_config_file_errors_name_the_key(tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text("algorithm:\n  lamda: 0.9\n")
    with pytest.raises(ConfigError, match="did you mean 'algorithm.lambd'"):
        load_config([], config_file=f)
    f.write_text("defaults: [asyncppo_schema]\n")
    with pytest.raises(ConfigError, match="--config-dir"):
        load_config([], config_file=f)
    with pytest.raises(ConfigError, match="no such file"):
        load_config([], config_file=tmp_path / "nope.yaml")
