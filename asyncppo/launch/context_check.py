"""Launch checks of sequence length against the model and the engine's KV cache, made before Ray starts.

Why here: a ``rollout.prompt_length + rollout.response_length`` beyond the model's context makes vLLM refuse
``max_model_len`` (or transformers silently run positions it never learnt) inside every rollout worker, after
Ray, the learner and the engines have started; and a CPU engine's KV cache (``rollout.kv_cache_gib``, vLLM's
``VLLM_CPU_KVCACHE_SPACE``) smaller than one max-length sequence makes vLLM fail the same way. Here each refusal
names the options in seconds. A cache that holds one sequence but not ``rollout.max_num_seqs`` of them is allowed:
vLLM then decodes fewer at once (it preempts), which is slower, not wrong, and long-tailed batches rarely fill it.
"""

from __future__ import annotations

import json
import os
from typing import Optional

from asyncppo.config.devices import cpu_kv_cache_space_gib, engines_on_gpu
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.memory_plan import DTYPE_BYTES, attention_dims


def _model_config(model_path: str) -> Optional[dict]:
    """The model directory's ``config.json`` (None when there is none to read: a hub id is vLLM's to check)."""
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def kv_bytes_per_token(model_cfg: dict, dtype: str) -> int:
    """Keys and values of one token over every layer: ``2 * layers * kv_heads * head_dim * dtype bytes`` (the
    attention keys only, so a partial config is enough; the memory plan's :class:`ModelShape` says the same)."""
    _, kv_heads, head_dim = attention_dims(model_cfg)
    return 2 * int(model_cfg["num_hidden_layers"]) * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4)


def engine_kv_cache_gib(cfg: AsyncPPOConfig) -> int:
    """The KV cache a CPU vLLM engine gets: ``VLLM_CPU_KVCACHE_SPACE`` when set, else ``rollout.kv_cache_gib``
    rounded up (rollout/vllm_engine.py sets the variable the same way; vLLM reads whole GiB)."""
    env = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    if env and env.strip().isdigit():
        return int(env)
    return cpu_kv_cache_space_gib(cfg.rollout.kv_cache_gib)


def check_sequence_fits(cfg: AsyncPPOConfig, model_path: str) -> None:
    """ValueError naming ``rollout.prompt_length`` / ``rollout.response_length`` when one sequence exceeds the
    model's ``max_position_embeddings``, or ``rollout.kv_cache_gib`` when a CPU vLLM engine's cache cannot hold
    one max-length sequence."""
    model_cfg = _model_config(model_path)
    if model_cfg is None:
        return
    ro = cfg.rollout
    length = ro.prompt_length + ro.response_length
    context = model_cfg.get("max_position_embeddings")
    if context and length > int(context):
        raise ValueError(
            f"rollout.prompt_length + rollout.response_length = {ro.prompt_length} + {ro.response_length} = "
            f"{length} tokens exceeds the context of model.path={cfg.model.path!r} (max_position_embeddings "
            f"{context}); shorten rollout.response_length or use a model with a longer context")
    if ro.engine != "vllm" or engines_on_gpu(cfg):
        return  # GPU engines size their cache from gpu_memory_utilization; vLLM checks that one itself
    if not all(k in model_cfg for k in ("num_attention_heads", "num_hidden_layers", "hidden_size")):
        return  # not a shape this estimate knows (vLLM still checks it when the engine starts)
    need = kv_bytes_per_token(model_cfg, ro.dtype) * length
    have = engine_kv_cache_gib(cfg) * 2**30
    if need > have:
        raise ValueError(
            f"rollout.kv_cache_gib={ro.kv_cache_gib:g} (VLLM_CPU_KVCACHE_SPACE {engine_kv_cache_gib(cfg)} GiB) cannot "
            f"hold one sequence of rollout.prompt_length + rollout.response_length = {length} tokens "
            f"({need / 2**30:.2f} GiB of keys and values for model.path={cfg.model.path!r}); raise "
            "rollout.kv_cache_gib or shorten rollout.response_length")
