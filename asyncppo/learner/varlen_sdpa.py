"""``sdpa_varlen``: attention over packed rows, one causal sdpa call per sequence, for learners without flash-attention.

Why: a packed row (:mod:`asyncppo.learner.packing`) holds several sequences end to end. Through a mask (``sdpa``,
``eager``) attention is computed over the whole row and the cross-sequence part thrown away, so rows there are kept
only as wide as the forward's longest sequence, and the short sequences leave padding behind (pad fraction 0.17 a
step on ``data=long`` on CPU). flash-attention's varlen kernels and flex-attention's block mask avoid that on a GPU;
neither runs a backward on CPU. Here a row is split at its sequence boundaries (where the position ids restart at 0)
and each sequence gets its own ``scaled_dot_product_attention(is_causal=True)``: a row costs the sum of its
sequences' squares in attention, whatever its width, so rows are filled up to the token budget, as under varlen.

The split is ``torch.split`` along the tokens and the outputs are joined with ``torch.cat``, so the backward writes
each gradient once (slicing would allocate a full-size gradient per sequence). A run of one-token sequences (the
padding after a row's last sequence: each padding slot has position 0) needs no kernel: a token attending only to
itself returns its own value.

Measured (docs/benchmarks.md, "Packed learner micro-batches"): the learner alone on ``data=long``'s batches on CPU
12-16% faster than sdpa on rows as wide as the longest sequence, pad fraction 0.000. One kernel call per sequence is
the cost: on many short answers (``data=addition``, 1,024 a step) packing this way is 13-21% slower than the padded
layout, and batching equal lengths into one call (tried: a gather into length order and back) did not make it
faster than padded there and cost ``data=long`` half of its gain (-7% against -14%). So packing stays tied to a
token budget (``algorithm.pack_sequences`` auto), which the long-generation preset sets.

Forwards with a padding mask (the padded layout, generation with a cache) go to transformers' own sdpa unchanged:
:func:`varlen_mask` builds the usual mask exactly when a 2-D padding mask is given, and none for packed rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

NAME = "sdpa_varlen"


def sequence_lengths(position_ids: torch.Tensor) -> list[int]:
    """Lengths of the sequences laid end to end in ``position_ids`` [R, W] read row after row (a sequence starts
    where its position is 0; every row starts one)."""
    flat = position_ids.reshape(-1)
    starts = torch.nonzero(flat == 0).flatten()
    if starts.numel() == 0 or int(starts[0]) != 0:
        raise ValueError("packed position ids must start every row with position 0")
    ends = torch.cat([starts[1:], starts.new_tensor([flat.numel()])])
    return (ends - starts).tolist()


def _runs(lengths: list[int]) -> list[int]:
    """``lengths`` with each run of consecutive one-token sequences merged into one chunk, given as a negative
    length (no kernel: each of its tokens attends only to itself)."""
    out: list[int] = []
    for n in lengths:
        if n == 1 and out and out[-1] < 0:
            out[-1] -= 1
        else:
            out.append(-1 if n == 1 else n)
    return out


def packed_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, position_ids: torch.Tensor,
                     scaling: float | None = None) -> torch.Tensor:
    """Causal attention within each sequence of packed rows. ``query`` [R, Hq, W, D], ``key``/``value``
    [R, Hkv, W, D] (``Hq`` a multiple of ``Hkv``), ``position_ids`` [R, W]; returns [R, W, Hq, D] (transformers'
    attention output layout)."""
    R, Hq, W, D = query.shape
    Hkv = key.shape[1]
    group = Hq // Hkv
    # [1, H, R * W, D]: the rows end to end, so a sequence is one span of the token axis (4-D: sdpa's CPU flash
    # kernel takes nothing else, and falls back to the unfused math path on 3-D input)
    q, k, v = (t.transpose(0, 1).reshape(1, t.shape[1], R * W, t.shape[-1]) for t in (query, key, value))
    chunks = _runs(sequence_lengths(position_ids))
    sizes = [abs(n) for n in chunks]
    outs = []
    for n, qs, ks, vs in zip(chunks, q.split(sizes, 2), k.split(sizes, 2), v.split(sizes, 2)):
        if n < 0:  # one-token sequences: softmax over a single key is 1
            outs.append(vs.repeat_interleave(group, dim=1) if group > 1 else vs)
        else:
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scaling,
                                                       enable_gqa=group > 1))
    out = torch.cat(outs, dim=2)  # [1, Hq, R * W, Dv]
    return out.reshape(Hq, R, W, out.shape[-1]).permute(1, 2, 0, 3).contiguous()


def varlen_attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                             scaling: float | None = None, is_causal: bool | None = None, **kwargs):
    """transformers' attention-interface entry: packed rows (no mask, position ids given, no cache) per sequence;
    anything else through transformers' sdpa."""
    position_ids = kwargs.get("position_ids")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if (attention_mask is not None or position_ids is None or not causal or dropout > 0.0
            or query.shape[2] != key.shape[2] or position_ids.shape[-1] != query.shape[2]):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    return packed_attention(query, key, value, position_ids.expand(query.shape[0], -1), scaling), None


def varlen_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask for ``sdpa_varlen``: none without a padding mask (packed rows: the attention splits them itself),
    else sdpa's."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Make ``sdpa_varlen`` a name transformers accepts for ``attn_implementation`` (idempotent); returns it."""
    AttentionInterface.register(NAME, varlen_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, varlen_mask)
    return NAME


register()
