"""LoRA adapters in a weight push, and their merge into an engine's weights (docs/lora.md).

Why the engine merges instead of serving the adapters with vLLM's LoRA support: a merged engine runs the plain
model, so both engines (vLLM and transformers) take the same checkpoint-format tensors through the same
``update_weights`` they already have, at no per-token cost, with the in-place reload, the TP staging, the version
labels and the in-flight policy (keep / recompute / off) unchanged. vLLM's LoRA path would need ``enable_lora`` with
a maximum rank fixed at start-up, an adapter per request (a request in flight keeps the adapter it started with, so
``inflight_update`` could not swap it) and, in vLLM 0.32, an adapter written to disk per push.

What travels: for every adapted linear layer ``<module>`` (a checkpoint name such as ``model.layers.3.self_attn.
q_proj``), ``<module>.lora_A.weight`` [r, in] and ``<module>.lora_B.weight`` [out, r]; nothing else. The receiver
keeps the base weights ``W0`` of the layer groups it adapts (read once from the model's safetensors) and hands the
engine ``W = W0 + scale * B @ A`` for each adapted layer, plus the group's untouched base tensors, because vLLM
reloads a layer group only when it receives all of it (sync/engine_load.py). Every push merges onto ``W0``, never
onto the previous merge, so no error accumulates. ``scale = lora_alpha / lora_rank``, the same on both sides.

Parameters adapted whole (``model.lora_target_parameters``: peft's parameter adapters, e.g. a mixture of experts'
fused expert tensors ``[experts, out, in]``) travel as their update: ``<parameter>.lora_delta``, the tensor peft's
own ``get_delta_weight`` computes, the size of the parameter (the experts' low-rank factors are laid out per expert
inside peft, so the learner sends the product it defines rather than a second copy of that layout). The receiver
renames a fused expert update into the checkpoint's per-expert names where the checkpoint has those
(sync/expert_names.py) and hands ``W0 + delta`` for each.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from asyncppo.sync.engine_load import WeightLoadingEngine, layer_group
from asyncppo.sync.expert_names import to_checkpoint_names

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
LORA_DELTA = ".lora_delta"  # a parameter adapted whole: its update, the parameter's shape


def adapter_names(module: str) -> tuple[str, str]:
    """The push names of ``module``'s two adapter matrices (``module``: the checkpoint name without ``.weight``)."""
    return module + LORA_A, module + LORA_B


def split_adapter_name(name: str) -> tuple[str, str]:
    """``(module, "A" | "B")`` of a push name; ValueError for a name that is not an adapter matrix."""
    for suffix, which in ((LORA_A, "A"), (LORA_B, "B")):
        if name.endswith(suffix) and len(name) > len(suffix):
            return name[: -len(suffix)], which
    raise ValueError(f"{name!r} is not a LoRA adapter tensor (names end with {LORA_A!r} or {LORA_B!r})")


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W0 + scale * B @ A`` in ``dtype`` (default ``W0``'s), computed in float32 (peft's own merge order)."""
    delta = (b.to(torch.float32) @ a.to(torch.float32)) * scale
    return (base.to(torch.float32) + delta).to(dtype or base.dtype)


def updated_weight(base: torch.Tensor, update: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``W0 + update`` (a parameter adapted whole) in ``dtype`` (default ``W0``'s), added in float32."""
    return (base.to(torch.float32) + update.to(torch.float32)).to(dtype or base.dtype)


def adapter_numel(shapes: dict[str, tuple[int, ...]], rank: int, modules: Iterable[str]) -> int:
    """Parameters of rank-``rank`` adapters on ``modules`` given the base weights' ``shapes``: r * (in + out) each."""
    return sum(rank * (shapes[m + ".weight"][0] + shapes[m + ".weight"][1]) for m in modules)


def _split_push(named_tensors: Iterable[tuple[str, torch.Tensor]]
                ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, torch.Tensor]]:
    """``(A/B pairs by module, updates by parameter)`` of a push."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    deltas: dict[str, torch.Tensor] = {}
    for name, t in named_tensors:
        if name.endswith(LORA_DELTA) and len(name) > len(LORA_DELTA):
            deltas[name[: -len(LORA_DELTA)]] = t
            continue
        module, which = split_adapter_name(name)
        pairs.setdefault(module, {})[which] = t
    lone = sorted(m for m, p in pairs.items() if len(p) != 2)
    if lone:
        raise ValueError(f"LoRA push: {lone[:3]} came with only one of lora_A / lora_B ({len(lone)} in all)")
    return pairs, deltas


class AdapterMerger:
    """Stands in front of an engine's ``update_weights``: takes adapter tensors, gives the engine merged weights.

    ``base_path``: the base model directory the engine started from (its ``*.safetensors``); only the layer groups
    that receive adapters are read, once, on the first push, and kept on the CPU.
    """

    def __init__(self, engine: WeightLoadingEngine, base_path: str, scale: float):
        self.engine, self.base_path, self.scale = engine, str(base_path), float(scale)
        self._files = sorted(Path(self.base_path).glob("*.safetensors"))
        if not self._files:
            raise FileNotFoundError(f"LoRA merge: no *.safetensors base weights in {self.base_path!r}")
        self._names: dict[str, str] = {}  # checkpoint tensor name -> the file holding it
        self._groups: dict[str, list[str]] = {}  # layer group -> its checkpoint names (read with the index)
        self._base: dict[str, torch.Tensor] = {}  # the kept base tensors of the adapted layer groups
        self.merges = 0  # update_weights calls handed to the engine

    def _index(self) -> None:
        from safetensors import safe_open  # heavy: safetensors

        for f in self._files:
            with safe_open(str(f), framework="pt") as fh:
                self._names.update({k: str(f) for k in fh.keys()})
        for n in self._names:
            self._groups.setdefault(layer_group(n), []).append(n)

    def _base_groups(self, groups: set[str]) -> dict[str, list[str]]:
        """The checkpoint names of every group in ``groups``, loading those not kept yet."""
        from safetensors import safe_open  # heavy: safetensors

        members = {g: self._groups.get(g, []) for g in sorted(groups)}
        need: dict[str, list[str]] = {}
        for names in members.values():
            for n in names:
                if n not in self._base:
                    need.setdefault(self._names[n], []).append(n)
        for f, names in need.items():
            with safe_open(f, framework="pt") as fh:
                for n in names:
                    self._base[n] = fh.get_tensor(n)
        return members

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        pairs, deltas = _split_push(named_tensors)
        if not pairs and not deltas:
            return
        if not self._names:
            self._index()
        deltas = dict(to_checkpoint_names(deltas.items(), self._names))  # fused experts: per expert, as stored
        unknown = sorted([m for m in pairs if m + ".weight" not in self._names]
                         + [n for n in deltas if n not in self._names])
        if unknown:
            raise KeyError(f"LoRA push: no base weight for {unknown[:3]} in {self.base_path!r}")
        members = self._base_groups({layer_group(m + ".weight") for m in pairs} | {layer_group(n) for n in deltas})
        out: list[tuple[str, torch.Tensor]] = []
        for names in members.values():
            for n in names:
                module = n[: -len(".weight")] if n.endswith(".weight") else None
                if n in deltas:
                    w0, delta = self._base[n], deltas[n]
                    if tuple(delta.shape) != tuple(w0.shape):
                        raise ValueError(f"LoRA push: the update of {n} has shape {tuple(delta.shape)}, the base "
                                         f"weight {tuple(w0.shape)}")
                    out.append((n, updated_weight(w0, delta, torch.promote_types(w0.dtype, torch.float32))))
                elif module in pairs:
                    a, b = pairs[module]["A"], pairs[module]["B"]
                    w0 = self._base[n]
                    if a.dim() != 2 or b.dim() != 2 or (b.shape[0], a.shape[1]) != tuple(w0.shape) \
                            or a.shape[0] != b.shape[1]:
                        raise ValueError(f"LoRA push: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                                         f"which do not make the base weight's {tuple(w0.shape)}")
                    # float32 out: the engine casts once to its own dtype (a bf16 W0 under an fp32 engine keeps
                    # the adapter's precision)
                    out.append((n, merged_weight(w0, a, b, self.scale, dtype=torch.promote_types(w0.dtype,
                                                                                                  torch.float32))))
                else:
                    out.append((n, self._base[n]))
        self.engine.update_weights(out)
        self.merges += 1
