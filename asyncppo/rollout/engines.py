"""Building a rollout engine by name: the one module that knows every backend.

Why apart from :mod:`asyncppo.rollout.engine`: the backends import the interface and its types from there, so the
factory that imports the backends must sit one floor up, or the two modules import each other. The backend modules
are imported here at once (they need only torch); each imports its heavy library - vLLM (optional, slow to import),
transformers - only when an engine of its kind is built.
"""

from __future__ import annotations

from asyncppo.config.devices import engines_on_gpu

from .engine import RolloutEngine
from .hf_engine import HFEngine
from .vllm_engine import VLLMEngine

ENGINE_KINDS = ("vllm", "hf")


def make_engine(
    kind: str,
    model_path: str,
    dtype: str = "float32",
    max_model_len: int = 256,
    seed: int = 0,
    device: str = "cpu",
    **opts,
) -> RolloutEngine:
    """Build a rollout engine. ``kind``: ``"vllm"`` (vLLM, CPU build on CPU) or ``"hf"`` (transformers).

    Extra ``opts`` go to the backend (vLLM: ``kv_cache_gib``, ``enforce_eager``, ``gpu_memory_utilization``,
    ``num_threads``; hf: ``batch_size``, ``num_threads``). Options meant for the other backend are ignored by hf.

    Threads: on a few shared cores pass ``num_threads=1``. Measured on 2 busy cores (tiny model, 32x4x64):
    vLLM 3.3k tok/s with 1 thread vs 0.46k with 2; transformers 1.9k vs 1.3k.
    """
    if kind == "vllm":
        return VLLMEngine(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device, **opts)
    if kind == "hf":
        return HFEngine(model_path, dtype=dtype, max_model_len=max_model_len, seed=seed, device=device, **opts)
    raise ValueError(f"unknown engine kind {kind!r}; allowed: {list(ENGINE_KINDS)}")


def worker_engine(cfg, model_path: str, worker_id: int, **extra) -> RolloutEngine:
    """The engine rollout worker ``worker_id`` runs, from the run's config: one place, so that a measurement of the
    engine alone (rollout/engine_alone.py) runs exactly the engine a launch runs. ``extra``: backend options a
    worker subclass adds (e.g. prefix caching for multi-turn episodes)."""
    ro = cfg.rollout
    return make_engine(
        ro.engine, model_path, dtype=ro.dtype, max_model_len=ro.prompt_length + ro.response_length,
        seed=cfg.trainer.seed + 1000 * (worker_id + 1),
        device="cuda" if engines_on_gpu(cfg) else "cpu", kv_cache_gib=ro.kv_cache_gib,
        enforce_eager=ro.enforce_eager, gpu_memory_utilization=ro.gpu_memory_utilization,
        num_threads=max(1, int(cfg.cluster.cpus_per_worker)), max_num_seqs=ro.max_num_seqs,
        **({"tensor_parallel_size": ro.tensor_parallel_size} if ro.tensor_parallel_size > 1 else {}),
        **({"capture_routing": True} if cfg.algorithm.routing_replay in ("measure", "rollout") else {}),
        **extra,
    )
