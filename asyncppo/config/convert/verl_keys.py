"""verl's keys as the converter knows them: prefixes, the defaults that matter, and the keys without an asyncppo
equivalent. Data only (read from verl main b178a3c, 2026-01-29, ``_generated_ppo_trainer.yaml``); the rules that
use it are in :mod:`asyncppo.config.convert.verl`.
"""

from __future__ import annotations

from asyncppo.config.convert.engine import Context
from asyncppo.config.convert.rules import as_bool

VERSION = "verl main b178a3c (2026-01-29)"
A, R, M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
RC = "algorithm.rollout_correction."
FA = "async_training."

DEFAULTS = {
    "algorithm.adv_estimator": "gae", "algorithm.gamma": 1.0, "algorithm.lam": 1.0,
    "algorithm.norm_adv_by_std_in_grpo": True, "algorithm.use_kl_in_reward": False, "algorithm.kl_penalty": "kl",
    "algorithm.kl_ctrl.type": "fixed", "algorithm.kl_ctrl.kl_coef": 0.001, "algorithm.kl_ctrl.horizon": 10000,
    "algorithm.kl_ctrl.target_kl": 0.1, "algorithm.use_pf_ppo": False,
    RC + "rollout_is": None, RC + "rollout_is_threshold": 2.0, RC + "rollout_rs": None,
    RC + "rollout_rs_threshold": None, RC + "bypass_mode": False, RC + "loss_type": "ppo_clip",
    RC + "rollout_is_batch_normalize": False,
    A + "clip_ratio": 0.2, A + "clip_ratio_low": 0.2, A + "clip_ratio_high": 0.2, A + "clip_ratio_c": 3.0,
    A + "loss_agg_mode": "token-mean", A + "loss_scale_factor": None, A + "entropy_coeff": 0,
    A + "calculate_entropy": False, A + "use_kl_loss": False, A + "kl_loss_coef": 0.001,
    A + "kl_loss_type": "low_var_kl", A + "ppo_epochs": 1, A + "ppo_mini_batch_size": 256,
    A + "ppo_micro_batch_size": None, A + "ppo_micro_batch_size_per_gpu": None, A + "use_dynamic_bsz": False,
    A + "ppo_max_token_len_per_gpu": 16384, A + "policy_loss.loss_mode": "vanilla", A + "grad_clip": 1.0,
    A + "shuffle": False, A + "optim.lr": 1e-6, A + "optim.weight_decay": 0.01, A + "optim.betas": [0.9, 0.999],
    A + "optim.lr_warmup_steps": -1, A + "optim.lr_warmup_steps_ratio": 0.0, A + "optim.clip_grad": 1.0,
    A + "optim.lr_scheduler_type": "constant", A + "optim.warmup_style": None, A + "optim.min_lr_ratio": 0.0,
    A + "optim.optimizer": "AdamW",
    "critic.optim.lr": 1e-5, "critic.cliprange_value": 0.5, "critic.enable": None,
    R + "temperature": 1.0, R + "top_k": -1, R + "top_p": 1, R + "n": 1, R + "dtype": "bfloat16",
    R + "gpu_memory_utilization": 0.5, R + "enforce_eager": False, R + "max_num_seqs": 256, R + "do_sample": True,
    R + "checkpoint_engine.update_weights_bucket_megabytes": 2048, R + "mode": "async",
    M + "enable_gradient_checkpointing": True, M + "trust_remote_code": False,
    "data.max_prompt_length": 512, "data.max_response_length": 512, "data.train_batch_size": 1024,
    "data.prompt_key": "prompt", "data.shuffle": True, "data.seed": None, "data.truncation": "error",
    "data.filter_overlong_prompts": False, "data.return_raw_chat": True,
    "trainer.total_epochs": 30, "trainer.total_training_steps": None, "trainer.logger": ["console", "wandb"],
    "trainer.save_freq": -1, "trainer.test_freq": -1, "trainer.val_before_train": True, "trainer.critic_warmup": 0,
    "trainer.resume_mode": "auto", "trainer.resume_from_path": None, "trainer.max_actor_ckpt_to_keep": None,
    "trainer.nnodes": 1, "trainer.n_gpus_per_node": 8, "trainer.balance_batch": True, "trainer.val_only": False,
    "custom_reward_function.path": None, "custom_reward_function.name": "compute_score",
    "reward_manager.source": "register", "reward_manager.name": "naive", "reward_model.reward_manager": "naive",
    "reward_manager.module.name": "custom_reward_manager", "data.train_max_samples": -1, "data.val_max_samples": -1,
    "data.return_raw_chat": True, R + "checkpoint_engine.backend": "naive", M + "lora_alpha": 16,
    M + "target_modules": "all-linear", "critic.model.lora_alpha": 16, "critic.model.target_modules": "all-linear",
    "critic.model.enable_gradient_checkpointing": True, "critic.ppo_mini_batch_size": 256, "critic.ppo_epochs": 1,
    "critic.data_loader_seed": 42, "critic.loss_agg_mode": "token-mean", "critic.grad_clip": 1.0,
    "critic.checkpoint.save_contents": ["model", "optimizer", "extra"],
    "critic.checkpoint.load_contents": ["model", "optimizer", "extra"],
    FA + "staleness_threshold": 0.1, FA + "trigger_parameter_sync_step": 4, FA + "partial_rollout": True,
}

# the optimiser block is the same dataclass for the actor and the critic
for _role in (A, "critic."):
    DEFAULTS.update({_role + "optim." + k: v for k, v in {
        "optimizer": "AdamW", "optimizer_impl": "torch.optim", "total_training_steps": -1, "weight_decay": 0.01,
        "lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.0, "betas": [0.9, 0.999], "clip_grad": 1.0,
        "min_lr_ratio": 0.0, "num_cycles": 0.5, "lr_scheduler_type": "constant", "warmup_style": None,
        "override_optimizer_config": None}.items()})

_PLACEMENT = ("placement is set with --rollout-gpus / --train-gpus (asyncppo keeps rollout and training on "
              "separate devices)")
_PERF = "memory/speed setting of verl's engines; no asyncppo equivalent and no effect on what is learned"


def _uses_critic(ctx: Context) -> bool:
    return ctx.get("algorithm.adv_estimator") == "gae" or as_bool(ctx.get("critic.enable"))

IGNORED = [
    ("*_target_", "verl's dataclass marker", False),
    ("*.rollout_n", "derived in verl from rollout.n", False),
    (R + "prompt_length", "derived in verl from data.max_prompt_length", False),
    (R + "response_length", "derived in verl from data.max_response_length", False),
    ("*router_replay.*", "MoE routing replay is not supported", True),
    ("*mtp.*", "multi-token prediction / speculative decoding is not supported", True, M + "mtp.enable"),
    ("*tiled_mlp.*", _PERF, False), ("*prometheus.*", "no Prometheus export", False),
    (R + "trace.*", "no rollout tracing", False), ("*lora_*", "of LoRA, model.lora_rank / lora_alpha / target_modules are mapped", True),
    (M + "exclude_modules", "LoRA targets are named by model.lora_target_modules only", True),
    ("*.use_shm", _PERF, False), ("*use_liger", _PERF, False),
    ("*enable_activation_offload", _PERF, False), (M + "fused_kernel_options.*", _PERF, False),
    (M + "override_config", "model config overrides are not supported", True),
    (M + "external_lib", "custom model code: see model.trust_remote_code", True),
    (M + "custom_chat_template", "the tokenizer's own chat template is used", True),
    (M + "tokenizer_path", "the tokenizer is the one in model.path", True), (M + "hf_config_path", _PERF, False),
    ("actor_rollout_ref.nccl_timeout", "cluster.timeout_s bounds start-up waits", False),
    ("actor_rollout_ref.hybrid_engine", _PERF, False), (A + "use_prefix_grouper", _PERF, False),
    (A + "calculate_sum_pi_squared", _PERF, False), (A + "sum_pi_squared_checkpointing", _PERF, False),
    (A + "data_loader_seed", "mini-batches are taken in arrival order", False),
    (A + "shuffle", "mini-batches are taken in arrival order", True), (A + "freeze_vision_tower", "text models only",
     True), (A + "tau_pos", "parameter of verl's sapo loss", False), (A + "tau_neg", "parameter of verl's sapo loss",
     False), (R + "expert_parallel_size", _PERF, False), (R + "pipeline_model_parallel_size", _PERF, False),
    (R + "max_model_len", _PERF, False), (R + "cudagraph_capture_sizes", _PERF, False),
    (R + "disable_log_stats", _PERF, False), (R + "layered_summon", _PERF, False),
    (R + "multi_stage_wake_up", _PERF, False), (R + "skip_tokenizer_init", _PERF, False),
    (R + "scheduling_policy", _PERF, False), (R + "calculate_log_probs", "asyncppo engines always return "
     "log-probs", False), (R + "logprobs_mode", "log-probs are of the processed (temperature-scaled) logits", False),
    (R + "skip_*", "debug switch", False), (R + "quantization*", "quantised rollouts are not supported", True),
    (R + "ignore_eos", "generation always stops at eos", True), (R + "over_sample_rate", "no over-sampling", True),
    (R + "enable_rollout_routing_replay", "MoE routing replay is not supported", True),
    ("data.*_key", "multi-modal / routing column names are not used", False),
    ("data.return_*", "dataset output options of verl", False), ("data.apply_chat_template_kwargs", "the template "
     "is applied without extra arguments", True), ("data.custom_cls.*", "custom dataset classes are not supported",
     True), ("data.datagen.*", "dynamic data generation is not supported", True),
    ("data.sampler.*", "custom samplers are not supported", True), ("data.*max_samples", "all records are used",
     True), ("data.val_batch_size", _PERF, False), ("data.validation_shuffle", "no effect on training", False),
    ("data.filter_overlong_prompts_workers", _PERF, False), ("data.image_patch_size", "text models only", False),
    ("data.trust_remote_code", "see model.trust_remote_code", False), ("data.use_shm", _PERF, False),
    ("data.tool_config_path", "tool calls are not supported", True),
    ("trainer.max_critic_ckpt_to_keep", "the critic is saved with the policy", False),
    ("trainer.del_local_ckpt_after_load", _PERF, False), ("trainer.esi_redundant_time", _PERF, False),
    ("trainer.ray_wait_register_center_timeout", "cluster.timeout_s bounds start-up waits", False),
    ("trainer.use_legacy_worker_impl", _PERF, False),
    (A + "optim.optimizer_impl", _PERF, False), (A + "optim.total_training_steps", "derived in verl", False),
    (A + "optim.num_cycles", "cosine schedule only", False), (A + "optim.override_optimizer_config", "optimiser "
     "overrides are not supported", True),
    ("hydra.*", "Hydra run settings", False),
    ("defaults", "Hydra defaults list: only this file's values are read; "
     "keys it leaves unset take verl's defaults", False),
    ("*.profiler.*", _PERF, False),
    ("global_profiler.*", _PERF, False),
    ("*fsdp_config.*", _PERF, False),
    ("*megatron.*", _PERF, False),
    ("*ulysses_sequence_parallel_size", _PERF, False),
    ("*use_remove_padding", _PERF, False),
    ("*use_torch_compile", _PERF, False),
    ("*use_fused_kernels", _PERF, False),
    ("*entropy_from_logits_with_chunking",
     _PERF, False),
    ("*entropy_checkpointing", _PERF, False),
    ("*log_prob_*", _PERF, False),
    ("*strategy", _PERF, False),
    (R + "tensor_model_parallel_size", _PLACEMENT, False),
    (R + "data_parallel_size", _PLACEMENT, False),
    (R + "max_num_batched_tokens", _PERF, False),
    (R + "enable_chunked_prefill", _PERF, False),
    (R + "enable_prefix_caching", _PERF, False),
    (R + "free_cache_engine", _PERF, False),
    (R + "load_format", _PERF, False),
    (R + "engine_kwargs.*", _PERF, False),
    (R + "agent.*", "agent loop (multi-turn, tools): not supported", True, R + "multi_turn.enable"),
    (R + "multi_turn.*", "multi-turn rollouts are not supported", True, R + "multi_turn.enable"),
    (R + "val_kwargs.*", "asyncppo evaluates "
     "with the training sampling settings", False),
    ("trainer.nnodes", _PLACEMENT, False),
    ("trainer.n_gpus_per_node", _PLACEMENT, False),
    ("trainer.device", _PLACEMENT, False),
    ("ray_kwargs.*", _PLACEMENT, False),
    ("reward_model.*", "asyncppo has no model-based reward; use rollout.reward_fn", True, "reward_model.enable"),
    ("reward_manager.*", "asyncppo calls rollout.reward_fn per sample", True),
    ("critic.*micro_batch_size*", _PERF, False),
    ("critic.*max_token_len*", _PERF, False),
    ("critic.use_dynamic_bsz", _PERF, False),
    ("critic.model.*", "the critic is a value head on a copy of the policy (or model.critic_path)", True,
     _uses_critic),
    ("critic.*", "critic options without an asyncppo equivalent", True, _uses_critic),
    ("data.tokenizer", "the tokenizer is the one in model.path", True),
    ("data.dataloader_num_workers", _PERF, False),
    ("transfer_queue.*", _PERF, False),
    (A + "checkpoint.*", "checkpoints always hold model, optimiser and state", False),
    ("trainer.default_hdfs_dir", "no HDFS upload", True),
    ("trainer.rollout_data_dir", "not supported", True),
    ("trainer.validation_data_dir", "not supported", True),
    ("trainer.log_val_generations", "not supported", True),
]
