"""The learner's LoRA actor (peft): adapters to train, the base as the reference, adapters to push, merged exports.

Why each piece (docs/lora.md):

* :func:`lora_actor` wraps the loaded policy with peft's adapters; only they require gradients, so the optimiser
  (learner/ppo.py, trainable parameters only) keeps Adam moments for the adapters alone.
* :class:`AdaptersOff` is the reference policy: the same module run inside peft's ``disable_adapter()``, i.e. the
  base weights, which LoRA never changes, so no second copy of the model is loaded.
* :func:`adapter_tensors` is what a weight push sends: ``<module>.lora_A.weight`` / ``.lora_B.weight`` under the
  checkpoint's module names, and for a parameter adapted whole (``model.lora_target_parameters``: peft's
  ``ParamWrapper``, e.g. fused experts) ``<parameter>.lora_delta``, its update as peft computes it
  (sync/adapter.py merges both on the engine side).
* :class:`LoraExport` writes what checkpoints and ``final/`` hold: the merged model in Hugging Face format (what
  engines and users load as ``model.path``) and the adapter itself in ``adapter/`` (peft format, what a resume
  loads onto the base), so a resumed run continues from the exact adapter, not from a rounded merge.
"""

from __future__ import annotations

import os
import re
from typing import Optional

import torch
from torch import nn

from asyncppo.models.moe_routing import moe_routers
from asyncppo.sync.adapter import LORA_DELTA, adapter_names, merged_weight, updated_weight

ADAPTER_DIR = "adapter"  # inside a checkpoint's actor/ (and final/): the peft adapter a resume loads
_PEFT_PREFIX = "base_model.model."


def lora_config(model_cfg, base: Optional[nn.Module] = None):
    from peft import LoraConfig  # heavy: peft

    targets = list(model_cfg.lora_target_modules)
    if targets == ["all-linear"] and base is not None and moe_routers(base):
        targets = linear_targets(base)
    params = list(getattr(model_cfg, "lora_target_parameters", None) or [])
    return LoraConfig(r=int(model_cfg.lora_rank), lora_alpha=float(model_cfg.lora_alpha),
                      lora_dropout=float(model_cfg.lora_dropout), bias="none",
                      target_modules="all-linear" if targets == ["all-linear"] else targets,
                      target_parameters=params or None)


def linear_targets(base: nn.Module) -> list[str]:
    """``all-linear`` on a mixture of experts: the names of its ``nn.Linear`` layers (attention), without the
    output layer, as peft's ``all-linear`` leaves it out. Why not peft's own: on a mixture of experts it also wraps
    the fused expert tensors and the routers (a ``ParamWrapper`` around 3-D parameters), whose adapters are not
    ``B @ A`` on a checkpoint weight, so neither the engines' merge (sync/adapter.py) nor the merged export could
    apply them (docs/moe.md)."""
    names = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if isinstance(m, nn.Linear)}
    return sorted(names - {"lm_head"})


def _plain_name(name: str) -> str:
    """A module's name in the base model's checkpoint: without peft's prefix and its ``base_layer`` levels (nested
    parameter wrappers add one each)."""
    name = name[len(_PEFT_PREFIX):] if name.startswith(_PEFT_PREFIX) else name
    return re.sub(r"(\.base_layer)+(?=\.|$)", "", name)


def _param_adapters(model: nn.Module):
    """``(checkpoint parameter name, wrapper)`` of every parameter adapted whole (peft's ``ParamWrapper``)."""
    for name, module in model.named_modules():
        if type(module).__name__ == "ParamWrapper" and "default" in getattr(module, "lora_A", {}):
            yield f"{_plain_name(name)}.{module.parameter_name}", module


def _refuse_parameter_adapters(model: nn.Module, model_cfg) -> None:
    """Parameter adapters the push and the export apply are the ones asked for by ``model.lora_target_parameters``;
    one on a router is refused (routing replay and the engines' expert capture read the router as it is)."""
    routers = {id(r.weight) for r in moe_routers(model)}
    wrapped = sorted(name for name, w in _param_adapters(model))
    on_routers = sorted(name for name, w in _param_adapters(model) if id(w.get_param()) in routers)
    if wrapped and not list(getattr(model_cfg, "lora_target_parameters", None) or []):
        raise ValueError(f"model.lora_target_modules={list(model_cfg.lora_target_modules)}: peft adapts "
                         f"{wrapped[:2]} ({len(wrapped)} in all) as parameters (fused experts or routers); name "
                         "parameters in model.lora_target_parameters (e.g. [mlp.experts.gate_up_proj, "
                         "mlp.experts.down_proj]) and linear layers in model.lora_target_modules (all-linear does "
                         "so on a mixture of experts)")
    if on_routers:
        raise ValueError(f"model.lora_target_parameters={list(model_cfg.lora_target_parameters)}: {on_routers[:2]} "
                         "are routers; adapters there are not supported (routing replay and the engines' capture of "
                         "the experts read the router itself): adapt the experts or the attention instead")


def lora_actor(base: nn.Module, model_cfg, adapter_dir: Optional[str] = None) -> nn.Module:
    """``base`` with trainable adapters (its own weights frozen); ``adapter_dir``: a saved adapter to load (resume).

    The adapters' fresh A matrices draw from torch's global generator; a resume restores that generator afterwards
    (learner/checkpoint.py), so a resumed run's random stream is the saved one."""
    from peft import get_peft_model, set_peft_model_state_dict  # heavy: peft

    model = get_peft_model(base, lora_config(model_cfg, base))
    _refuse_parameter_adapters(model, model_cfg)
    if getattr(base, "is_gradient_checkpointing", False):
        # reentrant checkpointing (older transformers' default) passes no gradient to a block whose input needs none
        model.enable_input_require_grads()
    if adapter_dir is not None:
        from safetensors.torch import load_file  # heavy: safetensors

        path = os.path.join(adapter_dir, "adapter_model.safetensors")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"LoRA resume: no adapter at {path!r} (was the checkpoint written with "
                                    "model.lora_rank > 0?)")
        result = set_peft_model_state_dict(model, load_file(path))
        if result.unexpected_keys:
            raise ValueError(f"LoRA resume: {path!r} has tensors this model has no place for: "
                             f"{sorted(result.unexpected_keys)[:3]} (different model.lora_target_modules?)")
    return model


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


class AdaptersOff(nn.Module):
    """The reference policy under LoRA: the adapted actor run with its adapters disabled (the base model).

    The actor is held outside the module tree, so the reference owns no parameters (no optimiser, no checkpoint
    entry, no second copy); it runs without gradients."""

    def __init__(self, adapted: nn.Module):
        super().__init__()
        object.__setattr__(self, "adapted", adapted)

    def forward(self, **kwargs):
        with torch.no_grad(), self.adapted.disable_adapter():
            return self.adapted(**kwargs)


def _lora_layers(model: nn.Module):
    """``(checkpoint module name, A, B, scale)`` of every adapted linear layer, in module order."""
    from peft.tuners.lora import LoraLayer  # heavy: peft

    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and "default" in getattr(module, "lora_A", {}) \
                and type(module).__name__ != "ParamWrapper":  # parameter adapters: _param_adapters
            plain = _plain_name(name)
            yield plain, module.lora_A["default"].weight, module.lora_B["default"].weight, module.scaling["default"]


def adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The push: each adapted layer's A and B (detached, live storage: the fan-out snapshots them), and each
    parameter adapted whole as its update (computed now, in the parameter's layout: sync/adapter.py)."""
    out: dict[str, torch.Tensor] = {}
    for module, a, b, _ in _lora_layers(model):
        name_a, name_b = adapter_names(module)
        out[name_a], out[name_b] = a.detach(), b.detach()
    with torch.no_grad():
        for name, wrapper in _param_adapters(model):
            out[name + LORA_DELTA] = wrapper.get_delta_weight("default").detach()
    return out


def adapter_scale(model_cfg) -> float:
    return float(model_cfg.lora_alpha) / int(model_cfg.lora_rank)


@torch.no_grad()
def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The base model's state dict under its own names with every adapter merged (sync/adapter.py's formula,
    the one the engines apply), computed aside: the live weights are not touched."""
    deltas = {module + ".weight": (a, b, scale) for module, a, b, scale in _lora_layers(model)}
    updates = {name: wrapper.get_delta_weight("default") for name, wrapper in _param_adapters(model)}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.get_base_model().state_dict().items():
        if ".lora_" in name:
            continue
        plain = _plain_name(name)
        if plain in deltas:
            a, b, scale = deltas[plain]
            tensor = merged_weight(tensor, a, b, scale)
        elif plain in updates:  # the receiver's formula (sync/adapter.py)
            tensor = updated_weight(tensor, updates[plain])
        out[plain] = tensor.detach()
    return out


class LoraExport:
    """What checkpoints and ``final/`` save for a LoRA actor: ``save_pretrained(dir)`` writes the merged model in
    Hugging Face format to ``dir`` and the peft adapter to ``dir/adapter``."""

    def __init__(self, model: nn.Module):
        self.model = model

    def save_pretrained(self, directory: str) -> None:
        base = self.model.get_base_model()
        merged = merged_state_dict(self.model)
        if getattr(base.config, "tie_word_embeddings", False):
            merged.pop("lm_head.weight", None)  # written once, as the embedding it is tied to
        from safetensors.torch import save_file  # heavy: safetensors

        os.makedirs(directory, exist_ok=True)
        save_file({k: v.contiguous() for k, v in merged.items()}, os.path.join(directory, "model.safetensors"),
                  metadata={"format": "pt"})
        base.config.save_pretrained(directory)
        if getattr(base, "generation_config", None) is not None:
            base.generation_config.save_pretrained(directory)
        self.model.save_pretrained(os.path.join(directory, ADAPTER_DIR))
