"""Mixture-of-experts weights: the learner's fused expert tensors, renamed to the per-expert checkpoint layout.

Why: transformers 5 keeps a MoE layer's experts as two fused 3-D parameters (Qwen2-MoE, Qwen3-MoE, Mixtral...):
``<layer>.mlp.experts.gate_up_proj`` of shape ``[experts, 2 * intermediate, hidden]`` (gate rows first, then up)
and ``<layer>.mlp.experts.down_proj`` of shape ``[experts, hidden, intermediate]``, and a push carries the learner's
``state_dict()`` names. ``save_pretrained`` reverts that fusion on disk, so the checkpoint a vLLM engine loaded
(and validates pushes against) names every expert on its own: ``<layer>.mlp.experts.<e>.gate_proj.weight``,
``.up_proj.weight`` and ``.down_proj.weight``, each 2-D. :func:`to_checkpoint_names` turns the first form into the
second (views: no copy) where, and only where, the checkpoint has the per-expert names and not the fused ones, so
a dense model's push and a fused checkpoint's push pass through unchanged.

Measured on ``builtin:tiny-moe`` (8 experts, 2 layers): a push then loads into vLLM 0.32 on CPU and the engine's
log-probs equal transformers' with the pushed weights (tests/component/test_moe_push.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import re

import torch

FUSED_GATE_UP = "experts.gate_up_proj"
FUSED_DOWN = "experts.down_proj"


def _split_fused(name: str, t: torch.Tensor, known) -> Iterator[tuple[str, torch.Tensor]] | None:
    """Per-expert ``(name, tensor)`` pairs for one fused expert tensor, or None when ``name`` is not one the
    checkpoint (``known``: a container of its names) stores per expert."""
    if name.endswith(FUSED_GATE_UP) and t.dim() == 3:
        prefix = name[: -len("gate_up_proj")]
        if f"{prefix}0.gate_proj.weight" not in known or t.shape[1] % 2:
            return None
        half = t.shape[1] // 2
        return ((f"{prefix}{e}.{part}.weight", t[e, lo:lo + half]) for e in range(t.shape[0])
                for part, lo in (("gate_proj", 0), ("up_proj", half)))
    if name.endswith(FUSED_DOWN) and t.dim() == 3:
        prefix = name[: -len("down_proj")]
        if f"{prefix}0.down_proj.weight" not in known:
            return None
        return ((f"{prefix}{e}.down_proj.weight", t[e]) for e in range(t.shape[0]))
    return None


def to_checkpoint_names(named_tensors: Iterable[tuple[str, torch.Tensor]], known
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """``named_tensors`` with every fused expert tensor that ``known`` (the checkpoint's names) stores per expert
    replaced by its per-expert pieces; every other pair unchanged (validation stays the engine's)."""
    for name, t in named_tensors:
        pieces = None if name in known else _split_fused(name, t, known)
        if pieces is None:
            yield name, t
        else:
            yield from pieces


_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts\.)(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


def to_model_names(named_tensors: Iterable[tuple[str, torch.Tensor]], model_names
                   ) -> list[tuple[str, torch.Tensor]]:
    """The inverse of :func:`to_checkpoint_names` for a model that keeps fused experts (``model_names``: its state
    dict's names): per-expert checkpoint pieces gathered into the model's fused tensors (gate rows first, then up),
    every other pair unchanged. ValueError naming a fused tensor whose pieces are not all there."""
    out, pieces = [], {}
    for name, t in named_tensors:
        m = None if name in model_names else _PER_EXPERT.match(name)
        fused = m and m["prefix"] + ("down_proj" if m["part"] == "down_proj" else "gate_up_proj")
        if not m or fused not in model_names:
            out.append((name, t))
            continue
        pieces.setdefault(fused, {})[(int(m["e"]), m["part"])] = t
    for fused, got in pieces.items():
        parts = ("down_proj",) if fused.endswith("down_proj") else ("gate_proj", "up_proj")
        n = max(e for e, _ in got) + 1
        missing = [f"{e}.{p}" for e in range(n) for p in parts if (e, p) not in got]
        if missing:
            raise ValueError(f"{fused}: the per-expert pieces are incomplete, missing {missing[:3]} "
                             f"({len(missing)} in all)")
        out.append((fused, torch.stack([torch.cat([got[(e, p)] for p in parts]) for e in range(n)])))
    return out


def is_moe_config(config) -> bool:
    """Whether a transformers config (or its ``to_dict()``) describes a mixture of experts: it names a number of
    routed experts above one (``num_experts``, ``num_local_experts`` or ``n_routed_experts``)."""
    cfg = config if isinstance(config, dict) else config.to_dict()
    return any(int(cfg.get(k) or 0) > 1 for k in ("num_experts", "num_local_experts", "n_routed_experts"))
