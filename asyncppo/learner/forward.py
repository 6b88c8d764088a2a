"""Forward passes over a :class:`TrainBatch`: per-token log-probs, entropy and values of the response tokens.

Why the forwards trim: a batch is padded to its longest prompt and its longest response, and with long-tailed
lengths that longest response is many times the typical one. Each forward therefore runs only on the columns this
(micro-)batch actually uses, from its first prompt token to the end of its longest response, and pads the outputs
back to the batch's width (padded positions are masked everywhere they are used). Combined with micro-batches of
similar lengths (:func:`asyncppo.learner.batch.micro_batches` sorts by length), the learner's cost follows the real
token count instead of ``rows x longest``. Left-padding columns are masked keys, so removing them changes nothing
but the work; the results are the same up to float summation order.

A batch with ``pack_capacity`` set (``algorithm.pack_sequences``) runs its forwards packed instead: its sequences
end to end in rows without padding (:mod:`asyncppo.learner.packing`), outputs gathered back to the same ``[B, T]``
layout, so everything downstream is unchanged.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from asyncppo.algo import entropy_from_logits, logprobs_from_logits
from asyncppo.learner.batch import TrainBatch
from asyncppo.learner.packing import pack_rows, packed_slots, unpack
from asyncppo.models.moe_routing import NO_EXPERT, RoutingRecorder, hooks_of


def used_columns(batch: TrainBatch) -> tuple[int, int]:
    """``[lo, hi)``: the columns holding any token of this batch (first prompt column to longest response end)."""
    used = batch.attention_mask.any(dim=0)
    lo = int(used.nonzero()[0, 0]) if bool(used.any()) else 0
    # the response's extent from the attention mask: a multi-turn sample's response_mask is 0 on its environment
    # tokens, so its sum would fall short of where the sample's last model token sits
    longest = int(batch.response_extents().max()) if batch.size else 0
    lo = min(lo, batch.prompt_len - 1)  # the logit predicting the first response token sits at column P - 1
    return lo, batch.prompt_len + max(1, longest)


def _pad_back(x: torch.Tensor, batch: TrainBatch) -> torch.Tensor:
    """``x`` [B, t, ...] for the response columns this batch uses, as [B, T, ...] with zeros at every padded
    response position: the same values whatever rows a (micro-)batch or chunk happened to group together."""
    missing = batch.response_len - x.shape[1]
    if missing > 0:
        x = torch.cat([x, x.new_zeros((x.shape[0], missing, *x.shape[2:]))], dim=1)
    mask = batch.response_mask.to(x.dtype)
    return x * mask.view(*mask.shape, *([1] * (x.dim() - 2)))


def forward_footprint(batch: TrainBatch) -> tuple[int, int]:
    """``(slots, real tokens)`` of the forward run on this batch: packed rows x their width, or the padded rows x the
    columns the trimmed forward keeps. ``1 - real / slots`` is its padded-token fraction (``perf/pad_fraction``)."""
    real = int(batch.attention_mask.sum())
    if batch.pack_capacity:
        return packed_slots(batch.attention_mask.sum(dim=1).tolist(), batch.pack_capacity), real
    lo, hi = used_columns(batch)
    return batch.size * (hi - lo), real


def _position_versions(batch: TrainBatch) -> Optional[torch.Tensor]:
    """``[B, P + T]``: the weights version under which the engine computed each position (its routing record): a
    prompt's prefill ran at the first response token's version, response position ``t`` produced token ``t + 1``."""
    if batch.token_versions is None:
        return None
    T = batch.response_len
    idx = (torch.arange(batch.input_ids.shape[1], device=batch.token_versions.device) - batch.prompt_len + 1)
    return batch.token_versions[:, idx.clamp(0, max(T - 1, 0))]


def _routing(model: nn.Module, batch: TrainBatch, layout):
    """The forward's routing replay (models/moe_routing.py): the engine's records laid out like the forward's input
    by ``layout`` (columns of the padded batch, or the packed rows), for a model with routing hooks and a batch with
    records; a no-op otherwise (a dense model, the reference, ``algorithm.routing_replay=off``)."""
    hooks = hooks_of(model)
    if hooks is None or batch.routed_experts is None:
        return contextlib.nullcontext()
    versions = _position_versions(batch)
    return hooks.replaying(layout(batch.routed_experts, NO_EXPERT),
                           None if versions is None else layout(versions, -1))


@torch.no_grad()
def record_routing(model: nn.Module, batch: TrainBatch, chunk_rows: int, max_tokens: int = 0) -> torch.Tensor:
    """The experts ``model``'s own routers choose at every position of ``batch``: int16 ``[B, P + T, layers, top_k]``
    in the batch's layout, :data:`NO_EXPERT` on padding (``algorithm.routing_replay=learner``: the proximal
    policy's routing, which the update's forwards then replay). Forwards in eval mode over chunks of rows sorted by
    length, at most ``chunk_rows`` rows and ``max_tokens`` tokens (rows x the chunk's longest) each, as the other
    no-grad passes (:func:`chunked`), each trimmed to its columns, logits of the last position only."""
    recorder = RoutingRecorder(model)
    L, K = recorder.shape.layers, recorder.shape.top_k
    out = torch.full((*batch.input_ids.shape, L, K), NO_EXPERT, dtype=torch.int16, device=batch.input_ids.device)
    order, lengths = _length_order(batch)
    order = order.to(batch.input_ids.device)
    was_training = model.training
    model.eval()
    try:
        for start, end in chunk_bounds(lengths, chunk_rows, max_tokens):
            rows = order[start:end]
            part = batch.select(rows)
            lo, hi = used_columns(part)
            model(input_ids=part.input_ids[:, lo:hi], attention_mask=part.attention_mask[:, lo:hi],
                  position_ids=part.position_ids[:, lo:hi], use_cache=False, logits_to_keep=1)
            chosen = recorder.take().view(rows.numel(), hi - lo, L, K).to(torch.int16)
            real = part.attention_mask[:, lo:hi].bool()[..., None, None]
            out[rows, lo:hi] = torch.where(real, chosen, torch.full_like(chosen, NO_EXPERT))
    finally:
        recorder.remove()
        model.train(was_training)
    return out


def _packed_outputs(model: nn.Module, batch: TrainBatch, temperature: float, hidden: bool):
    """:func:`_response_outputs` through one packed forward (no attention mask: see asyncppo.learner.packing)."""
    packed = pack_rows(batch, batch.pack_capacity)
    with _routing(model, batch, packed.gather):
        out = model(input_ids=packed.input_ids, attention_mask=None, position_ids=packed.position_ids,
                    use_cache=False, output_hidden_states=hidden)
    logits = unpack(out.logits, packed, batch.response_mask).float() / temperature
    return logits, (unpack(out.hidden_states[-1], packed, batch.response_mask) if hidden else None)


def _response_outputs(model: nn.Module, batch: TrainBatch, temperature: float, hidden: bool):
    if batch.pack_capacity:
        return _packed_outputs(model, batch, temperature, hidden)
    lo, hi = used_columns(batch)
    with _routing(model, batch, lambda values, fill: values[:, lo:hi]):
        out = model(
            input_ids=batch.input_ids[:, lo:hi],
            attention_mask=batch.attention_mask[:, lo:hi],
            position_ids=batch.position_ids[:, lo:hi],
            use_cache=False,
            output_hidden_states=hidden,
        )
    P = batch.prompt_len
    logits = _pad_back(out.logits[:, P - 1 - lo : hi - 1 - lo, :].float() / temperature, batch)
    if not hidden:
        return logits, None
    # the last entry is the final (normalised) hidden state the LM head reads: the state before each response token
    return logits, _pad_back(out.hidden_states[-1][:, P - 1 - lo : hi - 1 - lo, :], batch)


def response_logits(model: nn.Module, batch: TrainBatch, temperature: float) -> torch.Tensor:
    """Logits that predict each response token, divided by the sampling temperature: [B, T, V] (zeros at padded
    response positions)."""
    return _response_outputs(model, batch, temperature, hidden=False)[0]


def policy_forward(
    model: nn.Module, batch: TrainBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Returns (logprobs [B,T], entropy [B,T] or None, logits [B,T,V])."""
    labels = batch.input_ids[:, batch.prompt_len : batch.prompt_len + batch.response_len]
    logits = response_logits(model, batch, temperature)
    logprobs = logprobs_from_logits(logits, labels)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy, logits


def policy_value_forward(
    model: nn.Module, head: nn.Module, batch: TrainBatch, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """One actor forward for a critic that shares the actor's body (:class:`~asyncppo.learner.value_head.
    SharedValueHead`): (logprobs, entropy or None, logits, values), values read from the same hidden states."""
    labels = batch.input_ids[:, batch.prompt_len : batch.prompt_len + batch.response_len]
    logits, hidden = _response_outputs(model, batch, temperature, hidden=True)
    logprobs = logprobs_from_logits(logits, labels)
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs, entropy, logits, _pad_back(head(hidden), batch)


def value_forward(critic: nn.Module, batch: TrainBatch) -> torch.Tensor:
    """V(s_t) for the state before each response token t: [B, T]."""
    if batch.pack_capacity:
        packed = pack_rows(batch, batch.pack_capacity)
        values = critic(packed.input_ids, attention_mask=None, position_ids=packed.position_ids)
        return unpack(values.float(), packed, batch.response_mask)
    lo, hi = used_columns(batch)
    values = critic(batch.input_ids[:, lo:hi], attention_mask=batch.attention_mask[:, lo:hi],
                    position_ids=batch.position_ids[:, lo:hi])
    P = batch.prompt_len
    return _pad_back(values[:, P - 1 - lo : hi - 1 - lo].float(), batch)


# One float32 copy of a no-grad chunk's logits may take this much; the forward holds about three such copies at its
# peak (the float32 logits, their temperature-scaled and masked copies, the log-softmax). Rows alone do not bound it:
# 256 rows of 64 tokens over Qwen2.5's 151,936-token vocabulary are 9.3 GiB a copy, which ran one H100 out of memory
# beside an engine (docs/benchmarks.md, "Self-test"). With a small vocabulary the row count is the bound, as before.
# Packed rows filled to the budget (flex or flash attention) are as wide as algorithm.max_tokens_per_micro_batch
# whatever the chunk holds, so there the larger of the two bounds the logits.
NO_GRAD_LOGITS_GIB = 1.0


def logits_token_budget(model: nn.Module) -> int:
    """Tokens per no-grad forward whose float32 logits fit :data:`NO_GRAD_LOGITS_GIB`; 0 (no bound) when the model
    does not say its vocabulary size."""
    vocab = int(getattr(getattr(model, "config", None), "vocab_size", 0) or 0)
    return max(1, int(NO_GRAD_LOGITS_GIB * (1 << 30)) // (vocab * 4)) if vocab > 0 else 0


def chunk_bounds(lengths: list[int], chunk_rows: int, max_tokens: int = 0) -> list[tuple[int, int]]:
    """``[start, end)`` chunks over rows sorted by ascending length: at most ``chunk_rows`` rows each, and with
    ``max_tokens > 0`` at most that many tokens counted as rows x the chunk's longest row (a trimmed forward's
    width). A row longer than ``max_tokens`` is a chunk of its own."""
    bounds, start, rows = [], 0, max(chunk_rows, 1)
    for i, length in enumerate(lengths):
        if i > start and (i - start >= rows or (max_tokens > 0 and (i - start + 1) * length > max_tokens)):
            bounds.append((start, i))
            start = i
    if start < len(lengths):
        bounds.append((start, len(lengths)))
    return bounds


def _within_response(batch: TrainBatch, part: torch.Tensor) -> torch.Tensor:
    """1 where ``part``'s column holds a token of its row's response (model or environment token), 0 on the padding
    after it, shaped to broadcast over ``part``: a chunk's outputs then do not depend on which rows it held (a
    forward gives padded positions whatever the zeroed logits say, ``-log V`` for log-probs, but only up to its
    own width)."""
    extent = batch.response_extents().unsqueeze(1).to(part.device)
    inside = torch.arange(part.shape[1], device=part.device).unsqueeze(0) < extent
    return inside.to(part.dtype).view(*inside.shape, *([1] * (part.dim() - 2)))


def _length_order(batch: TrainBatch) -> tuple[torch.Tensor, list[int]]:
    lengths = batch.attention_mask.sum(dim=1)
    order = torch.argsort(lengths, stable=True)
    return order, lengths[order].tolist()


def count_chunks(batch: TrainBatch, chunk_rows: int, max_tokens: int = 0) -> int:
    """How many forwards :func:`chunked` runs on this batch (ranks of a sharded model agree on the most)."""
    return len(chunk_bounds(_length_order(batch)[1], chunk_rows, max_tokens))


@torch.no_grad()
def chunked(fn, batch: TrainBatch, chunk_rows: int, max_tokens: int = 0, forwards: int = 0) -> torch.Tensor:
    """Apply a no-grad forward of per-response-token outputs (``[rows, T, ...]``) in chunks of at most
    ``chunk_rows`` rows and ``max_tokens`` tokens (bounded activation and logits memory) and return ``[B, T, ...]``
    in the batch's order. Chunks are formed from rows sorted by length, so that each forward trims to its own
    longest row, and each chunk's response columns are narrowed to its own longest response, so that its outputs
    are as wide as that and not as the whole batch's longest (``_pad_back`` pads to the batch it is given).
    ``forwards``: run at least this many forwards, the extra ones on one row with their output dropped, because
    every rank of a sharded model must make the same number of calls."""
    order, lengths = _length_order(batch)
    order = order.to(batch.input_ids.device)
    out, bounds = None, chunk_bounds(lengths, chunk_rows, max_tokens)
    for start, end in bounds:
        rows = order[start:end]
        chunk = batch.select(rows)
        part = fn(chunk.narrowed())  # [rows, width, ...]: per-token outputs of the response
        if out is None:
            out = part.new_zeros((batch.size, batch.response_len, *part.shape[2:]))
        out[rows, : part.shape[1]] = part * _within_response(chunk, part)
    for _ in range(forwards - len(bounds)):
        fn(batch.select(order[:1]).narrowed())
    return out
