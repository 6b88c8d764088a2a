"""verl (volcengine/verl) PPO trainer config -> asyncppo.

Checked against verl main at commit b178a3c (2026-01-29): ``verl/trainer/config/_generated_ppo_trainer.yaml``,
``verl/trainer/config/algorithm/rollout_correction.yaml``, ``verl/workers/config/actor.py``,
``verl/trainer/ppo/core_algos.py`` and, for the asynchronous keys, the fully-async recipe
``verl/experimental/fully_async_policy/config/fully_async_ppo_trainer.yaml``.

Facts that shape the rules below (each one changes a run if ignored):
* the vanilla policy loss always applies dual clip (``clip_ratio_c``, default 3);
* ``clip_ratio_low`` / ``clip_ratio_high`` default to 0.2, not null, so ``clip_ratio`` alone changes nothing;
* the learner recomputes log-probs at ``rollout.temperature``; there is no actor-side temperature;
* GAE advantages are always whitened, GRPO ones never (no switch);
* the dataset always applies the chat template; ``return_raw_chat`` only keeps the raw messages as well.
"""


from __future__ import annotations

from asyncppo.config.convert.engine import Context
from asyncppo.config.convert.rules import as_bool, as_int, as_str_list, choose, positive_or_none
from asyncppo.config.convert.verl_keys import A, DEFAULTS, FA, IGNORED, RC, VERSION, M, R

__all__ = ["DEFAULTS", "IGNORED", "VERSION", "convert"]


def convert(ctx: Context) -> None:
    _algorithm(ctx)
    _losses(ctx)
    _rollout_correction(ctx)
    _rollout_and_data(ctx)
    _trainer(ctx)


def _algorithm(ctx: Context) -> None:
    est = {"gae": "gae", "grpo": "grpo", "rloo": "rloo", "reinforce_plus_plus": "reinforce_plus_plus",
           "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline"}
    near = {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
    adv = ctx.get("algorithm.adv_estimator")
    if adv in near:
        ctx.map("algorithm.adv_estimator", "algorithm.adv_estimator", near.get,
                why="a vectorised implementation of the same estimator")
    else:
        ctx.map("algorithm.adv_estimator", "algorithm.adv_estimator", choose(est))
    # verl whitens inside the GAE estimator and never for the group estimators: there is no switch.
    ctx.set("algorithm.whiten_advantages", adv == "gae", "algorithm.adv_estimator",
            why="verl whitens GAE advantages always and group-estimator advantages never")
    ctx.map("algorithm.gamma", "algorithm.gamma", float)
    ctx.map("algorithm.lam", "algorithm.lambd", float)
    ctx.map("algorithm.norm_adv_by_std_in_grpo", "algorithm.norm_adv_by_std_in_grpo", as_bool)
    ctx.map("algorithm.use_kl_in_reward", "algorithm.add_token_level_kl", as_bool)
    ctx.map("algorithm.kl_ctrl.type", "algorithm.kl_ctrl.type", choose({"fixed": "fixed", "adaptive": "adaptive"}))
    ctx.map("algorithm.kl_ctrl.kl_coef", "algorithm.kl_ctrl.init_kl_coef", float)
    ctx.map("algorithm.kl_ctrl.horizon", "algorithm.kl_ctrl.kl_horizon", as_int)
    ctx.map("algorithm.kl_ctrl.target_kl", "algorithm.kl_ctrl.target_kl", float)
    # DAPO: group filtering (dynamic sampling) and the soft over-length penalty of the dapo reward manager
    if as_bool(ctx.get("algorithm.filter_groups.enable", False)):
        ctx.set("algorithm.dynamic_sampling", True, "algorithm.filter_groups.enable")
        metric = ctx.get("algorithm.filter_groups.metric", "acc")
        ctx.consumed("algorithm.filter_groups.metric", "mapped" if metric in ("acc", "score", "seq_reward")
                     else "approximate", "asyncppo skips groups whose rewards are all equal", [])
    ob = "reward_model.reward_kwargs.overlong_buffer_cfg."
    if as_bool(ctx.get(ob + "enable", False)):
        ctx.map(ob + "len", "algorithm.overlong_buffer_len", as_int)
        ctx.map(ob + "penalty_factor", "algorithm.overlong_penalty_factor", float)
        ctx.consumed(ob + "enable", "mapped", "", ["algorithm.overlong_buffer_len"])
        ctx.consumed("reward_model.reward_manager", "mapped", "the over-length penalty is asyncppo's own", [])
    ctx.consumed(ob + "log", "unsupported", "logging switch", flag=False)
    ctx.unsupported("algorithm.filter_groups.max_num_gen_batches", "asyncppo bounds skipped groups per step "
                    "(algorithm.dynamic_sampling_max_skip), not generation batches")
    ctx.unsupported("algorithm.use_pf_ppo", "prioritised-replay PPO is not supported")
    for key in ctx.keys_under("algorithm.pf_ppo"):
        ctx.consumed(key, "unsupported", "prioritised-replay PPO is not supported",
                     flag=as_bool(ctx.get("algorithm.use_pf_ppo")))
    # One KL estimator in asyncppo; verl has one for the loss and one for the in-reward penalty.
    use_loss, in_reward = as_bool(ctx.get(A + "use_kl_loss")), as_bool(ctx.get("algorithm.use_kl_in_reward"))
    loss_type, reward_type = ctx.get(A + "kl_loss_type"), ctx.get("algorithm.kl_penalty")
    if use_loss and in_reward and loss_type != reward_type:
        ctx.map(A + "kl_loss_type", "algorithm.kl_penalty", why=f"asyncppo uses one estimator for both KL terms; "
                f"algorithm.kl_penalty={reward_type!r} for the in-reward KL is replaced by it")
        ctx.consumed("algorithm.kl_penalty", "approximate", f"replaced by kl_loss_type={loss_type!r}",
                     ["algorithm.kl_penalty"])
    elif in_reward:
        ctx.map("algorithm.kl_penalty", "algorithm.kl_penalty")
        ctx.consumed(A + "kl_loss_type", "unsupported", "KL loss off: no effect", flag=False)
    else:
        ctx.map(A + "kl_loss_type", "algorithm.kl_penalty")
        ctx.consumed("algorithm.kl_penalty", "unsupported", "KL in reward off: no effect", flag=False)


def _losses(ctx: Context) -> None:
    ctx.map(A + "clip_ratio", "algorithm.pg_clip", float)
    ctx.map(A + "clip_ratio_low", "algorithm.clip_ratio_low", float)
    ctx.map(A + "clip_ratio_high", "algorithm.clip_ratio_high", float)
    # The vanilla loss always applies the dual-clip bound.
    ctx.set("algorithm.dual_clip_loss", True, A + "clip_ratio_c",
            why="verl's vanilla policy loss always applies dual clip")
    ctx.map(A + "clip_ratio_c", "algorithm.clip_ratio_c", float)
    # asyncppo's loss registry (algorithm.policy_loss) where this build has it; verl's names where they match.
    mode = ctx.get(A + "policy_loss.loss_mode")
    ours = ctx.choices("POLICY_LOSSES")
    same = {"vanilla": "ppo", **{m: m for m in ("gspo", "cispo", "clip_cov", "kl_cov") if m in ours}}
    if mode in same and "algorithm.policy_loss" in ctx.ours:
        ctx.map(A + "policy_loss.loss_mode", "algorithm.policy_loss", same.get)
    elif mode == "vanilla":
        ctx.consumed(A + "policy_loss.loss_mode", "mapped", "asyncppo's PPO clip loss", [])
    else:
        ctx.consumed(A + "policy_loss.loss_mode", "unsupported", f"loss_mode={mode!r} has no asyncppo equivalent; "
                     "the converted run uses the PPO clip loss", flag=True)
    for loss, name, target in (("clip_cov", "clip_cov_ratio", "clip_cov_ratio"), ("clip_cov", "clip_cov_lb",
                               "clip_cov_lb"), ("clip_cov", "clip_cov_ub", "clip_cov_ub"),
                               ("kl_cov", "kl_cov_ratio", "kl_cov_ratio"), ("kl_cov", "ppo_kl_coef", "kl_cov_coef")):
        if mode == loss and ctx.has(A + "policy_loss." + name):
            ctx.map(A + "policy_loss." + name, "algorithm." + target, float)
    for key in [k for k in ctx.keys_under(A + "policy_loss") if k not in ctx.entries]:
        ctx.consumed(key, "unsupported", f"no effect with loss_mode={mode!r}", flag=False)
    ctx.map(A + "loss_agg_mode", "algorithm.loss_agg_mode", choose({m: m for m in (
        "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")}))
    ctx.map(A + "loss_scale_factor", "algorithm.loss_agg_norm_length", positive_or_none(int))
    ctx.map(A + "entropy_coeff", "algorithm.entropy_coef", float)
    ctx.unsupported(A + "calculate_entropy", "asyncppo computes the entropy whenever entropy_coef > 0")
    ctx.map(A + "use_kl_loss", "algorithm.use_kl_loss", as_bool)
    ctx.map(A + "kl_loss_coef", "algorithm.kl_loss_coef", float)
    ctx.map(A + "ppo_epochs", "algorithm.ppo_epochs", as_int)
    ctx.map(A + "ppo_mini_batch_size", "algorithm.ppo_mini_batch_size", as_int)
    ctx.map(A + "ppo_micro_batch_size_per_gpu", "algorithm.micro_batch_size", positive_or_none(int, zero=True),
            why="" if ctx.get(A + "ppo_micro_batch_size_per_gpu") is None else
            "verl counts per GPU; asyncppo's micro-batch is per learner rank (the same with one rank per GPU)")
    ctx.unsupported(A + "ppo_micro_batch_size", "deprecated in verl (global size); use ppo_micro_batch_size_per_gpu")
    if as_bool(ctx.get(A + "use_dynamic_bsz")):
        ctx.map(A + "ppo_max_token_len_per_gpu", "algorithm.max_tokens_per_micro_batch", as_int)
        ctx.consumed(A + "use_dynamic_bsz", "mapped", "", ["algorithm.max_tokens_per_micro_batch"])
    else:
        ctx.consumed(A + "use_dynamic_bsz", "mapped", "off: micro-batches by count", [])
        ctx.consumed(A + "ppo_max_token_len_per_gpu", "unsupported", "no effect while use_dynamic_bsz is false",
                     flag=False)
    # verl's remove-padding forward is sequence packing (learner/packing.py); absent, asyncppo's auto applies
    ctx.map(M + "use_remove_padding", "algorithm.pack_sequences", as_bool, carry_default=False)
    ctx.map("critic.cliprange_value", "algorithm.value_clip", float)
    ctx.map("critic.enable", "algorithm.use_critic", lambda v: None if v is None else as_bool(v))
    ctx.map("critic.optim.lr", "trainer.critic_lr", float)


def _rollout_correction(ctx: Context) -> None:
    keys = ctx.keys_under("algorithm.rollout_correction")
    if not keys:
        ctx.note("Off-policy correction: verl's default (no rollout_correction) clips against recomputed old "
                 "log-probs with no behaviour weight; asyncppo's default `decoupled` also applies the truncated "
                 "behaviour weight (cap algorithm.off_policy_cap = 2). Set algorithm.off_policy_correction=none "
                 "to clip against the rollout log-probs instead.")
    is_level, bypass = ctx.get(RC + "rollout_is"), as_bool(ctx.get(RC + "bypass_mode"))
    loss = ctx.get(RC + "loss_type")
    if bypass and loss == "ppo_clip":
        mode, why = "none", "" if is_level is None else "bypass mode with PPO clip: the ratio itself carries the IS"
    elif bypass:
        mode, why = "tis", "verl's bypass REINFORCE loss is unclipped; asyncppo's tis weights the clipped PPO loss"
    elif is_level == "token":
        mode, why = "decoupled", ""
    elif is_level is None:
        mode, why = "decoupled", ("verl recomputes old log-probs and clips against them but applies no behaviour "
                                  "weight; asyncppo's decoupled also multiplies by the truncated behaviour ratio")
    else:
        mode, why = "decoupled", f"rollout_is={is_level!r}: asyncppo's weight is per token"
        if is_level == "sequence" and "algorithm.off_policy_level" in ctx.ours:
            why = ""
            ctx.set("algorithm.off_policy_level", "sequence", RC + "rollout_is")
    srcs = [k for k in (RC + "rollout_is", RC + "bypass_mode", RC + "loss_type") if ctx.has(k)] or [RC + "rollout_is"]
    ctx.set("algorithm.off_policy_correction", mode, srcs, "approximate" if why else "mapped", why)
    ctx.map(RC + "rollout_is_threshold", "algorithm.off_policy_cap", float, carry_default=bool(keys))
    ctx.unsupported(RC + "rollout_rs*", "rejection sampling (masking) is not supported; only truncation")
    if "algorithm.off_policy_normalize" in ctx.ours:
        ctx.map(RC + "rollout_is_batch_normalize", "algorithm.off_policy_normalize", as_bool, carry_default=False)
    ctx.unsupported(RC + "rollout_is_batch_normalize", "IS weights are not renormalised over the batch")


def _rollout_and_data(ctx: Context) -> None:
    ctx.map(R + "name", "rollout.engine", choose({"vllm": "vllm", "hf": "hf"}))
    ctx.map(R + "n", "rollout.num_return_sequences_in_group", as_int)
    ctx.map(R + "temperature", "rollout.sampling.temperature", float)
    ctx.map(R + "temperature", "algorithm.temperature", float)  # the learner divides logits by the same value
    ctx.map(R + "top_p", "rollout.sampling.top_p", float)
    ctx.map(R + "top_k", "rollout.sampling.top_k", as_int)
    if not as_bool(ctx.get(R + "do_sample")):
        ctx.consumed(R + "do_sample", "unsupported", "greedy rollouts are not supported; asyncppo samples")
    else:
        ctx.consumed(R + "do_sample", "mapped", "asyncppo always samples", [])
    ctx.map(R + "dtype", "rollout.dtype", choose({"bfloat16": "bfloat16", "float16": "float16", "float32": "float32",
                                                  "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}),
            carry_default=False)
    ctx.map(R + "gpu_memory_utilization", "rollout.gpu_memory_utilization", float)
    ctx.map(R + "enforce_eager", "rollout.enforce_eager", as_bool, carry_default=False)
    ctx.map(R + "max_num_seqs", "rollout.max_num_seqs", as_int)
    ctx.map(R + "checkpoint_engine.update_weights_bucket_megabytes", "rollout.weight_bucket_mb", as_int,
            carry_default=False)
    ctx.unsupported(R + "checkpoint_engine.*", "the weight-sync transport is fixed (torch.distributed broadcast)")
    ctx.unsupported(R + "mode", "generation is always streaming (asynchronous)")
    ctx.map(R + "val_kwargs.n", "data.eval_samples", as_int, carry_default=False,
            why="asyncppo also scores one greedy answer per held-out prompt")
    ctx.map(M + "path", "model.path", str, carry_default=False)
    ctx.map(M + "enable_gradient_checkpointing", "model.gradient_checkpointing", as_bool)
    ctx.map(M + "trust_remote_code", "model.trust_remote_code", as_bool)
    ctx.map(M + "lora_rank", "model.lora_rank", as_int, carry_default=False)  # LoRA (docs/lora.md); 0 = off
    ctx.map(M + "lora_alpha", "model.lora_alpha", float, carry_default=False)
    ctx.map(M + "target_modules", "model.lora_target_modules", as_str_list, carry_default=False)
    ctx.map("critic.model.path", "model.critic_path", str, carry_default=False)
    ctx.map("data.train_files", "data.train_files", as_str_list, carry_default=False)
    ctx.map("data.val_files", "data.eval_files", as_str_list, carry_default=False)
    ctx.map("data.train_batch_size", "rollout.rollout_batch_size", as_int)
    ctx.map("data.max_prompt_length", "rollout.prompt_length", as_int)
    ctx.map("data.max_response_length", "rollout.response_length", as_int)
    ctx.map("data.prompt_key", "data.prompt_key", str)
    ctx.map("data.shuffle", "data.shuffle", as_bool)
    ctx.map("data.seed", "data.seed", lambda v: 0 if v is None else as_int(v), carry_default=False)
    if as_bool(ctx.get("data.filter_overlong_prompts")):
        ctx.set("rollout.overlong_prompt", "skip", "data.filter_overlong_prompts")
    else:
        trunc = ctx.get("data.truncation")
        ctx.set("rollout.overlong_prompt", "truncate", ["data.filter_overlong_prompts", "data.truncation"],
                "mapped" if trunc in ("left", "right", "middle") else "approximate",
                "" if trunc in ("left", "right", "middle") else
                f"verl's truncation={trunc!r} fails the run on an overlong prompt; asyncppo truncates it")
    ctx.consumed("data.truncation", "mapped", "", ["rollout.overlong_prompt"])
    ctx.consumed("data.return_raw_chat", "unsupported", "verl always applies the chat template; this only also "
                 "keeps the raw messages. asyncppo's data.apply_chat_template stays true", flag=False)
    path, name = ctx.get("custom_reward_function.path"), ctx.get("custom_reward_function.name")
    if path:
        module = str(path).removesuffix(".py").strip("./").replace("/", ".")
        ctx.set("rollout.reward_fn", f"{module}:{name}", ["custom_reward_function.path", "custom_reward_function.name"],
                "approximate", "verl loads a file path; asyncppo imports a module: the file's directory must be on "
                "PYTHONPATH, and asyncppo calls it as fn(response_text, answer), not with verl's arguments")
    elif ctx.has("data.train_files"):
        ctx.set("rollout.reward_fn", "math", "data.train_files", "approximate",
                "verl picks a scorer per record from its data_source; asyncppo's math reward compares final numbers")
    ctx.unsupported("custom_reward_function.*", "no custom reward function given")


def _trainer(ctx: Context) -> None:
    ctx.map(A + "optim.lr", "trainer.lr", float)
    ctx.map(A + "optim.weight_decay", "trainer.weight_decay", float)
    ctx.map(A + "optim.betas", "trainer.betas", lambda v: [float(x) for x in v])
    ctx.map(A + "optim.lr_warmup_steps", "trainer.warmup_steps", lambda v: max(as_int(v), 0))
    ctx.unsupported(A + "optim.lr_warmup_steps_ratio", "warm-up is given in steps (trainer.warmup_steps)")
    ctx.map(A + "optim.lr_scheduler_type", "trainer.lr_schedule", choose({"constant": "constant"}))
    ctx.map(A + "optim.warmup_style", "trainer.lr_schedule", lambda v: choose({"constant": "constant"})(v)
            if v is not None else "constant", carry_default=False)
    ctx.unsupported(A + "optim.*", "optimiser option without an asyncppo equivalent (AdamW, no LR floor)")
    ctx.map(A + "grad_clip", "trainer.grad_clip", float)
    if ctx.get("trainer.total_training_steps") is not None:
        ctx.map("trainer.total_training_steps", "trainer.total_steps", as_int, carry_default=False)
    else:
        ctx.consumed("trainer.total_training_steps", "unsupported", "null: derived from the epochs", flag=False)
        ctx.consumed("trainer.total_epochs", "unsupported", "asyncppo counts learner steps: set trainer.total_steps "
                     "(verl derives them from the epochs and the dataset size)", flag=True)
        ctx.note("verl derives the number of steps from trainer.total_epochs and the dataset size; asyncppo needs "
                 "trainer.total_steps (left at asyncppo's default).")
    ctx.unsupported("trainer.total_epochs", "trainer.total_training_steps is used instead")
    ctx.map("trainer.experiment_name", "trainer.logger.wandb_run_name", str, carry_default=False)
    ctx.map("trainer.project_name", "trainer.logger.wandb_project", str, carry_default=False)
    ctx.map("trainer.default_local_dir", "trainer.output_dir", str, carry_default=False)
    ctx.map("trainer.save_freq", "trainer.save_every", lambda v: max(as_int(v), 0))
    never = as_int(ctx.get("trainer.test_freq")) <= 0
    ctx.map("trainer.test_freq", "trainer.eval_every", lambda v: max(as_int(v), 0),
            why="-1 in verl never evaluates; asyncppo's 0 still evaluates at the start and the end" if never else "")
    ctx.map("trainer.val_before_train", "trainer.eval_at_start", as_bool)
    keep = ctx.get("trainer.max_actor_ckpt_to_keep")
    if keep is not None:
        ctx.map("trainer.max_actor_ckpt_to_keep", "trainer.keep_checkpoints", positive_or_none(int))
    else:
        ctx.consumed("trainer.max_actor_ckpt_to_keep", "unsupported", "null keeps every checkpoint in verl; asyncppo "
                     "keeps the newest trainer.keep_checkpoints", flag=True)
        ctx.note("verl keeps every checkpoint by default; asyncppo keeps the newest trainer.keep_checkpoints (2).")
    logger = as_str_list(ctx.get("trainer.logger"))
    if ctx.has("trainer.logger"):
        ctx.set("trainer.logger.console", "console" in logger, "trainer.logger")
        ctx.set("trainer.logger.wandb", "wandb" in logger, "trainer.logger")
        others = [b for b in logger if b not in ("console", "wandb", "file")]
        if others:
            ctx.consumed("trainer.logger", "approximate", f"backends {others} are not supported")
    ctx.unsupported("trainer.critic_warmup", "the critic and the policy always train together")
    if ctx.get("trainer.resume_mode") in ("auto", "disable") and not ctx.get("trainer.resume_from_path"):
        ctx.consumed("trainer.resume_mode", "mapped", "starts fresh (asyncppo resumes only with trainer.resume_from)",
                     [], flag=False)
    ctx.unsupported("trainer.resume_*", "a verl checkpoint cannot be loaded; export its actor to Hugging Face "
                    "format and set model.path")
    ctx.unsupported("trainer.balance_batch", "micro-batches are grouped by length instead")
    ctx.unsupported("trainer.val_only", "no evaluation-only mode")
    # fully-async recipe
    thr = ctx.get(FA + "staleness_threshold")
    if not ctx.keys_under("async_training"):
        ctx.set("rollout.max_staleness", 0, FA + "staleness_threshold", why="verl's PPO trainer is synchronous "
                "(the fully-async recipe is async_training.*); raise rollout.max_staleness to overlap generation "
                "with training")
    else:
        ctx.map(FA + "trigger_parameter_sync_step", "rollout.sync_every", as_int,
                why="verl counts mini-batches of the trainer between syncs; asyncppo counts learner steps")
        sync = as_int(ctx.get(FA + "trigger_parameter_sync_step") or 1)
        ctx.set("rollout.max_staleness", max(sync - 1, 1 + int(float(thr or 0) * sync)), FA + "staleness_threshold",
                "approximate", "verl bounds the fraction of stale samples per sync period; asyncppo bounds each "
                "sample's lag in versions: set to cover one sync period plus that fraction")
        ctx.map(FA + "partial_rollout", "rollout.inflight_update", lambda v: "keep" if as_bool(v) else "off",
                why="verl interrupts and resumes partial rollouts; asyncppo keeps their KV cache across the swap")
        ctx.unsupported(FA + "*", "fully-async recipe option without an asyncppo equivalent")

