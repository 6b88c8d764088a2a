"""Reject well-typed but meaningless configurations before anything starts, and fill derived defaults.

Hydra/OmegaConf already guarantee types (an int field holds an int). What they cannot know is that
``clip_ratio_c <= 1`` disables dual clipping in a confusing way, that a weight push every ``s`` steps makes samples
``s - 1`` versions old so ``max_staleness < sync_every - 1`` can never hold, or that RLOO with one sample per
prompt divides by zero. A bad option found here costs a second; found inside a Ray actor it costs a cluster start
and a stack trace. So every check runs, all problems are collected, and one :class:`ConfigError` lists them, each
naming the key, the value given and what is allowed.

Derived defaults (``clip_ratio_low/high`` from ``pg_clip`` and so on) are resolved here too, in one place, so that
every consumer sees explicit numbers and a dumped config reloads to exactly the same values.
"""

from __future__ import annotations

import re

from asyncppo.config import choices as C
from asyncppo.config.checks import Checks, ConfigError, mini_batch_prompts, uses_critic
from asyncppo.config.devices import learner_on_gpu
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.validate_algorithm import check_algorithm
from asyncppo.config.validate_cluster import check_cluster, check_engine_parallel
from asyncppo.config.validate_lora import check_lora
from asyncppo.config.validate_text_env import check_text_env, resolve_agent, resolve_env_concurrency
from asyncppo.config.validate_window import check_window, effective, resolve_window, sync_every_of

__all__ = ["ConfigError", "check_config", "resolve_derived", "validate_config"]

_DOTTED_FN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


def _check_rollout(cfg: AsyncPPOConfig, c: Checks) -> None:
    r, s = cfg.rollout, cfg.rollout.sampling
    c.choice("rollout.engine", r.engine, C.ENGINES)
    c.positive("rollout.rollout_batch_size", r.rollout_batch_size)
    c.positive("rollout.num_return_sequences_in_group", r.num_return_sequences_in_group)
    c.positive("rollout.prompt_length", r.prompt_length)
    c.positive("rollout.response_length", r.response_length)
    c.choice("rollout.overlong_prompt", r.overlong_prompt, C.OVERLONG_PROMPT)
    check_window(cfg, c)
    k, j = effective(r)  # "auto" as the numbers the checks below test (validate_window.py)
    c.non_negative("rollout.max_staleness", k)
    if j is not None and isinstance(r.max_staleness, int) and not 0 <= j <= max(k, 0):
        c.error("rollout.admission_lookahead", j,
                f"must be null (= rollout.max_staleness) or in [0, rollout.max_staleness={k}]: "
                "tickets granted further ahead than the bound could not be trained within it")
    s_every = sync_every_of(r)  # "auto" as 1: where its cadence starts, and its floor (validate_window.py)
    if s_every < 1:
        c.error("rollout.sync_every", s_every, "must be >= 1 (learner steps between weight pushes)")
    elif k >= 0 and k < s_every - 1:
        c.error("rollout.max_staleness", k,
                f"must be >= rollout.sync_every - 1 = {s_every - 1}: pushing weights every {s_every} "
                f"steps makes samples up to {s_every - 1} versions old, so a smaller bound can never hold")
    elif j is not None and 0 <= j < s_every - 1:
        c.error("rollout.admission_lookahead", j,
                f"must be >= rollout.sync_every - 1 = {s_every - 1}: a ticket needs weights at most "
                f"{j} versions old, and with a push every {s_every} steps the engines "
                "never get them, so the run would hang")
    c.choice("rollout.dtype", r.dtype, C.ROLLOUT_DTYPES)
    c.in_range("rollout.gpu_memory_utilization", r.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
    c.positive("rollout.kv_cache_gib", r.kv_cache_gib)
    check_engine_parallel(cfg, c)
    c.non_negative("rollout.prompts_per_call", r.prompts_per_call)
    c.choice("rollout.generation", r.generation, C.GENERATION_MODES)
    c.choice("rollout.inflight_update", r.inflight_update, C.INFLIGHT_UPDATES)
    c.choice("rollout.admission_unit", r.admission_unit, C.ADMISSION_UNITS)
    c.positive("rollout.max_num_seqs", r.max_num_seqs)
    if r.max_num_seqs > 0 and r.num_return_sequences_in_group > r.max_num_seqs:
        c.error("rollout.max_num_seqs", r.max_num_seqs,
                f"must be >= rollout.num_return_sequences_in_group={r.num_return_sequences_in_group}: a group is "
                "admitted whole, so a smaller engine could never start one")
    if r.reward_fn not in C.BUILTIN_REWARD_FNS and not _DOTTED_FN.match(r.reward_fn or ""):
        c.error("rollout.reward_fn", r.reward_fn, f"must be one of {', '.join(C.BUILTIN_REWARD_FNS)} or a dotted "
                "path 'package.module:function'")
    c.positive("rollout.weight_bucket_mb", r.weight_bucket_mb)
    # sampling
    c.positive("rollout.sampling.temperature", s.temperature)
    c.in_range("rollout.sampling.top_p", s.top_p, 0.0, 1.0, lo_open=True)
    if s.top_k != -1 and s.top_k < 1:
        c.error("rollout.sampling.top_k", s.top_k, "must be -1 (off) or >= 1")
    c.in_range("rollout.sampling.min_p", s.min_p, 0.0, 1.0)
    c.positive("rollout.sampling.repetition_penalty", s.repetition_penalty)
    if s.seed is not None and s.seed < 0:
        c.error("rollout.sampling.seed", s.seed, "must be null or >= 0")
    for i, stop in enumerate(s.stop):
        if not stop:
            c.error(f"rollout.sampling.stop[{i}]", stop, "stop strings must be non-empty")
    # Options the engines do not apply yet are refused rather than silently ignored.
    if s.min_p != 0.0:
        c.error("rollout.sampling.min_p", s.min_p, "must be 0.0: min-p sampling is not supported by the rollout engines yet")
    if s.repetition_penalty != 1.0:
        c.error("rollout.sampling.repetition_penalty", s.repetition_penalty,
                "must be 1.0: repetition penalties are not supported by the rollout engines yet")
    if s.stop:
        c.error("rollout.sampling.stop", list(s.stop),
                "must be empty: stop strings are not supported yet (generation stops at the tokenizer's eos)")
    if s.top_p < 1.0 or s.top_k != -1:
        c.warn(f"rollout.sampling.top_p={s.top_p} / top_k={s.top_k}: behaviour log-probs come from the truncated, "
               "renormalised distribution while the learner recomputes the full one, so importance ratios are biased "
               "(weights <= 1); prefer top_p=1.0 and top_k=-1 for RL")


def _check_model_data(cfg: AsyncPPOConfig, c: Checks) -> None:
    m, d = cfg.model, cfg.data
    if not m.path or not m.path.strip():
        c.error("model.path", m.path, "required: a local Hugging Face model directory or builtin:<name> "
                "(e.g. model.path=/models/Qwen2.5-0.5B-Instruct)")
    elif m.path.startswith("builtin:") and d.train_files:
        c.warn(f"model.path={m.path} is a built-in synthetic-task model but data.train_files is set: its tokenizer "
               "only knows the synthetic task's alphabet")
    if m.path and m.path.startswith("builtin:") and not m.path[len("builtin:"):].strip():
        c.error("model.path", m.path, "builtin models are named 'builtin:<name>', e.g. builtin:tiny-addition")
    c.choice("model.dtype", m.dtype, C.LEARNER_DTYPES)
    if m.attn_implementation is not None:
        c.choice("model.attn_implementation", m.attn_implementation, C.ATTN_IMPLEMENTATIONS)
        if m.attn_implementation == "flex_attention" and not learner_on_gpu(cfg):
            c.error("model.attn_implementation", m.attn_implementation, "flex-attention has no backward pass on "
                    "CPU (torch); use it with a CUDA learner (--train-gpus / --gpus), or leave it null (sdpa)")
    if m.critic_path and not uses_critic(cfg):
        c.warn(f"model.critic_path is set but adv_estimator={cfg.algorithm.adv_estimator} uses no critic")
    for key, files in (("data.train_files", d.train_files), ("data.eval_files", d.eval_files)):
        for i, f in enumerate(files):
            if not str(f).lower().endswith(C.DATA_FILE_SUFFIXES):
                c.error(f"{key}[{i}]", f, f"must end with one of {', '.join(C.DATA_FILE_SUFFIXES)}")
    c.non_empty("data.prompt_key", d.prompt_key)
    c.non_empty("data.answer_key", d.answer_key)
    if not d.train_files:
        c.non_empty("data.task", d.task)
    c.non_negative("data.num_eval_prompts", d.num_eval_prompts)
    c.non_negative("data.eval_samples", d.eval_samples)
    c.non_negative("data.seed", d.seed)


def _check_trainer(cfg: AsyncPPOConfig, c: Checks) -> None:
    t, lg = cfg.trainer, cfg.trainer.logger
    c.positive("trainer.lr", t.lr)
    c.positive("trainer.critic_lr", t.critic_lr)
    c.non_negative("trainer.weight_decay", t.weight_decay)
    if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
        c.error("trainer.betas", list(t.betas), "must be two numbers in [0, 1), e.g. [0.9, 0.999]")
    c.non_negative("trainer.warmup_steps", t.warmup_steps)
    c.positive("trainer.grad_clip", t.grad_clip)
    c.positive("trainer.total_steps", t.total_steps)
    c.non_empty("trainer.output_dir", t.output_dir)
    c.non_negative("trainer.seed", t.seed)
    c.non_negative("trainer.eval_every", t.eval_every)
    c.non_negative("trainer.save_every", t.save_every)
    c.positive("trainer.keep_checkpoints", t.keep_checkpoints)
    c.non_negative("trainer.max_learner_restarts", t.max_learner_restarts)
    if t.resume_from is not None:
        c.non_empty("trainer.resume_from", t.resume_from)
    c.non_negative("trainer.sft_warmup_steps", t.sft_warmup_steps)
    if t.cpu_threads < 1:
        c.error("trainer.cpu_threads", t.cpu_threads, "must be >= 1 (torch threads of each learner rank on CPU)")
    c.choice("trainer.weight_push_gather", t.weight_push_gather, ("layer_groups", "whole"))
    c.positive("trainer.weight_push_budget_mb", t.weight_push_budget_mb)
    c.choice("trainer.logger.wandb_mode", lg.wandb_mode, C.WANDB_MODES)
    c.positive("trainer.logger.log_every", lg.log_every)


def _check_env(cfg: AsyncPPOConfig, c: Checks) -> None:
    """Embodied runs (docs/embodied.md); also the keys only they read, so an LLM run cannot set them by mistake."""
    e, a, m = cfg.env, cfg.algorithm, cfg.model
    c.choice("algorithm.loss_type", a.loss_type, C.LOSS_TYPES)
    c.choice("trainer.lr_schedule", cfg.trainer.lr_schedule, C.LR_SCHEDULES)
    if e.id is None:
        if a.loss_type == "actor_critic":
            c.error("algorithm.loss_type", a.loss_type, "needs an embodied run (env=cartpole or env.id=<gymnasium "
                    "id>); LLM runs keep two optimisers (model.shared_backbone=true shares the body, not the optimiser)")
        if m.shared_backbone:  # LLM runs: a value head on the actor's hidden states (learner/value_head.py)
            if m.critic_path:
                c.error("model.critic_path", m.critic_path, "is the separate critic's body; with "
                        "model.shared_backbone=true the critic is a head on the actor, so leave it null")
            # No effect (documented, not warned: the built-in task's recipe sets it for every algorithm) without a
            # critic, or with several learner ranks, which train a separate critic (learner/value_head.py).
        return
    if not e.id.strip():
        c.error("env.id", e.id, "must be a gymnasium id such as CartPole-v1, or null for an LLM run")
    for key in ("num_envs", "segment_length", "num_minibatches"):
        c.positive(f"env.{key}", getattr(e, key))
    c.choice("env.vectorization", e.vectorization, C.ENV_VECTORIZATION)
    c.optional_positive("env.max_episode_steps", e.max_episode_steps)
    c.positive("env.obs_clip", e.obs_clip)
    c.positive("env.reward_scale", e.reward_scale)
    c.optional_positive("env.reward_clip", e.reward_clip)
    transitions = cfg.rollout.rollout_batch_size * e.num_envs * e.segment_length
    if e.num_minibatches > 0 and transitions % e.num_minibatches:
        c.error("env.num_minibatches", e.num_minibatches, f"must divide the {transitions} transitions of a step "
                "(rollout.rollout_batch_size x env.num_envs x env.segment_length)")
    if a.adv_estimator != "gae" or a.use_critic is False:
        c.error("algorithm.adv_estimator", a.adv_estimator, "embodied runs use gae with a critic")
    if m.shared_backbone and a.loss_type != "actor_critic":
        c.error("model.shared_backbone", True, "needs algorithm.loss_type=actor_critic (one loss over the shared trunk)")
    c.choice("model.activation", m.activation, C.ACTIVATIONS)
    if not m.hidden_sizes or min(m.hidden_sizes) < 1:
        c.error("model.hidden_sizes", list(m.hidden_sizes), "needs at least one layer, every size >= 1")
    if cfg.cluster.train_gpus > 1:
        c.error("cluster.train_gpus", cfg.cluster.train_gpus, "embodied runs train on one device (0 or 1)")
    if a.off_policy_correction == "tis":
        c.error("algorithm.off_policy_correction", "tis", "embodied runs allow none or decoupled (no engine mismatch)")


def check_config(cfg: AsyncPPOConfig) -> tuple[list[str], list[str]]:
    """Return ``(errors, warnings)`` without raising; each error names key, value and what is allowed."""
    c = Checks()
    for part in (check_algorithm, _check_rollout, _check_model_data, _check_trainer, check_cluster, _check_env,
                 check_text_env, check_lora):
        part(cfg, c)
    return c.errors, c.warnings


def resolve_derived(cfg: AsyncPPOConfig) -> AsyncPPOConfig:
    """Fill every "null / 0 means derived" option with its explicit value, in place. Idempotent.

    * ``algorithm.clip_ratio_low`` / ``clip_ratio_high``: ``pg_clip``
    * ``algorithm.loss_agg_norm_length``: ``rollout.response_length``
    * ``algorithm.use_critic``: ``adv_estimator == "gae"``
    * ``algorithm.ppo_mini_batch_size`` 0: ``rollout.rollout_batch_size / algorithm.ppo_num_mini_batches`` (the
      whole batch when that is 0)
    * ``rollout.prompts_per_call`` 0: ``rollout.rollout_batch_size``
    * ``rollout.max_staleness`` / ``admission_lookahead`` ``auto``: the start value, ``rollout.window_auto`` says
      which knobs the tuner moves (validate_window.py); ``rollout.sync_every`` ``auto``: 1 with
      ``rollout.sync_auto`` set (the learner's push cadence, learner/push_cadence.py)
    * ``rollout.admission_lookahead`` null: ``rollout.max_staleness``
    * ``cluster.advertise_address`` null: ``cluster.bind_address`` (``auto`` stays ``auto``: both are decided in the
      learner actor at launch, launch/addresses.py)
    """
    a, r = cfg.algorithm, cfg.rollout
    if a.clip_ratio_low is None:
        a.clip_ratio_low = a.pg_clip
    if a.clip_ratio_high is None:
        a.clip_ratio_high = a.pg_clip
    if a.loss_agg_norm_length is None:
        a.loss_agg_norm_length = r.response_length
    if a.use_critic is None:
        a.use_critic = a.adv_estimator == "gae"
    if a.ppo_mini_batch_size == 0:
        a.ppo_mini_batch_size = mini_batch_prompts(cfg)
    if r.prompts_per_call == 0:
        r.prompts_per_call = r.rollout_batch_size
    resolve_window(cfg)  # "auto": its start (before the lookahead's null, which an auto k keeps tied)
    if r.admission_lookahead is None:
        r.admission_lookahead = r.max_staleness
    resolve_env_concurrency(cfg)  # after the lookahead: the window it sizes
    resolve_agent(cfg)
    if cfg.cluster.advertise_address is None:
        cfg.cluster.advertise_address = cfg.cluster.bind_address
    return cfg


def validate_config(cfg: AsyncPPOConfig) -> list[str]:
    """Check ``cfg``; raise :class:`ConfigError` listing every problem, else resolve derived defaults in place
    and return the warnings (legal but probably unintended combinations)."""
    errors, warnings = check_config(cfg)
    if errors:
        raise ConfigError(errors)
    resolve_derived(cfg)
    return warnings
