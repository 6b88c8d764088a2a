"""Typed configuration for asyncppo: the only place where defaults live.

Every option users know from verl / ROLL / RLinf PPO has a field here under the name those
projects use (see docs/configuration.md for the mapping). The dataclasses are registered with
Hydra's ConfigStore (see :mod:`asyncppo.config.store`) so that `configs/config.yaml` and command
line overrides are type-checked, and :func:`asyncppo.config.validate.validate_config` rejects
values that are well-typed but meaningless (``clip_ratio_c <= 1``, ``lambd`` outside [0, 1], ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

MISSING_FLOAT: Optional[float] = None


@dataclass
class KLControlConfig:
    """KL coefficient controller for KL-in-reward (``algorithm.add_token_level_kl``)."""

    type: str = "fixed"  # fixed | adaptive
    init_kl_coef: float = 0.001
    target_kl: float = 0.1  # adaptive only
    kl_horizon: int = 10000  # adaptive only


@dataclass
class AlgorithmConfig:
    """Advantage estimation, reward shaping and the PPO losses (verl: ``algorithm`` + ``actor``)."""

    # --- advantage estimation -------------------------------------------------------------
    adv_estimator: str = "gae"  # gae | grpo | rloo | reinforce | reinforce_plus_plus | reinforce_plus_plus_baseline
    gamma: float = 1.0
    lambd: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    whiten_advantages: bool = True
    advantage_clip: Optional[float] = None
    # None: resolved to ``adv_estimator == "gae"`` (only GAE reads values); True with another estimator trains
    # a critic nobody uses (allowed, warned); False with gae is an error.
    use_critic: Optional[bool] = None
    # --- reward shaping -------------------------------------------------------------------
    reward_clip: Optional[float] = None
    reward_norm: Optional[str] = None  # batch | group | running | null
    reward_shift: bool = False  # normalisation subtracts the mean only
    reward_scale: bool = False  # normalisation divides by the std only
    # --- policy loss ----------------------------------------------------------------------
    pg_clip: float = 0.2
    clip_ratio_low: Optional[float] = None  # defaults to pg_clip
    clip_ratio_high: Optional[float] = None  # defaults to pg_clip
    dual_clip_loss: bool = False
    clip_ratio_c: float = 3.0
    entropy_coef: float = 0.0
    loss_agg_mode: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean | seq-mean-token-sum-norm
    loss_agg_norm_length: Optional[int] = None  # seq-mean-token-sum-norm divisor; defaults to rollout.response_length
    # --- value loss -----------------------------------------------------------------------
    value_clip: Optional[float] = 0.5
    huber_delta: Optional[float] = None  # None: squared error; a float: Huber loss with this delta
    vf_coef: float = 0.5
    # --- KL -------------------------------------------------------------------------------
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_penalty: str = "low_var_kl"  # kl|k1|abs|mse|k2|low_var_kl|k3|full, each optionally with a '+' suffix
    add_token_level_kl: bool = False
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # --- optimisation schedule ------------------------------------------------------------
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 0  # prompts (groups) per mini-batch, as in verl; 0 = the whole batch
    micro_batch_size: int = 0  # samples per micro-batch; 0 = whole mini-batch
    max_tokens_per_micro_batch: int = 0  # token budget per micro-batch (overrides micro_batch_size when > 0)
    # --- off-policy correction ------------------------------------------------------------
    off_policy_correction: str = "decoupled"  # none | decoupled | tis
    off_policy_cap: float = 2.0  # truncation cap of the behaviour importance weight
    temperature: float = 1.0  # logits are divided by this when log-probs are recomputed


@dataclass
class SamplingConfig:
    """Per-request sampling parameters of the rollout engine (vLLM ``SamplingParams`` names)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    seed: Optional[int] = None


@dataclass
class RolloutConfig:
    """Generation, batch shape and the asynchrony bounds (staleness, weight-sync cadence)."""

    engine: str = "vllm"  # vllm | hf
    rollout_batch_size: int = 16  # prompts per learner step
    num_return_sequences_in_group: int = 8
    prompt_length: int = 64
    response_length: int = 16
    overlong_prompt: str = "truncate"  # truncate | skip
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    max_staleness: int = 1
    sync_every: int = 1
    dtype: str = "float32"  # engine weights: float32 | bfloat16 | float16
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0  # CPU engines: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = True
    # --- how the engine is kept busy (docs/staleness.md, "Weight swaps during generation") ---------------
    generation: str = "continuous"  # continuous: admit a group whenever a slot frees | batch: drain between batches
    max_num_seqs: int = 256  # sequences decoded at once per engine (vLLM max_num_seqs); admission keeps it full
    inflight_update: str = "keep"  # keep | recompute | off: what a weight push does to sequences in flight
    prompts_per_call: int = 0  # generation=batch: groups per batch (weights load between batches); 0 = rollout_batch_size
    reward_fn: str = "auto"  # auto | exact_match | math | a dotted path "pkg.module:function"
    weight_bucket_mb: int = 64


@dataclass
class ModelConfig:
    """Which weights the policy, critic and reference start from."""

    path: str = "builtin:tiny-addition"  # a local HF directory, or builtin:<name> (built locally and cached)
    critic_path: Optional[str] = None  # None: initialise the critic from the policy
    ref_path: Optional[str] = None  # None: the initial policy
    dtype: str = "float32"  # learner compute dtype on GPU: bfloat16 | float32
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    """Prompt source: JSONL/Parquet files, or a built-in synthetic task when ``train_files`` is empty."""

    train_files: list[str] = field(default_factory=list)  # empty: the built-in synthetic task
    eval_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    shuffle: bool = True
    task: str = "addition"  # the built-in synthetic task when train_files is empty
    num_eval_prompts: int = 256
    seed: int = 0


@dataclass
class LoggerConfig:
    """Metric sinks; wandb defaults to offline so that runs never need the network."""

    console: bool = True
    jsonl: bool = True
    wandb: bool = True
    wandb_mode: str = "offline"  # offline | online | disabled
    wandb_project: str = "asyncppo"
    wandb_run_name: Optional[str] = None
    log_every: int = 1


@dataclass
class TrainerConfig:
    """Optimiser, schedule, run length and the output directory."""

    lr: float = 1e-4
    critic_lr: float = 1e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0
    grad_clip: float = 1.0
    total_steps: int = 500
    output_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0
    eval_every: int = 100  # learner steps between held-out evaluations; 0: start and end only
    save_every: int = 0  # learner steps between checkpoints (and one at the end); 0: none, only final/ (weights)
    keep_checkpoints: int = 2  # newest checkpoints kept under <output_dir>/checkpoints/
    resume_from: Optional[str] = None  # a checkpoint dir or a run dir (its checkpoints/latest); None: start fresh
    sft_warmup_steps: int = 300  # supervised warm start of builtin models (cached)
    logger: LoggerConfig = field(default_factory=LoggerConfig)


@dataclass
class ClusterConfig:
    """Placement (GPU/CPU counts), Ray cluster address and the ZeroMQ / torch.distributed ports."""

    rollout_gpus: int = 0
    train_gpus: int = 0
    rollout_workers: int = 1  # CPU rollout actors when rollout_gpus == 0
    cpus_per_worker: float = 1.0
    address: Optional[str] = None  # join an existing Ray cluster ("auto" or "host:port"); None: start a local one
    bind_address: str = "127.0.0.1"
    advertise_address: Optional[str] = None  # what workers connect to; defaults to bind_address
    trajectory_port: int = 0  # 0: pick a free port
    control_port: int = 0
    admission_port: int = 0
    sync_port: int = 0
    stream_hwm: int = 64
    max_message_mb: int = 256
    timeout_s: float = 600.0


@dataclass
class AsyncPPOConfig:
    """The whole run. Build it with :func:`asyncppo.config.load_config`, which also validates it and fills
    the derived defaults (``clip_ratio_low/high``, ``loss_agg_norm_length``, ``prompts_per_call``, ...)."""

    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    extra: dict[str, Any] = field(default_factory=dict)
