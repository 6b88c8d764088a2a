"""RLinf (RLinf/RLinf) reasoning config -> asyncppo.

Checked against RLinf main at commit a3816b5 (2026-08-22): ``examples/reasoning/config/math/*.yaml`` (the configs
are complete Hydra files; RLinf has no schema dataclass, so its "defaults" are the ``cfg.get(key, default)`` calls
in ``rlinf/config.py``, ``rlinf/workers/actor/*.py`` and ``rlinf/algorithms/losses.py``).

Facts that shape the rules below:
* the policy loss applies dual clip whenever ``clip_ratio_c`` is set, and an absent key means 3.0;
* ``entropy_bonus`` acts only with ``calculate_entropy: true``;
* ``importance_sampling_fix`` multiplies the advantages by min(exp(recomputed - rollout), ``importance_sampling_clip``)
  and clips against the recomputed log-probs: asyncppo's ``decoupled``; ``loss_type: decoupled_actor_critic`` masks
  tokens above ``behave_weight_threshold`` instead of truncating;
* ``staleness_threshold``, ``runner.weight_sync_interval`` and ``huber_delta`` are read by the asynchronous /
  embodied runners only;
* the FSDP actor passes (reference, policy) to ``kl_penalty`` in swapped order, the Megatron actor does not.
"""

from __future__ import annotations

from asyncppo.config.convert.engine import Context
from asyncppo.config.convert.rules import NO_PENALTY, as_bool, as_int, as_str_list, choose, only, positive_or_none

VERSION = "RLinf main a3816b5 (2026-08-22)"
AL, SP = "algorithm.", "algorithm.sampling_params."

DEFAULTS = {
    AL + "clip_ratio_c": 3.0, AL + "clip_ratio_low": None, AL + "clip_ratio_high": None,
    AL + "importance_sampling_fix": False, AL + "reinpp_kl_beta": 0.0, AL + "staleness_threshold": None,
    AL + "shuffle_rollout": True, AL + "behave_weight_threshold": None, AL + "huber_delta": None,
    "runner.weight_sync_interval": 1, "rollout.rollout_backend": "sglang", "rollout.gpu_memory_utilization": 0.65,
    "runner.task_type": "reasoning", "runner.resume_dir": None, "reward.reward_scale": 1.0,
}

_PERF = "memory/speed setting of RLinf's workers; no asyncppo equivalent and no effect on what is learned"
_PLACE = "placement is set with --rollout-gpus / --train-gpus"
IGNORED = [
    ("hydra.*", "Hydra run settings", False),
    ("defaults", "Hydra defaults list: only this file's values are read", False),
    ("cluster.*", _PLACE, False),
    ("*.group_name", _PLACE, False),
    ("*.megatron.*", _PERF, False),
    ("*.fsdp_config.*", _PERF, False),
    ("*.offload_*", _PERF, False),
    ("*.enable_offload", _PERF, False),
    ("*.training_backend", _PERF, False),
    ("*.mcore_gpt", _PERF, False),
    ("*.spec_name", _PERF, False),
    ("*.calculate_flops", _PERF, False),
    ("*.enable_dp_load_balance", _PERF, False),
    ("rollout.sglang.*", _PERF, False),
    ("rollout.vllm.*", _PERF, False),
    ("rollout.*_parallel_size", _PLACE, False),
    ("rollout.cuda_graph_max_bs", _PERF, False),
    ("rollout.distributed_executor_backend", _PERF, False),
    ("rollout.disable_log_stats", _PERF, False),
    ("rollout.detokenize", _PERF, False),
    ("rollout.padding", _PERF, False),
    ("rollout.eos", _PERF, False),
    ("rollout.validate_*", _PERF, False),
    ("rollout.print_outputs", _PERF, False),
    ("rollout.model.model_type", _PERF, False),
    ("rollout.return_logprobs", "asyncppo engines always return log-probs", False),
    ("actor.model.*", "model architecture / parallelism options (read from model.path)", False),
    ("critic.model.*", "model architecture / parallelism options", False),
    ("*.tokenizer.*", "the tokenizer is "
     "the one in model.path", False),
    ("actor.global_batch_size", "derived in RLinf from rollout_batch_size and "
     "n_minibatches", False),
    ("actor.micro_batch_size", "derived in RLinf from training_batch_size_per_gpu", False),
    ("*.optim.optimizer", "asyncppo uses AdamW", True),
    ("*.optim.bf16", _PERF, False),
    ("*.optim.fp16", _PERF, False),
    ("*.optim.loss_scale", _PERF, False),
    ("*.optim.use_distributed_optimizer", _PERF, False),
    ("*.optim.overlap_*", _PERF, False),
    ("*.optim.optimizer_enable_pin", _PERF, False),
    ("*.optim.adam_eps", "AdamW eps is fixed (1e-8)", True),
    ("*.optim.min_lr", "no LR floor", True),
    ("*.lr_sched.*", "LR schedule option without an asyncppo equivalent", True),
    ("reward.*", "reward option without an asyncppo equivalent", True),
    ("critic.*", "critic option without an "
     "asyncppo equivalent", True),
    ("data.num_workers", _PERF, False),
    ("data.type", "task family; see "
     "rollout.reward_fn", False),
    ("data.dataset_name", "a label", False),
    ("data.val_rollout_batch_size", _PERF, False),
    ("data.validation_shuffle", "no effect on training", False),
    ("runner.logger.log_path", "asyncppo logs into "
     "trainer.output_dir", False),
    ("runner.task_type", "asyncppo runs reasoning tasks (LLM) or env.* (embodied)", False),
    ("algorithm.val_rollout_batch_size_per_gpu", _PERF, False),
    ("algorithm.rollout_batch_size_per_gpu", _PERF, False),
    ("algorithm.shuffle_rollout", "asyncppo does not shuffle samples within a step", False),
    ("algorithm.critic_warmup_steps", "the critic and the policy always train together", True),
]


def convert(ctx: Context) -> None:
    _algorithm(ctx)
    _losses(ctx)
    _correction(ctx)
    _rollout(ctx)
    _training(ctx)


def _algorithm(ctx: Context) -> None:
    baseline = as_bool(ctx.get(AL + "use_reinpp_baseline", False))
    ctx.map(AL + "adv_type", "algorithm.adv_estimator", choose({
        "gae": "gae", "grpo": "grpo",
        "reinpp": "reinforce_plus_plus_baseline" if baseline else "reinforce_plus_plus"}))
    ctx.consumed(AL + "use_reinpp_baseline", "mapped", "group-mean baseline: reinforce_plus_plus_baseline",
                 ["algorithm.adv_estimator"])
    ctx.map(AL + "gamma", "algorithm.gamma", float)
    ctx.map(AL + "gae_lambda", "algorithm.lambd", float)
    ctx.map(AL + "normalize_advantages", "algorithm.whiten_advantages", as_bool)
    ctx.map(AL + "group_size", "rollout.num_return_sequences_in_group", as_int)
    ctx.map("critic.use_critic_model", "algorithm.use_critic", as_bool)


def _losses(ctx: Context) -> None:
    ctx.map(AL + "ratio_clip_eps", "algorithm.pg_clip", float)
    ctx.map(AL + "clip_ratio_low", "algorithm.clip_ratio_low", lambda v: None if v is None else float(v))
    ctx.map(AL + "clip_ratio_high", "algorithm.clip_ratio_high", lambda v: None if v is None else float(v))
    c = ctx.get(AL + "clip_ratio_c")
    ctx.set("algorithm.dual_clip_loss", c is not None, AL + "clip_ratio_c",
            why="" if ctx.has(AL + "clip_ratio_c") else "RLinf applies dual clip with c = 3 when the key is absent")
    if c is not None:
        ctx.map(AL + "clip_ratio_c", "algorithm.clip_ratio_c", float)
    ctx.unsupported(AL + "clip_log_ratio_*", "log-ratio clamping is not supported")
    calc = as_bool(ctx.get(AL + "calculate_entropy", False))
    if calc:
        ctx.map(AL + "entropy_bonus", "algorithm.entropy_coef", float)
    else:
        ctx.consumed(AL + "entropy_bonus", "unsupported", "no effect in RLinf while calculate_entropy is false",
                     flag=False)
        ctx.set("algorithm.entropy_coef", 0.0, AL + "calculate_entropy")
    ctx.consumed(AL + "calculate_entropy", "mapped", "", ["algorithm.entropy_coef"])
    agg = {"token-mean": "token-mean", "seq-mean-token-sum": "seq-mean-token-sum",
           "seq-mean-token-mean": "seq-mean-token-mean"}
    ctx.map(AL + "loss_agg_func", "algorithm.loss_agg_mode", choose(agg))
    beta = float(ctx.get(AL + "kl_beta", 0.0) or 0.0)
    ctx.set("algorithm.use_kl_loss", beta > 0, AL + "kl_beta")
    if beta > 0:
        ctx.map(AL + "kl_beta", "algorithm.kl_loss_coef", float)
    kl = {k: k for k in ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")}
    fsdp = ctx.get("actor.training_backend") == "fsdp"
    ctx.map(AL + "kl_penalty_type", "algorithm.kl_penalty", choose(kl),
            why="RLinf's FSDP actor passes (reference, policy) in swapped order, so its estimator is the mirrored "
            "one (e.g. k3 becomes exp(d) - d - 1 with d = logp - logp_ref)" if fsdp and beta > 0 else "")
    reinpp = float(ctx.get(AL + "reinpp_kl_beta") or 0.0)
    if reinpp > 0:
        ctx.set("algorithm.add_token_level_kl", True, AL + "reinpp_kl_beta")
        ctx.map(AL + "reinpp_kl_beta", "algorithm.kl_ctrl.init_kl_coef", float)
    ctx.map(AL + "value_cliprange", "algorithm.value_clip", lambda v: None if v is None else float(v))
    ctx.map(AL + "value_clip", "algorithm.value_clip", lambda v: None if v is None else float(v),
            why="RLinf's reasoning workers read algorithm.value_cliprange")
    if ctx.get("runner.task_type") == "reasoning" and ctx.has(AL + "huber_delta"):
        ctx.consumed(AL + "huber_delta", "unsupported", "read by RLinf's async/embodied PPO only: no effect in this "
                     "reasoning config", flag=False)
    else:
        ctx.map(AL + "huber_delta", "algorithm.huber_delta", lambda v: None if v is None else float(v))
    ctx.unsupported(AL + "use_valid_token_scale", "asyncppo's token-mean always divides by the mini-batch's token "
                    "count across micro-batches and ranks (what true does); false has no equivalent")
    ctx.unsupported(AL + "early_stop_imp_ratio", "micro-batches are never skipped on a large importance ratio")
    ctx.consumed(AL + "logprob_forward_micro_batch_size", "unsupported", "log-prob recomputation uses "
                 "algorithm.micro_batch_size (speed/memory only)", flag=False)


def _correction(ctx: Context) -> None:
    loss = ctx.get(AL + "loss_type", "actor")
    fix = as_bool(ctx.get(AL + "importance_sampling_fix"))
    recompute = as_bool(ctx.get(AL + "recompute_logprobs", True))
    srcs = [k for k in (AL + "loss_type", AL + "importance_sampling_fix", AL + "recompute_logprobs") if ctx.has(k)]
    masks = "mask" in ctx.choices("OFF_POLICY_TRUNCATIONS")
    if loss == "decoupled_actor_critic":
        ctx.set("algorithm.off_policy_correction", "decoupled", srcs, "mapped" if masks else "approximate",
                "" if masks else "RLinf's decoupled loss masks tokens whose behaviour weight exceeds "
                "behave_weight_threshold; asyncppo truncates the weight at off_policy_cap")
        if masks and ctx.has(AL + "behave_weight_threshold"):
            ctx.set("algorithm.off_policy_truncation", "mask", AL + "behave_weight_threshold", "approximate",
                    "RLinf drops those tokens from the loss mask; asyncppo gives them weight 0")
        ctx.map(AL + "behave_weight_threshold", "algorithm.off_policy_cap", float,
                why="" if masks else "a mask threshold in RLinf, a truncation cap in asyncppo")
    elif fix:
        ctx.set("algorithm.off_policy_correction", "decoupled", srcs)
        ctx.map(AL + "importance_sampling_clip", "algorithm.off_policy_cap", float)
    elif recompute:
        ctx.set("algorithm.off_policy_correction", "decoupled", srcs, "approximate",
                "RLinf clips against recomputed log-probs without a behaviour weight; asyncppo's decoupled also "
                "multiplies by the truncated behaviour ratio (1 when generation is on-policy)")
    else:
        ctx.set("algorithm.off_policy_correction", "none", srcs)
    if loss == "actor":
        ctx.map(AL + "loss_type", "algorithm.loss_type", choose({"actor": "actor"}))
    else:  # one actor-critic loss: asyncppo has it for embodied runs only, which the converter does not produce
        ctx.consumed(AL + "loss_type", "approximate", f"loss_type={loss!r}: asyncppo's LLM runs train the critic "
                     "with its own optimiser (algorithm.loss_type: actor)", ["algorithm.off_policy_correction"])
    ctx.unsupported(AL + "importance_sampling_clip", "no effect while importance_sampling_fix is false")
    ctx.unsupported(AL + "behave_weight_threshold", "no effect outside the decoupled loss")
    ctx.map(AL + "staleness_threshold", "rollout.max_staleness", positive_or_none(int, zero=True),
            why="RLinf's async runners drop trajectories older than this; asyncppo also stops admitting new ones",
            carry_default=False)
    if not ctx.has(AL + "staleness_threshold"):
        ctx.set("rollout.max_staleness", 0, AL + "staleness_threshold", why="without staleness_threshold RLinf "
                "generates each batch with the current weights (pipeline mode aside); raise rollout.max_staleness to "
                "overlap generation with training")
    ctx.map("runner.weight_sync_interval", "rollout.sync_every", as_int,
            why="" if ctx.get("runner.task_type") != "reasoning" else
            "read by RLinf's embodied runners only; the reasoning runner syncs every step")


def _rollout(ctx: Context) -> None:
    ctx.map("data.rollout_batch_size", "rollout.rollout_batch_size", as_int)
    ctx.map("data.max_prompt_length", "rollout.prompt_length", as_int)
    ctx.map(SP + "max_new_tokens", "rollout.response_length", as_int)
    if not ctx.has(SP + "max_new_tokens") and ctx.has("runner.seq_length"):
        ctx.set("rollout.response_length", as_int(ctx.get("runner.seq_length")) - as_int(
            ctx.get("data.max_prompt_length")), "runner.seq_length")
    ctx.consumed("runner.seq_length", "mapped", "prompt + response budget", ["rollout.response_length"])
    ctx.map(SP + "temperature", "rollout.sampling.temperature", float)
    ctx.map(SP + "temperature", "algorithm.temperature", float)
    ctx.map(SP + "top_p", "rollout.sampling.top_p", float)
    top_k = ctx.get(SP + "top_k")
    ctx.map(SP + "top_k", "rollout.sampling.top_k", lambda v: -1 if v in (None, 0, -1) or as_int(v) >= 100_000
            else as_int(v), why="a top_k this large keeps every token: asyncppo's -1 (off)"
            if top_k is not None and as_int(top_k) >= 100_000 else "")
    ctx.map(SP + "repetition_penalty", "rollout.sampling.repetition_penalty", only(1.0, NO_PENALTY, float))
    ctx.consumed(SP + "do_sample", "mapped" if as_bool(ctx.get(SP + "do_sample", True)) else "unsupported",
                 "asyncppo always samples", [])
    ctx.unsupported(SP + "min_new_tokens", "no minimum response length")
    ctx.map("rollout.rollout_backend", "rollout.engine", choose({"vllm": "vllm"}), carry_default=False)
    ctx.map("rollout.gpu_memory_utilization", "rollout.gpu_memory_utilization", float)
    ctx.map("rollout.enforce_eager", "rollout.enforce_eager", as_bool)
    ctx.map("rollout.max_running_requests", "rollout.max_num_seqs", as_int)
    ctx.map("rollout.model.precision", "rollout.dtype", choose({"bf16": "bfloat16", "fp16": "float16",
                                                               "fp32": "float32"}))
    ctx.map("rollout.model.model_path", "model.path", str)
    ctx.map("actor.model.model_path", "model.path", str)
    ctx.map("actor.model.precision", "model.dtype", choose({"bf16": "bfloat16", "fp32": "float32"}))
    ctx.map("actor.tokenizer.trust_remote_code", "model.trust_remote_code", as_bool)
    ctx.map("data.train_data_paths", "data.train_files", as_str_list)
    ctx.map("data.val_data_paths", "data.eval_files", as_str_list)
    ctx.map("data.prompt_key", "data.prompt_key", str)
    ctx.map("data.answer_key", "data.answer_key", str)
    ctx.map("data.apply_chat_template", "data.apply_chat_template", as_bool)
    ctx.map("data.shuffle", "data.shuffle", as_bool)
    ctx.map("data.seed", "data.seed", as_int)
    ctx.map("data.filter_prompt_by_length", "rollout.overlong_prompt", lambda v: "skip" if as_bool(v) else "truncate")
    ctx.map("reward.reward_type", "rollout.reward_fn", choose({"math": "math"}),
            why="RLinf's math verifier; asyncppo's math reward compares final numbers")
    scale = ctx.get("reward.reward_scale")
    if scale is not None and float(scale) != 1.0:
        ctx.consumed("reward.reward_scale", "unsupported", "rewards are not multiplied by a constant "
                     "(algorithm.reward_norm normalises them instead)", flag=True)


def _training(ctx: Context) -> None:
    batch, nmb = as_int(ctx.get("data.rollout_batch_size", 0) or 0), ctx.get(AL + "n_minibatches")
    if nmb is not None and batch and batch % as_int(nmb) == 0:
        ctx.set("algorithm.ppo_mini_batch_size", batch // as_int(nmb), AL + "n_minibatches",
                why="" if as_int(nmb) > 1 else "")
    elif nmb is not None:
        ctx.consumed(AL + "n_minibatches", "unsupported", "does not divide data.rollout_batch_size", flag=True)
    ctx.map(AL + "training_batch_size_per_gpu", "algorithm.micro_batch_size", as_int,
            why="RLinf counts per GPU; asyncppo's micro-batch is per learner rank")
    if as_bool(ctx.get("runner.enable_dynamic_batch_size", False)):
        ctx.map("runner.max_tokens_per_mbs", "algorithm.max_tokens_per_micro_batch", as_int)
        ctx.consumed("runner.enable_dynamic_batch_size", "mapped", "", ["algorithm.max_tokens_per_micro_batch"])
    else:
        ctx.consumed("runner.enable_dynamic_batch_size", "mapped", "off", [])
        ctx.consumed("runner.max_tokens_per_mbs", "unsupported", "no effect while enable_dynamic_batch_size is "
                     "false", flag=False)
    ctx.map("actor.optim.lr", "trainer.lr", float)
    ctx.map("critic.optim.lr", "trainer.critic_lr", float)
    ctx.map("actor.optim.weight_decay", "trainer.weight_decay", float)
    if ctx.has("actor.optim.adam_beta1") or ctx.has("actor.optim.adam_beta2"):
        ctx.set("trainer.betas", [float(ctx.get("actor.optim.adam_beta1", 0.9)),
                                  float(ctx.get("actor.optim.adam_beta2", 0.999))],
                ["actor.optim.adam_beta1", "actor.optim.adam_beta2"])
    ctx.map("actor.optim.clip_grad", "trainer.grad_clip", float)
    ctx.map("actor.lr_sched.lr_warmup_iters", "trainer.warmup_steps", as_int)
    ctx.map("actor.lr_sched.lr_decay_style", "trainer.lr_schedule", choose({"constant": "constant",
                                                                           "linear": "linear"}))
    ctx.map("actor.seed", "trainer.seed", as_int)
    steps = ctx.get("runner.max_steps")
    if steps is not None and as_int(steps) > 0:
        ctx.map("runner.max_steps", "trainer.total_steps", as_int)
        ctx.consumed("runner.max_epochs", "unsupported", "runner.max_steps is used", flag=False)
    else:
        for k in ("runner.max_steps", "runner.max_epochs"):
            ctx.consumed(k, "unsupported", "asyncppo counts learner steps: set trainer.total_steps (RLinf derives "
                         "them from max_epochs and the dataset size)", flag=True)
    ctx.map("runner.val_check_interval", "trainer.eval_every", lambda v: max(as_int(v), 0))
    ctx.map("runner.save_interval", "trainer.save_every", lambda v: max(as_int(v), 0))
    ctx.map("runner.output_dir", "trainer.output_dir", str)
    ctx.map("runner.experiment_name", "trainer.logger.wandb_run_name", str)
    ctx.map("runner.logger.experiment_name", "trainer.logger.wandb_run_name", str)
    ctx.map("runner.logger.project_name", "trainer.logger.wandb_project", str)
    if ctx.has("runner.logger.logger_backends"):
        backends = as_str_list(ctx.get("runner.logger.logger_backends"))
        ctx.set("trainer.logger.wandb", "wandb" in backends, "runner.logger.logger_backends",
                "mapped" if set(backends) <= {"wandb"} else "approximate",
                "" if set(backends) <= {"wandb"} else "tensorboard/swanlab are not supported; console and JSONL used")
    ctx.unsupported("runner.resume_dir", "an RLinf checkpoint cannot be loaded; export the actor to Hugging Face "
                    "format and set model.path")
