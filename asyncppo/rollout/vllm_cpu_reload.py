"""A cheaper in-place weight load for an in-process vLLM engine on CPU (tensor parallel size 1, unquantized).

Why: every push reloads the engine's weights between two decode steps, and on ``data=reverse`` (a push every second
step, ~100 a run) vLLM's ``reload_weights`` cost 13.6 ms standalone and 21.7 ms p50 inside a launch for the
0.5M-parameter model: ~2.2 s of engine time in a ~20 s run, on a task where the engine with its reloads is about as
slow as the learner (docs/benchmarks.md, "data=reverse on its own work"). Profiled, most of it is the layerwise
reload's bookkeeping (every module restored to meta tensors, weight loaders wrapped and their arguments bound
through ``inspect``, kernel tensors copied back), built for online quantisation and CUDA-graph address stability,
neither of which an unquantized CPU model needs. The weights themselves load in ~1.2 ms through the model's own
``load_weights``; only oneDNN's packed copy of each linear layer (``create_onednn_mm``: it packs the weight, so an
in-place copy does not reach it) has to be rebuilt, ~3.3 ms for all of them.

So, once: every layer whose weight vLLM's CPU path packed away (an empty ``weight`` beside a ``cpu_linear``) gets
back a real weight parameter of its checkpoint layout, with its original weight loader, from the metadata vLLM
recorded at load time for its own reloads. Then each push: ``model.load_weights`` copies the tensors in place
(fusing q/k/v and gate/up as at start-up), and the packed copy is rebuilt for exactly the layers whose weight
received data, with the weight kept (vLLM's own CPU dispatch, ``remove_weight=False``). The cost is one unpacked
copy of each linear weight, which the CPU engine (a correctness target, small models) can afford.

A mixture of experts: the pushed experts are repacked for vLLM's CPU MoE kernel (:mod:`.vllm_cpu_moe`); vLLM's
own reload would leave them stale, so an expert push that cannot take this path is refused.

Anything unexpected while setting up (no recorded metadata, a layer shape that differs) makes :func:`fast_load`
return False before a tensor is touched, and the engine keeps vLLM's ``reload_weights`` for good.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from .vllm_cpu_moe import MoEPushUnsupported, load_experts, split_experts

log = logging.getLogger("asyncppo.rollout")

_STATE = "_asyncppo_cpu_reload"  # the model attribute holding this module's per-model state


class _Unsupported(RuntimeError):
    pass


class _CpuReload:
    """The packed linear layers of one model, given their weights back (see the module docstring)."""

    def __init__(self, model: torch.nn.Module):
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO
        from vllm.model_executor.model_loader.reload.meta import materialize_meta_tensor
        from vllm.model_executor.model_loader.reload.sanitize import restore_layer_refs

        self.model = model
        self.linear = [m for m in model.modules() if hasattr(m, "cpu_linear") and isinstance(
            getattr(m, "weight", None), torch.Tensor)]
        restored = []
        for layer in self.linear:
            if layer.weight.numel() > 0:
                continue  # the weight was kept (an output layer, an embedding): loads in place as it is
            info = LAYERWISE_INFO.get(layer)
            meta = info.restore_metadata[0].get("weight") if info is not None else None
            if meta is None or meta.dim() != 2:
                raise _Unsupported(f"no recorded layout for the packed weight of {type(layer).__name__}")
            restored.append((layer, restore_layer_refs(meta, layer)))
        for layer, meta in restored:  # only once every layer had its layout
            weight = materialize_meta_tensor(meta)
            weight.zero_()  # overwritten by the first push before use: the packed copy serves until then
            layer.weight = weight
        # loads copy in place and the rebuild keeps each weight, so the parameters stay these objects from here on
        self.params = dict(model.named_parameters())

    def load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        named_tensors, experts = split_experts(named_tensors)
        if experts:  # the CPU MoE kernel's packed experts: assembled and repacked here (vllm_cpu_moe.py)
            load_experts(self.model, experts)
        loaded = self.model.load_weights(iter(named_tensors))
        if loaded is None:  # a model that does not say what it loaded: rebuild every packed copy
            touched = {id(layer.weight) for layer in self.linear}
        else:
            touched = {id(self.params[n]) for n in loaded if n in self.params}
        for layer in self.linear:
            if id(layer.weight) in touched:
                dispatch_cpu_unquantized_gemm(layer, remove_weight=False)


def _load_on_worker(worker, named_tensors: list) -> bool:
    """Runs inside the (in-process) worker through ``collective_rpc``; False: not supported, nothing touched."""
    model = worker.model_runner.model
    state = getattr(model, _STATE, None)
    if state is None:
        try:
            state = _CpuReload(model)
        except (_Unsupported, ImportError, AttributeError, KeyError) as exc:
            state = False
            log.warning("vllm engine: the fast CPU weight load is not available (%s); using vLLM's reload", exc)
        setattr(model, _STATE, state)
    if state is False:
        if split_experts(named_tensors)[1]:
            raise MoEPushUnsupported("vllm engine: expert weights need the fast CPU load (vLLM's reload_weights "
                                     "leaves the CPU MoE kernel's packed copy stale), which is unavailable here")
        return False
    with torch.no_grad():
        state.load(named_tensors)
    return True


def fast_load(llm, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> bool:
    """Load (a layer-complete, validated subset of) checkpoint-format weights into ``llm`` in place; True when done
    here, False when this engine needs vLLM's ``reload_weights`` instead (nothing was loaded then)."""
    (done,) = llm.collective_rpc(_load_on_worker, args=(list(named_tensors),))
    return bool(done)
