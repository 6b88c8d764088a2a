"""Loading received weights into a running engine, bucket by bucket, without breaking vLLM's in-place reload.

What vLLM 0.32's ``reload_weights`` accepts (read from ``model_executor/model_loader/reload`` and measured on the
CPU build): every call restores *all* layers to a meta state, loads what it was given, and puts the old kernel
tensors back into layers that received nothing. So a partial set is fine **as long as every vLLM layer receives
all of its checkpoint tensors in the same call**. vLLM fuses checkpoint tensors (``q_proj``/``k_proj``/``v_proj``
into ``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``); a layer that gets only some of them is
"processed" with uninitialised memory for the rest. Measured: one call per tensor turned every greedy token into
token 0, and the engine needed two full reloads to recover. One call per decoder layer (``model.layers.N``) gave
outputs identical to a single full reload.

Hence :class:`LayerGroupLoader`: it holds received tensors until every tensor of a *layer group* (the name up to
its first numeric component, e.g. ``model.layers.3``, else the parent module, e.g. ``lm_head``) has arrived, and
hands complete groups to ``engine.update_weights`` once at least ``flush_bytes`` of them are ready. The header
lists every name first, so completion is known exactly whatever the sender's order. Memory on the receiver stays
near ``flush_bytes`` + one layer + one bucket instead of a whole model.

Tied embeddings (vLLM 0.32, CPU, float32): the output layer keeps its own copy of the embedding matrix, updated
only when the pushed weights contain ``lm_head.weight``. ``named_parameters()`` of a tied transformers model omits
that name (``state_dict()`` keeps it), so the engine would silently keep a stale output layer. Measured: fp32 tied,
pushed without ``lm_head.weight``: logprobs stay those of the old head; with it: they match transformers; bf16
matches either way. :func:`tied_alias_name` detects the case from the model config and dtype, and the loader
adds ``lm_head.weight`` (the embedding tensor itself) to the embedding's group, or refuses with a clear error
when it cannot tell which tensor is the embedding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from asyncppo.sync.broadcast import NamedTensors, WeightReceiver
from asyncppo.sync.layout import Header
from asyncppo.sync.reload_quiet import quiet_reload

EMBED_NAMES = ("model.embed_tokens.weight", "transformer.wte.weight", "model.decoder.embed_tokens.weight")
LM_HEAD_NAME = "lm_head.weight"


class UnsupportedWeightSync(RuntimeError):
    """These weights cannot be loaded into this engine correctly (the message says why and what to change)."""


class WeightLoadingEngine(Protocol):
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...


def layer_group(name: str) -> str:
    """The smallest name prefix that vLLM never splits across layers (see the module docstring)."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return ".".join(parts[:-1]) or name


def _config_dict(config: Any) -> dict:
    if config is None:
        return {}
    if isinstance(config, dict):
        return config
    if isinstance(config, (str, os.PathLike)):
        path = os.path.join(os.fspath(config), "config.json") if os.path.isdir(config) else os.fspath(config)
        with open(path) as f:
            return json.load(f)
    if hasattr(config, "to_dict"):
        d = config.to_dict()
        d.setdefault("tie_word_embeddings", getattr(config, "tie_word_embeddings", None))
        return d
    raise TypeError(f"model config must be a dict, a directory / config.json path or a transformers config, "
                    f"got {type(config).__name__}")


def _dtype_name(dtype: Any, cfg: dict) -> str:
    if dtype in (None, "auto"):
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float32"
    if isinstance(dtype, torch.dtype):
        return str(dtype).removeprefix("torch.")
    return {"float": "float32", "fp32": "float32", "half": "float16", "bf16": "bfloat16"}.get(str(dtype), str(dtype))


def tied_alias_name(config: Any, dtype: Any, device: str = "cpu") -> str | None:
    """``"lm_head.weight"`` when the engine needs it pushed explicitly (tied embeddings, fp32, CPU), else None.

    ``config``: the model directory, its config.json, a dict, or a transformers config. A config without
    ``tie_word_embeddings`` counts as tied (the transformers default for most models).
    """
    cfg = _config_dict(config)
    tied = cfg.get("tie_word_embeddings")
    tied = True if tied is None else bool(tied)
    if tied and device == "cpu" and _dtype_name(dtype, cfg) == "float32":
        return LM_HEAD_NAME
    return None


class LayerGroupLoader:
    """Feeds one push into ``engine.update_weights`` in complete layer groups of about ``flush_bytes`` each.

    ``flush_bytes=None`` loads the whole push in one call (simplest, highest memory). ``model_config``/``dtype``
    enable the tied-embedding handling described in the module docstring.
    """

    def __init__(self, engine: WeightLoadingEngine, *, flush_bytes: int | None = 64 << 20, model_config: Any = None,
                 dtype: Any = None, device: str = "cpu"):
        self.engine = engine
        self.flush_bytes = flush_bytes
        self.alias = tied_alias_name(model_config, dtype, device) if model_config is not None else None
        self.calls = 0  # update_weights calls made for the last push
        self._reset()

    def _reset(self) -> None:
        self._remaining: dict[str, int] = {}
        self._group_of: dict[str, str] = {}
        self._partial: dict[str, NamedTensors] = {}
        self._ready: NamedTensors = []
        self._ready_bytes = 0
        self._embed: str | None = None

    def receive(self, receiver: WeightReceiver) -> int:
        """Join the next push on ``receiver`` and load it; return its version."""
        self._reset()
        self.calls = 0
        version, _ = receiver.receive(on_bucket=self.on_bucket, on_header=self.on_header)
        self._flush()
        if self._partial:
            raise RuntimeError(f"push v{version} left layer groups incomplete: {sorted(self._partial)}")
        return version

    def on_header(self, header: Header) -> None:
        names = [m.name for m in header.tensors]
        for n in names:
            g = self._group_of[n] = layer_group(n)
            self._remaining[g] = self._remaining.get(g, 0) + 1
        if self.alias is not None and self.alias not in names:
            embed = next((n for n in EMBED_NAMES if n in names), None)
            if embed is None:
                raise UnsupportedWeightSync(
                    f"the model ties its output layer to its embeddings and runs in float32 on CPU, where vLLM only "
                    f"updates the output layer when {self.alias!r} is pushed; the push has neither {self.alias!r} "
                    f"nor a known embedding name ({', '.join(EMBED_NAMES)}). Push state_dict() (which keeps "
                    f"{self.alias!r}), use untied embeddings, or run the engine in bfloat16.")
            self._embed = embed

    def on_bucket(self, named: NamedTensors) -> None:
        for name, t in named:
            g = self._group_of[name]
            part = self._partial.setdefault(g, [])
            part.append((name, t))
            if name == self._embed:
                part.append((self.alias, t))
            self._remaining[g] -= 1
            if self._remaining[g] == 0:
                done = self._partial.pop(g)
                self._ready.extend(done)
                self._ready_bytes += sum(x.numel() * x.element_size() for _, x in done)
        if self.flush_bytes is not None and self._ready_bytes >= self.flush_bytes:
            self._flush()

    def _flush(self) -> None:
        if self._ready:
            ready, self._ready, self._ready_bytes = self._ready, [], 0
            self.engine.update_weights(ready)
            self.calls += 1


def receive_into_engine(receiver: WeightReceiver, engine: WeightLoadingEngine, *, flush_bytes: int | None = 64 << 20,
                        model_config: Any = None, dtype: Any = None, device: str = "cpu") -> int:
    """Receive the next push and load it into ``engine`` layer group by layer group; return the version."""
    return LayerGroupLoader(engine, flush_bytes=flush_bytes, model_config=model_config, dtype=dtype,
                            device=device).receive(receiver)


def vllm_reload_weights(llm: Any, named_tensors: Iterable[tuple[str, torch.Tensor]], *,
                        quiet_partial: bool = False) -> None:
    """Load (a layer-complete subset of) checkpoint-format weights into a running ``vllm.LLM`` in place.

    For engines to call from ``update_weights``. The prefix cache is reset because cached KV blocks were computed
    with the old weights. ``quiet_partial`` silences vLLM's per-layer "Failed to load weights" warnings, which a
    deliberate partial load triggers for every layer it does not touch (in-process engines only: a multiprocess
    engine logs from its worker process).
    """
    with quiet_reload(quiet_partial):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(named_tensors)})
    llm.reset_prefix_cache()
