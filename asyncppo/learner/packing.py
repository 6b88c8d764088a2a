"""Packed forwards: several sequences concatenated into one row, no padding between them.

Why: the padded layout (:mod:`asyncppo.learner.batch`) gives every row of a forward the width of its longest
sequence. Sorting by length and trimming (:mod:`asyncppo.learner.forward`) removes some of that waste, but on
long-tailed lengths a micro-batch filled by token count still holds rows of very different lengths, and the padding
is real work in every layer. Packing lays the valid tokens of a forward end to end in rows (first-fit decreasing),
so a forward processes (almost) only real tokens. How wide the rows are follows the attention kernel
(:func:`pack_capacity`): up to the token budget with varlen attention, as wide as the longest sequence otherwise.

How attention stays inside each sequence: the packed rows are passed with ``attention_mask=None`` and position ids
that restart at 0 for every sequence. transformers (5.x) reads restarting position ids as packed sequences: on
``sdpa`` / ``eager`` it builds a block-diagonal causal mask from them, on ``flex_attention`` a block mask that skips
the blocks outside every sequence, on ``flash_attention_2`` it runs varlen attention with the sequence boundaries
derived from the same position ids (``model.attn_implementation`` picks the kernel). Models whose attention does not
go through transformers' mask utilities (some remote-code models) would attend across boundaries: keep packing off
for them (``algorithm.pack_sequences=false``).

Only the forward is packed. Its per-token outputs are gathered back into the batch's ``[B, T]`` layout, so the
losses, their masks and their normalisation (the mini-batch's global counts) are exactly those of the padded path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from asyncppo.config.schema import AlgorithmConfig


PADDED = 0  # no packing: the padded, trimmed forward
ONE_ROW = -1  # every sequence of a forward in one row (varlen attention, no token budget)
LONGEST = -2  # rows as wide as the forward's longest sequence (mask-based attention)


def uses_varlen_attention(model) -> bool:
    """Whether ``model``'s attention costs per sequence rather than per row on a packed row: flash-attention (varlen
    kernels over the boundaries from the position ids) or flex-attention (a block mask built from the same boundaries;
    the blocks outside every sequence are skipped, so a row costs about the sum of its sequences' squares, to within
    a 128-token block), or ``sdpa_varlen`` (one causal sdpa call per sequence, :mod:`asyncppo.learner.varlen_sdpa`)."""
    impl = str(getattr(getattr(model, "config", None), "_attn_implementation", "") or "")
    return impl.startswith("flash") or impl in ("flex_attention", "sdpa_varlen")


def pack_capacity(alg: AlgorithmConfig, varlen: bool) -> int:
    """Tokens per packed row (``PADDED``: forwards stay padded). ``pack_sequences`` null (auto) packs exactly when a
    token budget is set.

    Why the width depends on the attention: with varlen attention (flash-attention) a row's width costs nothing in
    attention, so rows are filled up to the token budget (one row without a budget) and padding all but vanishes.
    Through a block-diagonal mask (sdpa, eager: CPU) attention is computed over the whole row and masked, so a row
    of ``C`` tokens costs ``C`` per token in attention; rows as wide as the forward's longest sequence keep that cost
    what the padded layout pays, while the short sequences fill each other's padding."""
    on = alg.pack_sequences if alg.pack_sequences is not None else alg.max_tokens_per_micro_batch > 0
    if not on:
        return PADDED
    if not varlen:
        return LONGEST
    return alg.max_tokens_per_micro_batch if alg.max_tokens_per_micro_batch > 0 else ONE_ROW


def row_width(lengths: list[int], capacity: int) -> int:
    """The token capacity of the packed rows of sequences of ``lengths`` (at least the longest of them)."""
    if capacity == ONE_ROW:
        return sum(lengths)
    if capacity == LONGEST:
        return max(lengths)
    return max(capacity, max(lengths))


@dataclass
class PackedRows:
    """The packed form of a padded (micro-)batch, and where each response token's predicting position went.

    ``src_row[i, t], src_col[i, t]``: the packed position whose output predicts response token ``t`` of sample ``i``
    (the position before it), valid where the batch's ``response_mask`` is; elsewhere they point at (0, 0)."""

    input_ids: torch.Tensor  # [R, W]
    position_ids: torch.Tensor  # [R, W], restarting at 0 for every sequence (and for every padding slot)
    src_row: torch.Tensor  # [B, T] long
    src_col: torch.Tensor  # [B, T] long
    real_tokens: int
    # [R, W] long: the flat index (row x (P + T) + column) in the padded batch of each packed slot, -1 on padding
    source: Optional[torch.Tensor] = None

    def gather(self, values: torch.Tensor, fill) -> torch.Tensor:
        """Per-position ``values`` ``[B, P + T, ...]`` of the padded batch, laid out as the packed input ``[R, W,
        ...]`` (``fill`` on packed padding): what a per-token input such as the engine's routing needs."""
        flat = values.reshape(-1, *values.shape[2:])
        out = flat[self.source.clamp(min=0)]
        return out.masked_fill((self.source < 0).view(*self.source.shape, *([1] * (out.dim() - 2))), fill)

    @property
    def slots(self) -> int:
        return int(self.input_ids.numel())


def _first_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Sample indices per packed row: longest first, each into the first row with room (a new row otherwise)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    rows: list[list[int]] = []
    free: list[int] = []
    for i in order:
        for r, room in enumerate(free):
            if lengths[i] <= room:
                rows[r].append(i)
                free[r] -= lengths[i]
                break
        else:
            rows.append([i])
            free.append(capacity - lengths[i])
    return rows


def pack_rows(batch, capacity: int, pad_token_id: int = 0) -> PackedRows:
    """Pack the valid tokens (prompt and response) of every row of ``batch`` (a ``TrainBatch``) into rows of
    :func:`row_width` tokens at most."""
    mask = batch.attention_mask.bool()
    lengths = mask.sum(dim=1).tolist()
    prompt_lens = mask[:, : batch.prompt_len].sum(dim=1).tolist()
    rows = _first_fit_decreasing(lengths, row_width(lengths, capacity))
    width = max(sum(lengths[i] for i in row) for row in rows)  # as packed_slots counts it
    device = batch.input_ids.device
    input_ids = torch.full((len(rows), width), pad_token_id, dtype=batch.input_ids.dtype, device=device)
    position_ids = torch.zeros((len(rows), width), dtype=torch.long, device=device)
    start = torch.zeros(batch.size, dtype=torch.long)
    row_of = torch.zeros(batch.size, dtype=torch.long)
    source = torch.full((len(rows), width), -1, dtype=torch.long, device=device)
    columns = batch.input_ids.shape[1]
    for r, members in enumerate(rows):
        col = 0
        for i in members:
            n = lengths[i]
            input_ids[r, col : col + n] = batch.input_ids[i][mask[i]]
            position_ids[r, col : col + n] = torch.arange(n, device=device)
            source[r, col : col + n] = i * columns + torch.nonzero(mask[i], as_tuple=False).squeeze(1)
            row_of[i], start[i] = r, col
            col += n
    # the output predicting response token t of sample i sits at its sequence's position prompt_len_i - 1 + t
    T = batch.response_len
    t = torch.arange(T)
    valid = batch.response_mask.detach().cpu() > 0
    src_col = torch.where(valid, start[:, None] + torch.tensor(prompt_lens)[:, None] - 1 + t, 0)
    src_row = torch.where(valid, row_of[:, None].expand(-1, T), 0)
    return PackedRows(input_ids, position_ids, src_row.to(device), src_col.to(device), int(sum(lengths)), source)


def unpack(x: torch.Tensor, packed: PackedRows, response_mask: torch.Tensor) -> torch.Tensor:
    """Packed outputs ``x`` [R, W, ...] as [B, T, ...]: each response token's predicting position, zero where the
    response is padding (the same convention as the padded forward's outputs)."""
    out = x[packed.src_row, packed.src_col]
    m = response_mask.to(out.dtype)
    return out * m.view(*m.shape, *([1] * (out.dim() - 2)))


def packed_slots(lengths: list[int], capacity: int) -> int:
    """Slots of the packed forward over sequences of ``lengths``: rows x the widest row's fill."""
    rows = _first_fit_decreasing(lengths, row_width(lengths, capacity))
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


def pad_fraction(footprints: list[tuple[int, int]]) -> float:
    """The padded share of all forward slots in ``footprints``, ``(slots, real tokens)`` pairs (0 for none)."""
    slots = sum(s for s, _ in footprints)
    return 0.0 if slots == 0 else 1.0 - sum(r for _, r in footprints) / slots
