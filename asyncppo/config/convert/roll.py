"""ROLL (alibaba/ROLL) RLVR pipeline config -> asyncppo.

Checked against ROLL main at commit 8eb27cc (2026-08-19): ``roll/configs/base_config.py`` (``BaseConfig``,
``PPOConfig``, ``TrainInferCorrectionConfig``), ``roll/configs/worker_config.py``, ``generating_args.py``,
``training_args.py``, ``model_args.py``, ``data_args.py``, ``roll/pipeline/rlvr/rlvr_config.py`` and the loss and
reward code in ``roll/pipeline/rlvr/actor_worker.py`` and ``roll/utils/functionals.py``.

Facts that shape the rules below:
* reward normalisation is ``norm_mean_type`` / ``norm_std_type`` (``reward_shift`` / ``reward_scale`` are gone) and
  ``adv_estimator: grpo`` forces both to ``group``; ``reward_clip`` is applied *after* normalisation;
* ``kl_penalty`` is the in-reward estimator only; the KL loss is always k3;
* dual clip bounds the loss at ``(1 + 2 * pg_clip) * A``, there is no separate constant;
* ``pg_clip_low`` / ``pg_clip_high`` act only with ``use_pg_clip_range: true``;
* the response length is ``sequence_length - prompt_length`` (``response_length`` is folded into it);
* defaults that differ from asyncppo's: ``lambd`` 0.95, ``value_clip`` null, ``init_kl_coef`` 0.2,
  ``kl_loss_coef`` 0, ``loss_agg_mode`` seq-mean-token-mean, ``whiten_advantages`` false, LR schedule linear.
"""

from __future__ import annotations

import math
import re

from asyncppo.config.convert.engine import Context
from asyncppo.config.convert.rules import NO_PENALTY, NO_STOP, as_bool, as_int, as_str_list, choose, only

VERSION = "ROLL main 8eb27cc (2026-08-19)"
TR, INF, GEN = "actor_train.", "actor_infer.", "actor_infer.generating_args."
TA = TR + "training_args."
TIC = "train_infer_correction."

DEFAULTS = {
    "seed": 42, "rpc_timeout": 3600, "output_dir": "./output", "track_with": "tensorboard", "max_steps": 500,
    "save_steps": 50, "max_ckpt_to_keep": 0, "logging_steps": 1, "eval_steps": 10, "rollout_batch_size": 128,
    "prompt_length": 1024, "response_length": None, "sequence_length": None, "resume_from_checkpoint": False,
    "model_update_buffer_size_mb": 1024, "async_generation_ratio": 0, "ppo_epochs": 1, "max_grad_norm": 1.0,
    "l2": 0.0, "lambd": 0.95, "gamma": 1, "pg_clip": 0.2, "use_pg_clip_range": False, "pg_clip_low": 0.2,
    "pg_clip_high": 0.2, "value_clip": None, "kl_penalty": "kl", "target_kl": None, "init_kl_coef": 0.2,
    "kl_horizon": 10000, "use_reward_scaling": False, "use_reward_norm": False, "reward_clip": None,
    "whiten_rewards": False, "whiten_advantages": False, "advantage_clip": None, "adv_estimator": "gae",
    "norm_mean_type": None, "norm_std_type": None, "add_token_level_kl": False, "critic_warmup": 0,
    "use_kl_loss": False, "kl_loss_coef": 0, "entropy_loss_coef": 0, "loss_agg_mode": "seq-mean-token-mean",
    "dual_clip_loss": False, "num_return_sequences_in_group": 1, "enable_reference": False,
    TIC + "is_weight.enabled": False, TIC + "is_weight.weight_type": "token", TIC + "is_weight.upper_bound": 1.2,
    TIC + "is_weight.detach": True, TIC + "filters": [],
    TR + "model_update_frequency": 1, TR + "use_dynamic_batching_in_train": False,
    # RLVRConfig (roll/pipeline/rlvr/rlvr_config.py)
    "max_len_mask": False, "difficulty_mask": False, "difficulty_low_threshold": 0.0,
    "difficulty_high_threshold": 1.0, "error_max_len_clip": False, "difficulty_loss_weight": False,
    "length_loss_weight": False, "use_policy_loss_type": "PPO", "use_topr_loss": False, "rl_loss_coef": 1.0,
    "importance_sampling": "token", "val_greedy": False, "val_n_sample": 1, "mask_type": "loss",
    "balance_length": False, "minibatch_data_iter_num": 1,
    TA + "learning_rate": 5e-5, TA + "lr_scheduler_type": "linear", TA + "weight_decay": 0.0,
    TA + "adam_beta1": 0.9, TA + "adam_beta2": 0.999, TA + "per_device_train_batch_size": 8,
    TA + "gradient_accumulation_steps": 1, TA + "warmup_steps": 0, TA + "warmup_ratio": 0.0,
    "critic.training_args.learning_rate": 5e-5,
}

_PERF = "memory/speed setting of ROLL's workers; no asyncppo equivalent and no effect on what is learned"
_PLACE = "placement is set with --rollout-gpus / --train-gpus"
IGNORED = [
    ("difficulty_mask", "groups are not masked by mean score (see algorithm.dynamic_sampling)", True),
    ("difficulty_*_threshold", "groups are not masked by mean score", True, "difficulty_mask"),
    ("error_max_len_*", "no length-error clipping", True), ("*_loss_weight", "no per-sample loss weights", True),
    ("use_policy_loss_type", "the policy loss is algorithm.policy_loss", True), ("use_topr*", "TOPR is not "
     "supported", True), ("postive_loss_coef", "TOPR is not supported", True), ("rl_loss_coef", "no loss scale", True),
    ("importance_sampling", "per-token ratios (see algorithm.off_policy_level)", True),
    ("val_greedy", "evaluation scores one greedy answer per prompt", False), ("val_n_sample", "see data.eval_samples",
     False), ("mask_type", "ROLL's masking scope", True), ("balance_length", _PERF, False),
    ("minibatch_data_iter_num", "no mini-batch repetition (see algorithm.ppo_epochs)", True),
    ("global_template", "the tokenizer's chat template is used", True), ("tag_to_template", "the tokenizer's chat "
     "template is used", True), ("dataset_filter.*", "no difficulty-based dataset filter", True),
    ("save_logging_board_dir", "logs go to trainer.output_dir", False),
    ("hydra.*", "Hydra run settings", False),
    ("defaults", "Hydra defaults list: only this file's values are read", False),
    ("*.strategy_args.*", _PERF, False),
    ("*.device_mapping", _PLACE, False),
    ("*.world_size", _PLACE, False),
    ("*.num_gpus_per_worker", _PLACE, False),
    ("num_gpus_per_node", _PLACE, False),
    ("num_nodes", _PLACE, False),
    ("*.infer_batch_size", _PERF, False),
    ("*.worker_cls", "ROLL worker class", True),
    ("*.offload_nccl", _PERF, False),
    ("*.use_dynamic_batching_in_infer", _PERF, False),
    ("*.max_tokens_per_microbatch_in_infer", _PERF, False),
    ("*.sequence_length_round_in_*", _PERF, False),
    ("*.use_sequence_packing", _PERF, False),
    ("*.sequence_packing_args.*", _PERF, False),
    ("*.system_envs.*", _PERF, False),
    ("system_envs.*", _PERF, False),
    ("*.model_args.attn_implementation", _PERF, False),
    ("*.model_args.model_type", _PERF, False),
    ("*.training_args.dataloader_num_workers", _PERF, False),
    ("*.data_args.preprocessing_num_workers", _PERF, False),
    ("*.training_args.num_train_epochs", "ROLL's pipeline runs max_steps", False),
    ("logging_dir", "asyncppo logs into trainer.output_dir", False),
    ("base_dir", "asyncppo writes trainer.output_dir", False),
    ("checkpoint_config.*", "checkpoints go to <output_dir>/checkpoints", False),
    ("profiler_*", _PERF, False),
    ("length_profiler_dir", _PERF, False),
    ("otlp_output_dir", _PERF, False),
    ("is_offload_*", _PERF, False),
    ("max_running_requests", _PERF, False),
    ("val_batch_size", _PERF, False),
    ("rewards.*", "ROLL's reward workers: asyncppo calls rollout.reward_fn per sample", True),
    ("reward.*", "reward worker settings", True),
    ("reward_pretrain", "asyncppo has no reward model", True),
    ("reference.*", "the reference is model.ref_path (default: the initial policy)", True),
    ("validation.*", "asyncppo evaluates with the training sampling settings", True),
    ("critic.*", "critic option without an asyncppo equivalent", True),
    ("*.lora_*", "LoRA is not supported", True),
    ("*.data_args.*", "data option without an asyncppo equivalent", True),
    ("*.model_args.*", "model option without an asyncppo equivalent", True),
    ("*.training_args.*", "optimiser option without an asyncppo equivalent", True),
    ("*.generating_args.*", "sampling option without an asyncppo equivalent", True),
]


def convert(ctx: Context) -> None:
    _algorithm(ctx)
    _rewards(ctx)
    _losses(ctx)
    _rollout(ctx)
    _training(ctx)
    _run(ctx)


def _algorithm(ctx: Context) -> None:
    adv = ctx.get("adv_estimator")
    ctx.map("adv_estimator", "algorithm.adv_estimator",
            choose({"gae": "gae", "grpo": "grpo", "reinforce": "reinforce"}))
    if adv == "grpo":
        ctx.consumed("adv_estimator", "mapped", "ROLL's grpo forces norm_mean_type = norm_std_type = group and "
                     "takes discounted returns of those rewards: asyncppo's grpo with gamma = 1",
                     ["algorithm.adv_estimator"], flag=False)
    ctx.map("gamma", "algorithm.gamma", float)
    ctx.map("lambd", "algorithm.lambd", float)
    ctx.map("whiten_advantages", "algorithm.whiten_advantages", as_bool)
    ctx.map("advantage_clip", "algorithm.advantage_clip", lambda v: None if v is None else float(v))
    ctx.map("max_len_mask", "algorithm.mask_truncated", as_bool)
    ctx.unsupported("whiten_rewards", "token-level reward whitening is not supported")
    ctx.unsupported("critic_warmup", "the critic and the policy always train together")
    names = {v: v for v in ("ppo", "cispo") if v in ctx.choices("POLICY_LOSSES")}
    for key in ("pg_variant", TR + "pg_variant"):
        if ctx.get(key) is not None:
            ctx.map(key, "algorithm.policy_loss", choose(names))
    ctx.map("ppo_epochs", "algorithm.ppo_epochs", as_int)


def _rewards(ctx: Context) -> None:
    mean, std = ctx.get("norm_mean_type"), ctx.get("norm_std_type")
    srcs = ["norm_mean_type", "norm_std_type"]
    if ctx.get("adv_estimator") == "grpo":  # forced to group/group; asyncppo's grpo does it itself
        for k in srcs:
            ctx.consumed(k, "mapped" if ctx.get(k) == "group" else "unsupported",
                         "ROLL's grpo overrides it with group", ["algorithm.adv_estimator"],
                         flag=ctx.get(k) not in (None, "group"))
    elif mean is None and std is None:
        ctx.set("algorithm.reward_norm", None, srcs)
    elif mean is not None and std is not None and mean != std:
        ctx.set("algorithm.reward_norm", mean, srcs, "approximate",
                f"ROLL subtracts the {mean} mean and divides by the {std} std; asyncppo uses one kind for both")
    else:
        ctx.set("algorithm.reward_norm", mean or std, srcs)
        ctx.set("algorithm.reward_shift", std is None, srcs)
        ctx.set("algorithm.reward_scale", mean is None, srcs)
    ctx.map("reward_clip", "algorithm.reward_clip", lambda v: None if v is None else float(v),
            why="ROLL clips after normalising the rewards; asyncppo clips before")
    for k in ("use_reward_scaling", "use_reward_norm", "reward_shift", "reward_scale", "reward_norm"):
        ctx.unsupported(k, "no longer read by ROLL (reward normalisation is norm_mean_type / norm_std_type)")
    ctx.unsupported("add_len_reward", "length reward is not supported")


def _losses(ctx: Context) -> None:
    ctx.map("pg_clip", "algorithm.pg_clip", float)
    if as_bool(ctx.get("use_pg_clip_range")):
        ctx.map("pg_clip_low", "algorithm.clip_ratio_low", float)
        ctx.map("pg_clip_high", "algorithm.clip_ratio_high", float)
        ctx.consumed("use_pg_clip_range", "mapped", "", ["algorithm.clip_ratio_low", "algorithm.clip_ratio_high"])
    else:
        ctx.consumed("use_pg_clip_range", "mapped", "off: pg_clip on both sides", ["algorithm.pg_clip"])
        for k in ("pg_clip_low", "pg_clip_high"):
            ctx.consumed(k, "unsupported", "no effect in ROLL while use_pg_clip_range is false", flag=False)
    dual = as_bool(ctx.get("dual_clip_loss"))
    ctx.map("dual_clip_loss", "algorithm.dual_clip_loss", as_bool)
    if dual:
        ctx.set("algorithm.clip_ratio_c", 1.0 + 2.0 * float(ctx.get("pg_clip")), "dual_clip_loss",
                why="ROLL's dual-clip bound is 1 + 2 * pg_clip")
    ctx.map("value_clip", "algorithm.value_clip", lambda v: None if v is None else float(v))
    ctx.map("entropy_loss_coef", "algorithm.entropy_coef", float)
    ctx.map("loss_agg_mode", "algorithm.loss_agg_mode", choose({m: m for m in (
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")}))
    ctx.map("use_kl_loss", "algorithm.use_kl_loss", as_bool)
    ctx.map("kl_loss_coef", "algorithm.kl_loss_coef", float)
    ctx.map("add_token_level_kl", "algorithm.add_token_level_kl", as_bool)
    # kl_penalty is only the in-reward estimator; ROLL's KL loss is always k3.
    use_loss, in_reward = as_bool(ctx.get("use_kl_loss")), as_bool(ctx.get("add_token_level_kl"))
    est = {"kl": "kl", "abs": "abs", "mse": "mse", "full": "full", "k3": "k3"}
    if in_reward:
        why = ("" if not use_loss or ctx.get("kl_penalty") == "k3" else
               "ROLL's KL loss is always k3; asyncppo uses this one estimator for both KL terms")
        ctx.map("kl_penalty", "algorithm.kl_penalty", choose(est), why=why)
    else:
        ctx.consumed("kl_penalty", "unsupported", "in-reward KL off: no effect (the KL loss is always k3)", flag=False)
        if use_loss:
            ctx.set("algorithm.kl_penalty", "k3", "use_kl_loss", why="ROLL's KL loss is fixed to k3")
    ctx.map("init_kl_coef", "algorithm.kl_ctrl.init_kl_coef", float, carry_default=in_reward)
    target = ctx.get("target_kl")
    ctx.set("algorithm.kl_ctrl.type", "fixed" if target is None else "adaptive", "target_kl")
    if target is not None:
        ctx.map("target_kl", "algorithm.kl_ctrl.target_kl", float)
    ctx.map("kl_horizon", "algorithm.kl_ctrl.kl_horizon", as_int)
    # off-policy correction
    if as_bool(ctx.get(TIC + "is_weight.enabled")):
        wt = ctx.get(TIC + "is_weight.weight_type")
        ctx.set("algorithm.off_policy_correction", "decoupled", TIC + "is_weight.enabled",
                "mapped" if wt == "token" else "approximate",
                "" if wt == "token" else f"weight_type={wt!r}: asyncppo's behaviour weight is per token")
        ctx.map(TIC + "is_weight.upper_bound", "algorithm.off_policy_cap", float)
        ctx.consumed(TIC + "is_weight.weight_type", "mapped" if wt == "token" else "approximate", "",
                     ["algorithm.off_policy_correction"])
    else:
        ctx.set("algorithm.off_policy_correction", "none", TIC + "is_weight.enabled",
                why="ROLL without train-infer IS weights")
    ctx.unsupported(TIC + "filters*", "ratio/diff filters (masking) are not supported")
    ctx.unsupported(TIC + "is_weight.*", "the weight is always detached")
    ctx.unsupported("enable_old_logprobs_recompute", "with a correction on, asyncppo always recomputes")
    ctx.unsupported("force_disable_old_logprobs_recompute", "with a correction on, asyncppo always recomputes")


def _rollout(ctx: Context) -> None:
    ctx.map("rollout_batch_size", "rollout.rollout_batch_size", as_int)
    ctx.map("num_return_sequences_in_group", "rollout.num_return_sequences_in_group", as_int)
    ctx.consumed(GEN + "num_return_sequences", "mapped", "ROLL overwrites it with num_return_sequences_in_group",
                 ["rollout.num_return_sequences_in_group"])
    ctx.map("prompt_length", "rollout.prompt_length", as_int)
    prompt = as_int(ctx.get("prompt_length"))
    seq, resp = ctx.get("sequence_length"), ctx.get("response_length")
    if seq is not None or resp is not None:
        total = as_int(seq) if seq is not None else prompt + as_int(resp)
        ctx.set("rollout.response_length", total - prompt, [k for k in ("sequence_length", "response_length")
                                                            if ctx.has(k)] or "sequence_length")
    ctx.consumed(GEN + "max_new_tokens", "mapped", "ROLL overwrites it with sequence_length - prompt_length",
                 ["rollout.response_length"])
    ctx.map(GEN + "temperature", "rollout.sampling.temperature", float)
    ctx.map(GEN + "temperature", "algorithm.temperature", float)
    ctx.map(GEN + "top_p", "rollout.sampling.top_p", float)
    ctx.map(GEN + "top_k", "rollout.sampling.top_k", lambda v: -1 if v in (None, 0) else as_int(v))
    ctx.map(GEN + "repetition_penalty", "rollout.sampling.repetition_penalty", only(1.0, NO_PENALTY, float))
    ctx.map(GEN + "stop_strings", "rollout.sampling.stop", only([], NO_STOP, as_str_list))
    if ctx.has(GEN + "num_beams") and as_int(ctx.get(GEN + "num_beams")) != 1:
        ctx.consumed(GEN + "num_beams", "unsupported", "beam search is not supported")
    ctx.consumed(GEN + "num_beams", "mapped", "1: sampling", [])
    ctx.consumed(GEN + "do_sample", "mapped" if as_bool(ctx.get(GEN + "do_sample", True)) else "unsupported",
                 "asyncppo always samples", [])
    ctx.map(INF + "strategy_args.strategy_name", "rollout.engine", choose({"vllm": "vllm", "hf_infer": "hf"}))
    cfg = INF + "strategy_args.strategy_config."
    ctx.map(cfg + "gpu_memory_utilization", "rollout.gpu_memory_utilization", float)
    ctx.map(cfg + "enforce_eager", "rollout.enforce_eager", as_bool)
    ctx.map(cfg + "max_num_seqs", "rollout.max_num_seqs", as_int)
    ctx.map(INF + "model_args.dtype", "rollout.dtype", choose({"bf16": "bfloat16", "fp16": "float16",
                                                              "fp32": "float32"}))
    ctx.map("model_update_buffer_size_mb", "rollout.weight_bucket_mb", as_int, carry_default=False)
    ctx.map(TR + "model_update_frequency", "rollout.sync_every", as_int)
    ratio = float(ctx.get("async_generation_ratio") or 0)
    sync = as_int(ctx.get(TR + "model_update_frequency") or 1)
    ctx.set("rollout.max_staleness", max(math.ceil(ratio), sync - 1), "async_generation_ratio",
            "approximate" if ratio else "mapped", "ROLL generates this fraction of a batch ahead and aborts "
            "older groups; asyncppo bounds each sample's lag in versions (ceil of the ratio)" if ratio else
            "ROLL's pipeline is synchronous unless async_generation_ratio > 0; raise rollout.max_staleness to "
            "overlap generation with training")
    ctx.unsupported("is_use_additional_prompts", "dynamic sampling is not supported")
    ctx.unsupported("max_additional_running_prompts", "dynamic sampling is not supported")


def _training(ctx: Context) -> None:
    ctx.map("pretrain", "model.path", str, carry_default=False)
    ctx.map(TR + "model_args.model_name_or_path", "model.path", str, carry_default=False)
    ctx.map("critic.model_args.model_name_or_path", "model.critic_path", str, carry_default=False)
    ctx.map("reference.model_args.model_name_or_path", "model.ref_path", str, carry_default=False)
    ctx.map(TR + "model_args.dtype", "model.dtype", choose({"bf16": "bfloat16", "fp32": "float32"}))
    ctx.map(TR + "model_args.disable_gradient_checkpointing", "model.gradient_checkpointing", lambda v: not as_bool(v))
    ctx.map(TA + "learning_rate", "trainer.lr", float)
    ctx.map("critic.training_args.learning_rate", "trainer.critic_lr", float)
    ctx.map(TA + "weight_decay", "trainer.weight_decay", float)
    b1, b2 = ctx.get(TA + "adam_beta1"), ctx.get(TA + "adam_beta2")
    ctx.set("trainer.betas", [float(b1), float(b2)], [TA + "adam_beta1", TA + "adam_beta2"])
    ctx.map(TA + "warmup_steps", "trainer.warmup_steps", as_int)
    if ctx.has(TA + "warmup_ratio") and float(ctx.get(TA + "warmup_ratio")) > 0:
        steps = as_int(ctx.get("max_steps"))
        ctx.set("trainer.warmup_steps", round(float(ctx.get(TA + "warmup_ratio")) * steps), TA + "warmup_ratio",
                "approximate", f"ratio x max_steps ({steps})")
    ctx.map(TA + "lr_scheduler_type", "trainer.lr_schedule", choose({"constant": "constant", "linear": "linear"}))
    ctx.map("max_grad_norm", "trainer.grad_clip", float)
    ctx.unsupported("l2", "use trainer.weight_decay")
    per_dev = as_int(ctx.get(TA + "per_device_train_batch_size"))
    ctx.map(TA + "per_device_train_batch_size", "algorithm.micro_batch_size", as_int,
            why="ROLL counts per device; asyncppo's micro-batch is per learner rank")
    accum = as_int(ctx.get(TA + "gradient_accumulation_steps"))
    devices = _device_count(ctx.get(TR + "device_mapping"))
    group = as_int(ctx.get("num_return_sequences_in_group"))
    samples = per_dev * accum * (devices or 1)
    batch = as_int(ctx.get("rollout_batch_size"))
    why = ("per_device_train_batch_size x gradient_accumulation_steps x "
           f"{devices if devices else 'one (device_mapping not readable)'} train devices = {samples} samples per "
           f"optimiser step = {samples / group:g} prompts (tensor/pipeline parallel ranks not subtracted)")
    if samples % group == 0 and batch % (samples // group) == 0:
        ctx.set("algorithm.ppo_mini_batch_size", samples // group, [TA + "gradient_accumulation_steps",
                TA + "per_device_train_batch_size"], "approximate", why)
    else:
        ctx.consumed(TA + "gradient_accumulation_steps", "unsupported", why + ", which does not divide the "
                     "batch; the whole batch is one mini-batch", flag=True)
    if as_bool(ctx.get(TR + "use_dynamic_batching_in_train")):
        ctx.map(TR + "max_tokens_per_microbatch_in_train", "algorithm.max_tokens_per_micro_batch", as_int)
        ctx.consumed(TR + "use_dynamic_batching_in_train", "mapped", "", ["algorithm.max_tokens_per_micro_batch"])
    else:
        ctx.consumed(TR + "use_dynamic_batching_in_train", "mapped", "off", [])
        ctx.consumed(TR + "max_tokens_per_microbatch_in_train", "unsupported",
                     "no effect while use_dynamic_batching_in_train is false", flag=False)
    ctx.map(TR + "data_args.file_name", "data.train_files", as_str_list)
    ctx.map("validation.data_args.file_name", "data.eval_files", as_str_list)
    ctx.map(TR + "data_args.prompt", "data.prompt_key", str)
    if ctx.has(TR + "data_args.messages"):
        ctx.map(TR + "data_args.messages", "data.prompt_key", str,
                why="ROLL reads a list of chat messages; asyncppo reads one prompt string per record")
    ctx.map(TR + "data_args.response", "data.answer_key", str)
    if ctx.has(TR + "data_args.template"):
        ctx.set("data.apply_chat_template", True, TR + "data_args.template", "approximate",
                "ROLL applies its named template; asyncppo applies the tokenizer's own chat template")
    if any(k.startswith("rewards.") and k.endswith(".worker_cls") and "math" in str(v).lower()
           for k, v in ctx.values.items()):
        ctx.set("rollout.reward_fn", "math", [k for k in ctx.values if k.startswith("rewards.") and
                k.endswith(".worker_cls")], "approximate", "ROLL's math rule reward worker; asyncppo's math reward "
                "compares final numbers")


def _run(ctx: Context) -> None:
    ctx.map("seed", "trainer.seed", as_int)
    ctx.map("seed", "data.seed", as_int)
    ctx.map("max_steps", "trainer.total_steps", as_int)
    ctx.map("save_steps", "trainer.save_every", as_int)
    keep = as_int(ctx.get("max_ckpt_to_keep"))
    if keep > 0:
        ctx.map("max_ckpt_to_keep", "trainer.keep_checkpoints", as_int)
    else:
        ctx.consumed("max_ckpt_to_keep", "unsupported", "0 keeps every checkpoint in ROLL; asyncppo keeps the "
                     "newest trainer.keep_checkpoints", flag=True)
    ctx.map("eval_steps", "trainer.eval_every", as_int)
    ctx.map("logging_steps", "trainer.logger.log_every", as_int)
    ctx.map("output_dir", "trainer.output_dir", str, carry_default=False)
    ctx.map("rpc_timeout", "cluster.timeout_s", float, carry_default=False)
    track = ctx.get("track_with")
    if ctx.has("track_with"):
        ctx.set("trainer.logger.wandb", track == "wandb", "track_with")
        ctx.set("trainer.logger.console", track == "stdout" or ctx.ours["trainer.logger.console"], "track_with",
                "mapped" if track in ("wandb", "stdout") else "approximate",
                "" if track in ("wandb", "stdout") else f"tracker {track!r} is not supported; console and JSONL used")
    ctx.map("tracker_kwargs.project", "trainer.logger.wandb_project", str)
    ctx.map("tracker_kwargs.name", "trainer.logger.wandb_run_name", str)
    ctx.map("tracker_kwargs.mode", "trainer.logger.wandb_mode", choose({"offline": "offline", "online": "online",
                                                                        "disabled": "disabled"}))
    ctx.unsupported("tracker_kwargs.api_key", "credentials are never copied into a converted config")
    ctx.unsupported("tracker_kwargs.*", "tracker option without an asyncppo equivalent")
    ctx.unsupported("exp_name", "names ROLL's log and checkpoint folders; the wandb run name is tracker_kwargs.name")
    ctx.unsupported("resume_from_checkpoint", "a ROLL checkpoint cannot be loaded; export the actor to Hugging Face "
                    "format and set model.path")


def _device_count(mapping) -> int:
    """Devices of a ``device_mapping``: a list, or ROLL's ``list(range(a, b))`` string (parsed, never evaluated)."""
    if isinstance(mapping, list):
        return len(mapping)
    m = re.fullmatch(r"\s*list\(\s*range\(\s*(\d+)\s*,\s*(\d+)\s*\)\s*\)\s*", str(mapping or ""))
    return int(m.group(2)) - int(m.group(1)) if m else 0
