"""Step-level (streaming) generation for the transformers backend: the :class:`StreamingEngine` half of ``HFEngine``.

Design: one transformers ``DynamicCache`` for the running batch, left-padded, with a ``[rows, width]`` attention
mask; it holds the keys/values of prompt + tokens-so-far except each row's newest token. A step feeds every
cached row its newest token (one decode forward) and prefills newly admitted rows in a second forward
(left-padded prompt, ``position_ids`` from the mask as ``transformers.generate`` builds them, last-position
logits only); their caches are then left-padded to a common width and concatenated. Finished rows are dropped
with an index select, and columns that became padding in every row are trimmed.

Weight updates: by default the cached keys/values of in-flight sequences (computed under the old weights) are
kept; :meth:`recompute_inflight` drops the cache so the next step re-prefills every running sequence under the
current weights. ``kv_cache=False`` keeps no cache at all and re-runs the whole prefix every step (slower, and
the plainest reference): there every step already recomputes, ``recompute_inflight`` is a no-op and "keep"
behaves as "recompute".

Sampling reproduces the warpers used by the one-shot ``generate`` (``TemperatureLogitsWarper`` ->
``TopKLogitsWarper`` -> ``TopPLogitsWarper``, on float32 logits); the behaviour log-prob is the log-softmax of
that processed distribution at the sampled token. Greedy (temperature < ``GREEDY_EPS``) takes the argmax and
reports the unscaled (temperature 1) log-prob. A group with ``spec.seed`` draws sample ``j`` from its own
``torch.Generator`` seeded with ``seed + j``, so its tokens do not depend on what else is in the batch; groups
without a seed share one engine generator seeded from the engine seed.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from asyncppo.models.moe_routing import RoutingRecorder

from .engine import Completion, FinishedGroup, SamplingSpec, check_sampling_args
from .routing_record import finished, record_first

GREEDY_EPS = 1e-5  # temperatures below this are greedy (as in vLLM); same constant as hf_engine


@dataclass
class _Group:
    key: str
    prompt: list[int]
    spec: SamplingSpec
    stops: frozenset
    results: list  # Optional[Completion] per sample
    remaining: int


@dataclass
class _Seq:
    group: _Group
    index: int  # sample index j within the group
    generator: Optional[torch.Generator]  # None: the engine's shared generator
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    versions: list = field(default_factory=list)
    routing: Optional[np.ndarray] = None  # int16 [positions so far (grown), layers, top_k] (capture_routing), -1 none


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Float32 ``[B, V]`` logits -> the scores sampled from, exactly as transformers' warpers compute them."""
    scores = logits / float(temperature)
    if top_k > 0:
        k = min(int(top_k), scores.size(-1))
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(scores, descending=False)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cum <= (1 - top_p)
        remove_sorted[..., -1:] = 0  # keep at least one token
        remove = remove_sorted.scatter(1, sorted_idx, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


class HFStreamingMixin:
    """Adds the :class:`StreamingEngine` methods to ``HFEngine``. The host provides ``model``, ``device``,
    ``pad_token_id``, ``eos_token_id``, ``max_model_len`` and ``seed``, and calls :meth:`_init_streaming`."""

    def _init_streaming(self, max_num_seqs: int, kv_cache: bool = True, capture_routing: bool = False) -> None:
        if not isinstance(max_num_seqs, int) or max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs!r} must be an int >= 1")
        # MoE routing replay: the experts every router chose, per position of every streamed sequence
        self._routing = RoutingRecorder(self.model) if capture_routing else None
        self.num_experts = self._routing.shape.num_experts if self._routing is not None else 0
        self.max_num_seqs = max_num_seqs
        self.kv_cache = bool(kv_cache)
        self._groups: dict[str, _Group] = {}  # unfinished groups, in add order
        self._waiting: deque[_Seq] = deque()
        self._running: list[_Seq] = []  # the first ``_num_cached`` rows are the rows of ``_cache``, in order
        self._weight_version = 0
        self._stream_gen: Optional[torch.Generator] = None  # created on first unseeded sample
        self._drop_cache()

    def _drop_cache(self) -> None:
        self._cache = None  # transformers DynamicCache: keys/values of prompt + tokens[:-1] of each cached row
        self._cache_mask: Optional[torch.Tensor] = None  # [rows, width] 1 = real token, 0 = left padding
        self._num_cached = 0

    # ------------------------------------------------------------------ queueing
    def add_group(self, key: str, prompt_ids: Sequence[int], spec: SamplingSpec) -> None:
        """Queue ``spec.n`` samples of one prompt; never runs the model. Errors name the offending value."""
        prompt = [int(t) for t in prompt_ids]
        check_sampling_args([prompt], spec.n, spec.max_tokens, spec.temperature, spec.top_p, spec.top_k,
                            self.max_model_len)
        if key in self._groups:
            raise ValueError(f"group key {key!r} is already in flight")
        eos = [] if spec.ignore_eos else [int(self.eos_token_id)]
        stops = frozenset(eos + [int(t) for t in spec.stop_token_ids])
        group = _Group(key, prompt, spec, stops, [None] * spec.n, spec.n)
        self._groups[key] = group
        for j in range(spec.n):
            gen = None
            if spec.seed is not None:
                gen = torch.Generator(device=self.device).manual_seed(int(spec.seed) + j)
            self._waiting.append(_Seq(group, j, gen))

    def num_unfinished_seqs(self) -> int:
        return len(self._running) + len(self._waiting)

    def set_weight_version(self, version: int) -> None:
        self._weight_version = int(version)

    def recompute_inflight(self) -> None:
        """Drop the KV cache: the next :meth:`step` re-prefills every running sequence (prompt + tokens so far)
        under the current weights. With ``kv_cache=False`` this is a no-op: that mode keeps no cache and
        recomputes every prefix at every step, so after :meth:`update_weights` in-flight sequences already
        continue as if re-prefilled ("keep" behaves as "recompute")."""
        self._drop_cache()

    def abort_all(self) -> list[str]:
        """Drop every unfinished group (running or waiting) and return their keys in add order."""
        keys = list(self._groups)
        self._groups.clear()
        self._waiting.clear()
        self._running.clear()
        self._drop_cache()
        return keys

    # ------------------------------------------------------------------ decoding
    def _engine_generator(self) -> torch.Generator:
        if self._stream_gen is None:
            self._stream_gen = torch.Generator(device=self.device).manual_seed((self.seed * 1_000_003 + 7) % (2**31))
        return self._stream_gen

    @torch.no_grad()
    def _prefill(self, seqs: list[_Seq], use_cache: bool):
        """One forward pass over the left-padded prompt + generated tokens of ``seqs``: float32 ``[B, V]``
        last-position logits, and (``use_cache``) the resulting cache and its ``[B, width]`` attention mask."""
        rows = [s.group.prompt + s.tokens for s in seqs]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), int(self.pad_token_id), dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, width - len(r) :] = torch.tensor(r, dtype=torch.long)
            attn[i, width - len(r) :] = 1
        pos = (attn.cumsum(-1) - 1).masked_fill(attn == 0, 0)
        attn = attn.to(self.device)
        out = self.model(
            input_ids=ids.to(self.device),
            attention_mask=attn,
            position_ids=pos.to(self.device),
            use_cache=use_cache,
            logits_to_keep=1,
        )
        if self._routing is not None:
            taken = self._routing.take().view(len(rows), width, *self._routing_shape())
            for s, r, chosen in zip(seqs, rows, taken):
                self._record(s, 0, chosen[width - len(r) :].cpu().numpy())
        return out.logits[:, -1, :].float(), (out.past_key_values if use_cache else None), attn

    @torch.no_grad()
    def _decode(self, seqs: list[_Seq]) -> torch.Tensor:
        """Feed each cached row its newest token (the cache holds everything before it); ``[B, V]`` logits."""
        last = torch.tensor([[s.tokens[-1]] for s in seqs], dtype=torch.long)
        pos = torch.tensor([[len(s.group.prompt) + len(s.tokens) - 1] for s in seqs], dtype=torch.long)
        mask = torch.cat([self._cache_mask, self._cache_mask.new_ones((len(seqs), 1))], dim=1)
        out = self.model(
            input_ids=last.to(self.device),
            attention_mask=mask,
            position_ids=pos.to(self.device),
            past_key_values=self._cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._cache, self._cache_mask = out.past_key_values, mask
        if self._routing is not None:
            taken = self._routing.take().cpu().numpy()
            for s, chosen in zip(seqs, taken):
                self._record(s, len(s.group.prompt) + len(s.tokens) - 1, chosen[None])
        return out.logits[:, -1, :].float()

    def _routing_shape(self) -> tuple[int, int]:
        return self._routing.shape.layers, self._routing.shape.top_k

    def _record(self, s: _Seq, start: int, chosen: np.ndarray) -> None:
        """A forward's choices for positions ``start...`` of ``s`` (first record wins: rollout/routing_record.py)."""
        s.routing = record_first(s.routing, start, chosen)

    def _routed(self, s: _Seq) -> Optional[np.ndarray]:
        """A finished sequence's record over prompt + response."""
        if self._routing is None:
            return None
        return finished(s.routing, len(s.group.prompt) + len(s.tokens), self._routing_shape())

    def _merge_cache(self, cache, mask: torch.Tensor) -> None:
        """Append freshly prefilled rows to the cache, left-padding both to a common width."""
        if self._cache is None:
            self._cache, self._cache_mask = cache, mask
            return
        wa, wb = self._cache_mask.shape[1], mask.shape[1]
        w = max(wa, wb)
        for la, lb in zip(self._cache.layers, cache.layers):
            la.keys = torch.cat([F.pad(la.keys, (0, 0, w - wa, 0)), F.pad(lb.keys, (0, 0, w - wb, 0))], dim=0)
            la.values = torch.cat([F.pad(la.values, (0, 0, w - wa, 0)), F.pad(lb.values, (0, 0, w - wb, 0))], dim=0)
        self._cache_mask = torch.cat([F.pad(self._cache_mask, (w - wa, 0)), F.pad(mask, (w - wb, 0))], dim=0)

    def _select_cache(self, keep: list[int]) -> None:
        """Keep only the cache rows ``keep`` and trim leading columns that are padding in every row."""
        if not keep:
            self._drop_cache()
            return
        idx = torch.tensor(keep, dtype=torch.long, device=self._cache_mask.device)
        mask = self._cache_mask[idx]
        start = int(mask.any(dim=0).long().argmax())  # first column holding a real token in some row
        for layer in self._cache.layers:
            layer.keys = layer.keys[idx, :, start:]
            layer.values = layer.values[idx, :, start:]
        self._cache_mask = mask[:, start:]
        self._num_cached = len(keep)

    def _sample(self, seqs: list[_Seq], logits: torch.Tensor) -> tuple[list[int], list[float]]:
        """Next token and its behaviour log-prob for each row; rows are processed in groups of equal settings."""
        tokens = [0] * len(seqs)
        lps = [0.0] * len(seqs)
        by_setting: dict[tuple, list[int]] = {}
        for i, s in enumerate(seqs):
            sp = s.group.spec
            greedy = sp.temperature < GREEDY_EPS
            setting = (True, 1.0, -1, 1.0) if greedy else (False, float(sp.temperature), int(sp.top_k), float(sp.top_p))
            by_setting.setdefault(setting, []).append(i)
        for (greedy, temp, top_k, top_p), rows in by_setting.items():
            sub = logits[rows]
            if greedy:
                scores = sub
                chosen = scores.argmax(dim=-1)
            else:
                scores = process_logits(sub, temp, top_k, top_p)
                probs = torch.softmax(scores, dim=-1)
                chosen = torch.empty(len(rows), dtype=torch.long, device=scores.device)
                shared = [r for r, i in enumerate(rows) if seqs[i].generator is None]
                if shared:
                    idx = torch.tensor(shared, device=scores.device)
                    chosen[idx] = torch.multinomial(probs[idx], 1, generator=self._engine_generator()).squeeze(1)
                for r, i in enumerate(rows):
                    if seqs[i].generator is not None:
                        chosen[r] = torch.multinomial(probs[r : r + 1], 1, generator=seqs[i].generator)[0, 0]
            lp = torch.log_softmax(scores, dim=-1).gather(1, chosen[:, None]).squeeze(1)
            for r, (t, v) in enumerate(zip(chosen.cpu().tolist(), lp.cpu().tolist())):
                tokens[rows[r]] = int(t)
                lps[rows[r]] = float(v)
        return tokens, lps

    def step(self) -> list[FinishedGroup]:
        """Admit waiting sequences (FIFO) up to ``max_num_seqs``, decode one token for every running sequence,
        and return the groups whose samples have all finished (each exactly once)."""
        while self._waiting and len(self._running) < self.max_num_seqs:
            self._running.append(self._waiting.popleft())
        if not self._running:
            return []
        seqs = self._running
        if not self.kv_cache:
            logits = self._prefill(seqs, use_cache=False)[0]
        else:
            parts = []
            if self._num_cached:
                parts.append(self._decode(seqs[: self._num_cached]))
            if self._num_cached < len(seqs):
                fresh_logits, cache, mask = self._prefill(seqs[self._num_cached :], use_cache=True)
                parts.append(fresh_logits)
                self._merge_cache(cache, mask)
            logits = torch.cat(parts) if len(parts) > 1 else parts[0]
            self._num_cached = len(seqs)
        tokens, lps = self._sample(seqs, logits)
        version = self._weight_version
        still: list[_Seq] = []
        keep: list[int] = []
        finished: list[FinishedGroup] = []
        for row, (s, t, lp) in enumerate(zip(seqs, tokens, lps)):
            s.tokens.append(t)
            s.logprobs.append(lp)
            s.versions.append(version)
            g = s.group
            if t in g.stops:
                reason = "stop"
            elif len(s.tokens) >= g.spec.max_tokens:
                reason = "length"
            else:
                still.append(s)
                keep.append(row)
                continue
            g.results[s.index] = Completion(
                np.asarray(s.tokens, dtype=np.int32),
                np.asarray(s.logprobs, dtype=np.float32),
                reason,
                np.asarray(s.versions, dtype=np.int64),
                self._routed(s),
            )
            g.remaining -= 1
            if g.remaining == 0:
                del self._groups[g.key]
                finished.append(FinishedGroup(g.key, list(g.results)))
        self._running = still
        if self.kv_cache and len(keep) < len(seqs):
            self._select_cache(keep)
        return finished
