"""The allowed values of every enumerated option, in one place.

Validation (:mod:`asyncppo.config.validate`) checks against these tuples, the docs list them, and the code that
implements each choice (the ``algo/`` registries, the engine factory) can assert at import time that it covers
exactly these names, so that a value accepted here never fails later inside a worker.
"""

from __future__ import annotations

ADV_ESTIMATORS = (
    "gae",
    "grpo",
    "rloo",
    "reinforce",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
)
# Estimators whose baseline comes from the other samples of the same prompt: a group of one sample has no
# baseline (GRPO/REINFORCE++-baseline give a zero advantage, RLOO divides by n - 1 = 0).
GROUP_ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")

LOSS_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("ppo", "gspo", "cispo", "gmpo", "clip_cov", "kl_cov", "reinforce_tis")

# KL estimators; each may carry a '+' suffix (value of the named estimator, gradient of k2: a straight-through
# trick that keeps the estimate unbiased while giving the low-variance k2 gradient).
KL_PENALTIES_BASE = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "full")
KL_PENALTIES = KL_PENALTIES_BASE + tuple(name + "+" for name in KL_PENALTIES_BASE)

KL_CTRL_TYPES = ("fixed", "adaptive")
REWARD_NORMS = (None, "batch", "group", "running")
OFF_POLICY_CORRECTIONS = ("none", "decoupled", "tis")
ROUTING_REPLAY = ("off", "measure", "rollout", "learner")
OFF_POLICY_LEVELS = ("token", "sequence")
OFF_POLICY_TRUNCATIONS = ("clip", "mask", "icepop")
REJECTION_LEVELS = ("none", "token", "sequence")
REJECTION_STATS = ("ratio", "k1", "k2", "k3")

ENGINES = ("vllm", "hf")
GENERATION_MODES = ("continuous", "batch")
INFLIGHT_UPDATES = ("keep", "recompute", "off")
ADMISSION_UNITS = ("slot", "group")
ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")
# float16 training needs loss scaling, which the learner does not implement.
LEARNER_DTYPES = ("float32", "bfloat16")
# model.attn_implementation (null: sdpa_varlen on a CPU learner, transformers' choice on a GPU; learner/models.py);
# flash_* need the flash-attn package, flex a CUDA learner
ATTN_IMPLEMENTATIONS = ("sdpa", "sdpa_varlen", "eager", "flex_attention", "flash_attention_2", "flash_attention_3")
OVERLONG_PROMPT = ("truncate", "skip")
BUILTIN_REWARD_FNS = ("auto", "exact_match", "math")
WANDB_MODES = ("offline", "online", "disabled")
AUTH_MODES = ("auto", "curve", "off")  # cluster.auth (stream/security.py)
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# Embodied runs (env.id set; docs/embodied.md)
LOSS_TYPES = ("actor", "actor_critic")
LR_SCHEDULES = ("constant", "linear")
ENV_VECTORIZATION = ("sync", "async")
ACTIVATIONS = ("tanh", "relu", "elu")

SHARED_DEVICES = ("auto", "cuda", "cpu")  # cluster.shared_device


def admission_room(free_slots: int, n: int, unit: str) -> int:
    """How many groups of ``n`` samples may go into an engine with ``free_slots`` free slots now.

    ``group``: only groups that fit whole, so no sequence ever waits in the engine's queue; but the slots of a group
    come back one by one as its siblings finish, and up to ``n - 1`` of them stay empty until enough are free.
    ``slot``: a group as soon as one slot is free; the engine queues its other samples (at most ``n - 1`` waiting)
    and starts each the moment a slot frees, so the engine stays full while tickets last (the default: measured
    occupancy 0.62 -> 0.90 with 12 slots and groups of 8, docs/benchmarks.md). Used by the rollout worker and by
    the advisor's simulator (report/simulator.py), so both count room alike. A queued sample starts a few steps
    later than its siblings; the tickets, and so the lag bound, are the same either way."""
    if free_slots <= 0:
        return 0
    return free_slots // n if unit == "group" else -(-free_slots // n)
