"""Typed configuration for asyncppo: the only place where defaults live.

The options users know from verl / ROLL / RLinf PPO have a field here, but not always under the same
name: the projects disagree among themselves, and several names here follow one of them (``lambd`` and ``pg_clip``
are ROLL's; verl says ``lam`` and ``clip_ratio``, RLinf ``gae_lambda`` and ``ratio_clip_eps``; ``entropy_coef`` is
none of verl's ``entropy_coeff``, ROLL's ``entropy_loss_coef`` or RLinf's ``entropy_bonus``). docs/configuration.md
maps every field to each project's key, checked against a named version of its sources, and
``asyncppo convert`` (:mod:`asyncppo.config.convert`) applies that map to a whole config. Also, not every field
exists in every project, nor every project option here. The dataclasses are registered with Hydra's ConfigStore
(see :mod:`asyncppo.config.store`) so that `configs/config.yaml` and command line overrides are type-checked, and
:func:`asyncppo.config.validate.validate_config` rejects values that are well-typed but meaningless
(``clip_ratio_c <= 1``, ``lambd`` outside [0, 1], ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

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
    overlong_buffer_len: int = 0  # DAPO soft over-length punishment: ramp over the last N tokens; 0 = off
    overlong_penalty_factor: float = 1.0  # the penalty at rollout.response_length tokens
    # responses cut at rollout.response_length (no stop token) leave the policy loss: DAPO's over-long filtering
    # (TRL mask_truncated_completions, ROLL max_len_mask); they still count in their group's reward baseline
    mask_truncated: bool = False
    dynamic_sampling: bool = False  # DAPO: skip groups whose rewards are all equal, fill the batch from the stream
    dynamic_sampling_max_skip: int = 0  # groups skipped per step before the rest are trained anyway; 0 = 4 x batch
    # --- policy loss ----------------------------------------------------------------------
    policy_loss: str = "ppo"  # ppo | gspo | cispo | gmpo | clip_cov | kl_cov | reinforce_tis (docs/algorithms.md)
    tis_cap: float = 2.0  # reinforce_tis: cap of the stop-gradient ratio
    clip_cov_ratio: float = 0.0002  # clip_cov: fraction of tokens whose loss is removed
    clip_cov_lb: float = 1.0  # clip_cov: covariance window (lb, ub) the tokens are drawn from
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002  # kl_cov: fraction of tokens (largest covariance) given the |log r| penalty
    kl_cov_coef: float = 1.0  # kl_cov: weight of that penalty
    early_stop_kl: Optional[float] = None  # stop a step's remaining mini-batches once approx_kl exceeds this
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
    # the most measured drift (actor/mismatch_kl) an auto window allows; over it the window shrinks. null: no cap
    offpolicy_budget: Optional[float] = None
    # --- KL -------------------------------------------------------------------------------
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_penalty: str = "low_var_kl"  # kl|k1|abs|mse|k2|low_var_kl|k3|full, each optionally with a '+' suffix
    add_token_level_kl: bool = False
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    # --- optimisation schedule ------------------------------------------------------------
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 0  # prompts (groups) per mini-batch, as in verl; 0 = the whole batch
    ppo_num_mini_batches: int = 0  # with ppo_mini_batch_size 0: split each batch into this many; 0 = one
    micro_batch_size: int = 0  # samples per micro-batch; 0 = whole mini-batch
    max_tokens_per_micro_batch: int = 0  # token budget per micro-batch (overrides micro_batch_size when > 0)
    # forwards on packed rows (sequences end to end, no padding; learner/packing.py): null = on when
    # max_tokens_per_micro_batch > 0, true = always, false = padded forwards
    pack_sequences: Optional[bool] = None
    # --- off-policy correction ------------------------------------------------------------
    off_policy_correction: str = "decoupled"  # none | decoupled | tis
    off_policy_cap: float = 2.0  # truncation cap of the behaviour importance weight
    off_policy_level: str = "token"  # token | sequence: per-token ratio or the sequence's product
    off_policy_truncation: str = "clip"  # clip (cap) | mask (weight 0 above cap) | icepop (0 outside [cap_low, cap])
    off_policy_cap_low: float = 0.5  # icepop's lower bound
    off_policy_normalize: bool = False  # rescale the weights to mean 1 over the batch
    rejection: str = "none"  # none | token | sequence: drop from the loss mask when the statistic leaves [low, high]
    rejection_stat: str = "ratio"  # ratio | k1 | k2 | k3
    rejection_low: float = 0.5
    rejection_high: float = 2.0
    temperature: float = 1.0  # logits are divided by this when log-probs are recomputed
    # MoE policies (docs/moe.md): off | measure (the engine's experts travel, the learner counts where its own differ)
    # | rollout (R3: the learner's actor forwards use the engine's experts) | learner (the update's forwards replay
    # the proximal pass's own routing)
    routing_replay: str = "off"
    # actor: policy loss, critic trained with its own optimiser | actor_critic: one loss, one backward (env runs)
    loss_type: str = "actor"


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
    max_staleness: Union[int, str] = 1  # an int k, or "auto": the learner moves it (config/validate_window.py)
    # admission window j <= max_staleness: tickets are granted j versions ahead (nominal lag <= j); a straggler may be
    # trained later, up to max_staleness, while the learner trains fresher groups (docs/staleness.md). null: = k
    admission_lookahead: Optional[Union[int, str]] = None
    max_staleness_cap: int = 16  # the most an auto k reaches (and the buffer's guard while the window moves)
    # where an auto k / j starts (config/validate_window.py); null: the number a command-line "auto" replaced, else
    # 4 for k and k's start for j. Ignored where the knob is a number (pinned)
    max_staleness_start: Optional[int] = None
    admission_lookahead_start: Optional[int] = None
    tune_every: int = 5  # learner steps between two decisions of the auto window
    window_auto: str = ""  # derived from "auto" above: which knobs the tuner moves ("", k, j, k=j, k,j)
    # learner steps between weight pushes, or "auto": set at every step from the engines' load time against the
    # learner's step time (learner/push_cadence.py); resolved to 1, its start, with sync_auto set
    sync_every: Union[int, str] = 1
    sync_auto: bool = False  # derived from sync_every=auto: the learner sets the push cadence as it runs
    # skip a due push while the previous one is still being taken, if the weights already pushed serve the next
    # batch (pushed >= version - max_staleness); the newest weights go out once it is done (docs/staleness.md)
    coalesce_pushes: bool = False
    dtype: str = "float32"  # engine weights: float32 | bfloat16 | float16
    gpu_memory_utilization: float = 0.5
    kv_cache_gib: float = 1.0  # CPU engines: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = True
    # --- engine parallelism (launch/plan.py): --rollout-gpus N gives N / (TP x PP) engines of TP x PP GPUs each ---
    tensor_parallel_size: int = 1  # vLLM tensor parallelism per engine (TP ranks = processes; rollout/tp_load.py)
    pipeline_parallel_size: int = 1  # vLLM pipeline parallelism per engine: only 1 is supported (validate.py says why)
    # --- how the engine is kept busy (docs/staleness.md, "Weight swaps during generation") ---------------
    generation: str = "continuous"  # continuous: admit a group whenever a slot frees | batch: drain between batches
    max_num_seqs: int = 256  # sequences decoded at once per engine (vLLM max_num_seqs); admission keeps it full
    # slot: a group is admitted once one of its n slots is free (the engine queues the rest and starts each as a
    # slot frees), so slots freed one by one by finished siblings are refilled at once | group: once all n are free
    admission_unit: str = "slot"
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
    # the learner models' attention kernel (actor, critic, reference): null = transformers' choice (sdpa). A packed
    # forward's row width follows it (learner/packing.py): flash_attention_* (varlen) and flex_attention (a block
    # mask, blocks outside every sequence skipped) fill rows up to the token budget; flex_attention needs CUDA
    attn_implementation: Optional[str] = None  # null | sdpa | eager | flex_attention | flash_attention_2 | _3
    # --- LoRA through peft (docs/lora.md): the learner trains adapters only; the reference is the base model with
    # the adapters disabled (no second copy); a weight push sends the adapters, which each engine merges onto its
    # copy of the base weights. One learner rank, LLM runs only.
    lora_rank: int = 0  # 0: off (full fine-tuning)
    lora_alpha: float = 16.0  # the update is (lora_alpha / lora_rank) * B @ A
    # peft target_modules: module name suffixes, or ["all-linear"] (every linear layer but the output layer)
    lora_target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    lora_dropout: float = 0.0  # on the adapters' input in training forwards (> 0: no single-pass steps)
    # peft target_parameters: parameters adapted whole, e.g. a mixture of experts' fused expert tensors
    # [mlp.experts.gate_up_proj, mlp.experts.down_proj] (docs/moe.md); a push sends their merged update
    lora_target_parameters: list[str] = field(default_factory=list)
    # --- embodied runs (env.id set): the MLP actor-critic of asyncppo.models.actor_critic -----------------------------
    shared_backbone: bool = False  # one trunk with policy and value heads (needs algorithm.loss_type=actor_critic)
    hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    activation: str = "tanh"  # tanh | relu | elu
    init_log_std: float = 0.0  # continuous actions: initial log standard deviation of the Gaussian


@dataclass
class DataConfig:
    """Prompt source: JSONL/Parquet files, or a built-in synthetic task when ``train_files`` is empty."""

    train_files: list[str] = field(default_factory=list)  # empty: the built-in synthetic task
    eval_files: list[str] = field(default_factory=list)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    shuffle: bool = True
    task: str = "addition"  # the built-in synthetic task when train_files is empty: addition, reverse, calculator
    num_eval_prompts: int = 256
    eval_samples: int = 4  # data.eval_files: answers per prompt at the rollout temperature (besides one greedy)
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
    lr_schedule: str = "constant"  # constant | linear (annealed to 0 at trainer.total_steps, after warmup)
    grad_clip: float = 1.0
    total_steps: int = 500
    output_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    seed: int = 0
    eval_every: int = 100  # learner steps between held-out evaluations; 0: start and end only
    # evaluate the starting weights (point 0): the "before" of summary.json. false: a benchmark's timed run, whose
    # round at point 0 holds the engines at version 0 while the learner waits for its first push (docs/benchmarks.md)
    eval_at_start: bool = True
    # also append every trained group (its trajectories, as the stream carries them) to trained_groups.bin beside
    # trained_groups.jsonl: the run's own batches, replayable through the learner alone (python -m
    # asyncppo.bench.limit --replay). Disk: ~8-11 bytes per generated token (~7 MB for 60 steps of data=long)
    save_trained_groups: bool = False
    # learner steps between checkpoints (and one at the end); 0: none, only final/ (weights). 20: a dead learner loses
    # at most 19 steps, for ~0.05 s per checkpoint of the built-in model (docs/reliability.md measures it)
    save_every: int = 20
    keep_checkpoints: int = 2  # newest checkpoints kept under <output_dir>/checkpoints/
    resume_from: Optional[str] = None  # a checkpoint dir or a run dir (its checkpoints/latest); None: start fresh
    # a learner process that died is restarted by the launcher from the latest checkpoint while the rollout workers
    # stay up and reconnect (launch/learner_restart.py); None: on when save_every > 0
    auto_resume: Optional[bool] = None
    max_learner_restarts: int = 3  # learner deaths restarted in one run; one more ends the run with an error
    sft_warmup_steps: int = 300  # supervised warm start of builtin models (cached)
    # torch intra-op threads of each learner rank on CPU (no effect on GPU); ASYNCPPO_LEARNER_THREADS overrides it.
    # 1 leaves the other cores to the engines; the built-in task's recipe takes 2 (its engine needs ~half a core)
    cpu_threads: int = 1
    # A push from several (FSDP2) learner ranks: layer_groups gathers and streams one layer group at a time within
    # weight_push_budget_mb on rank 0; whole gathers the model first and snapshots it (late joiners catch up at once)
    weight_push_gather: str = "layer_groups"  # layer_groups | whole
    weight_push_budget_mb: int = 512
    logger: LoggerConfig = field(default_factory=LoggerConfig)


@dataclass
class ClusterConfig:
    """Placement (GPU/CPU counts), Ray cluster address and the ZeroMQ / torch.distributed ports."""

    rollout_gpus: int = 0
    train_gpus: int = 0
    rollout_workers: int = 1  # CPU rollout actors when rollout_gpus == 0
    # --gpus N: N devices, each shared by one engine (rollout.gpu_memory_utilization of its memory) and one learner
    # rank (the rest); weights move through host shared memory, not NCCL (launch/shared_device.py, sync/shm.py)
    shared_gpus: int = 0
    shared_device: str = "auto"  # shared_gpus > 0: cuda | cpu | auto (cuda when this machine shows an NVIDIA GPU)
    device_memory_gib: float = 0.0  # one device's memory for the shared-mode memory plan; 0: ask nvidia-smi
    cpus_per_worker: float = 1.0
    gpus_per_node: int = 0  # GPUs per machine, for the plan's checks (a TP engine stays on one node); 0: unknown
    address: Optional[str] = None  # join an existing Ray cluster ("auto" or "host:port"); None: start a local one
    # auto: loopback while every Ray node is this machine, else the learner node's address (launch/addresses.py)
    bind_address: str = "auto"
    advertise_address: Optional[str] = None  # what workers connect to; null/auto: the bind address (node's if wildcard)
    trajectory_port: int = 0  # 0: pick a free port
    control_port: int = 0
    admission_port: int = 0
    sync_port: int = 0
    stream_hwm: int = 64
    max_message_mb: int = 256
    timeout_s: float = 600.0
    auth: str = "auto"  # ZeroMQ CURVE: auto (on when bind_address is not loopback), curve (always), off
    max_tickets_per_worker: int = 0  # tickets one worker connection may hold; 0: 2 * (groups it asks for) + 2
    # each free ticket to the waiting worker holding fewest (max-min fair, staleness/fairness.py); false: arrival order
    fair_tickets: bool = True
    logprob_tolerance: float = 0.01  # largest behaviour log-prob accepted (float rounding above 0)
    max_worker_restarts: int = 3  # rollout-worker deaths (and hangs) replaced within worker_restart_window_s
    # the window max_worker_restarts counts over: one death more within it ends the run with an error; sporadic
    # deaths hours apart never add up, a crash loop does within minutes (launch/restart_budget.py). null: the run
    worker_restart_window_s: Optional[float] = 3600.0
    # a rollout worker with no decode step, no group and no answer to a control ping for this long is hung: killed
    # and replaced like a dead one (launch/hang.py). null: auto, from the learner's measured step time with a floor
    # (config/deadlines.py: max(60 s, 10 x median step seconds), at most timeout_s)
    hang_timeout_s: Optional[float] = None
    # a worker past its start-up that answers no control ping at all for this long, while the learner and the other
    # workers answer every few seconds, is hung (stopped, or wedged holding its interpreter; launch/hang.py); at most
    # hang_timeout_s. null: no such rule, silence waits for hang_timeout_s
    silent_timeout_s: Optional[float] = 15.0
    # deadline of each weight push per worker; a worker that misses it is retired from the weight sync and replaced
    # as hung, while the others are served. null: hang_timeout_s (resolved as above)
    push_timeout_s: Optional[float] = None
    # on Ctrl-C or SIGTERM (a scheduler's preemption), how long the learner gets to finish its step and write a
    # checkpoint before everything stops (0: stop at once); keep it under the scheduler's kill grace period
    stop_grace_s: float = 60.0
    # extra Ray resources every learner / rollout bundle asks for (e.g. {learner_node: 1}): pins roles to nodes
    learner_resources: dict[str, float] = field(default_factory=dict)
    rollout_resources: dict[str, float] = field(default_factory=dict)


@dataclass
class EnvConfig:
    """Embodied runs (docs/embodied.md): gymnasium environments instead of prompts. ``id: null`` is an LLM run."""

    id: Optional[str] = None  # a gymnasium id, e.g. CartPole-v1 or HalfCheetah-v5
    num_envs: int = 4  # environments per rollout worker (one gymnasium vector env)
    segment_length: int = 128  # env steps per environment in one segment (the unit a ticket admits)
    num_minibatches: int = 4  # mini-batches per epoch over the step's transitions (CleanRL's num_minibatches)
    vectorization: str = "sync"  # sync | async (one subprocess per environment)
    max_episode_steps: Optional[int] = None  # None: the environment's registered limit
    normalize_obs: bool = False  # running mean/std of observations, carried in the policy's weights
    obs_clip: float = 10.0
    normalize_reward: bool = False  # divide rewards by the running std of the discounted return (learner side)
    reward_scale: float = 1.0  # constant factor on rewards before any normalisation
    reward_clip: Optional[float] = None  # clip scaled rewards to [-c, c]
    kwargs: dict[str, Any] = field(default_factory=dict)  # passed to gymnasium.make
    # Text environments (docs/environments.md; run by asyncppo.envs.episode_worker when text_env is set):
    text_env: Optional[str] = None  # dotted class path of a per-episode text environment, e.g. my_pkg.envs.MyEnv
    text_env_config: dict[str, Any] = field(default_factory=dict)  # the environment's env_config (skyrl-gym's)
    max_turns: int = 4  # model turns per episode at most
    # environment calls running at once per rollout worker (plain methods: a thread pool; coroutine methods: one event
    # loop); 0: auto, the episodes one worker may hold, (j + 1) * B * n, at most 256 (AUTO_ENV_CONCURRENCY_MAX)
    max_concurrency: int = 0
    step_timeout_s: float = 30.0  # deadline of one init/step call; past it the episode is handled per on_error
    on_error: str = "zero_reward"  # drop | zero_reward: what a raising, hung or malformed environment costs
    max_tokens_per_turn: Optional[int] = None  # model tokens per turn at most (None: what the episode budget leaves)
    # Agent programs (docs/agents.md): pkg.module:function, `async def agent(client, row) -> reward | dict`, trained
    # through an OpenAI-compatible endpoint on each rollout worker (sets text_env to the agent adapter)
    agent: Optional[str] = None
    reward_fn: Optional[str] = None  # pkg.module:function(transcript, row) -> reward, when the agent returns none
    agent_host: str = "127.0.0.1"  # the endpoint's address (a bearer key is always required)
    agent_port: int = 0  # 0: a free port per worker
    agent_max_body_bytes: int = 4194304  # larger request bodies are refused with 413
    # a call that rewrites the agent's history: final (a new branch; the episode trains its last branch) | refuse (409)
    agent_branches: str = "final"


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
    env: EnvConfig = field(default_factory=EnvConfig)
    extra: dict[str, Any] = field(default_factory=dict)
