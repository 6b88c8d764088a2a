"""A push of experts into an engine whose MoE layers this code cannot repack is refused before anything loads
(rollout/vllm_cpu_moe.py: ``refusal``, which a tensor-parallel rank runs at stage time, so that every rank keeps its
old weights instead of some ranks loading half a push)."""

from __future__ import annotations

import torch

from asyncppo.rollout.vllm_cpu_moe import refusal

EXPERT = "model.layers.0.mlp.experts.0.gate_proj.weight"


def test_a_push_without_experts_is_never_refused():
    assert refusal(torch.nn.Module(), [("model.layers.0.self_attn.q_proj.weight", torch.zeros(2, 2))]) == ""


def test_experts_for_a_layer_the_engine_does_not_have_are_refused_by_name():
    why = refusal(torch.nn.Module(), [(EXPERT, torch.zeros(2, 2))])
    assert "no fused MoE layer" in why and "model.layers.0.mlp.experts" in why


def test_experts_for_another_kernel_are_refused_naming_it():
    class QuantizedExperts:  # a kernel that is not vLLM's unquantized CPU one (a quantized or zentorch layer's)
        pass

    model = torch.nn.Module()
    layer = torch.nn.Module()
    layer.quant_method = type("Method", (), {"moe_kernel": type("Kernel", (), {"fused_experts": QuantizedExperts()})})
    model.add_module("model", torch.nn.Module())
    model.model.add_module("layers", torch.nn.ModuleList([torch.nn.Module()]))
    model.model.layers[0].add_module("mlp", torch.nn.Module())
    model.model.layers[0].mlp.add_module("experts", layer)
    why = refusal(model, [(EXPERT, torch.zeros(2, 2))])
    assert "QuantizedExperts" in why and "not supported" in why
