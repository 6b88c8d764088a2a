"""Mixture-of-experts routing: find a model's routers, read the experts they choose, and make them use given ones.

Why: a router's top-k is a discrete choice, so the engine that sampled a token and the learner that scores it can
send it to different experts (numerics at the same weights, or an older router under the lag). The behaviour and
the learner log-probs then come from different sub-networks. Routing replay (R3) makes the learner's forward use the
experts the engine chose; ``measure`` only counts how often the two disagree (``algorithm.routing_replay``,
docs/moe.md).

How: a transformers MoE block calls its router on the flattened hidden states ``[N, H]`` of the forward (``N`` =
rows x columns, row-major) and the router returns ``(router_logits, weights of the chosen experts, their
indices)``. A forward hook on the router (:class:`RoutingHooks`) sees every call and may replace that output. Replay
swaps in the given indices and reads their weights from the same softmax of the same logits (renormalised as the
model does), so the gradient still reaches the router through the chosen experts' weights. Positions without a
recorded choice (:data:`NO_EXPERT`: padding, a sequence's last token, which the engine never ran) keep the
router's own choice and weights, bit for bit. Hooks survive FSDP wrapping and need no change to the model's code.

Routers are found by what they are, not by class name: a module with ``top_k``, ``num_experts`` and a ``weight`` of
shape ``[num_experts, hidden]`` (transformers 5's Qwen2-MoE and Qwen3-MoE ``TopKRouter``). The engine side reads
the same routers (the transformers engine) or vLLM's own capture hooks (rollout/vllm_routing.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional

import torch
from torch import nn

#: A position with no recorded expert choice (int16 in the learner's tensors; the wire's uint max, stream/routing.py)
NO_EXPERT = -1


@dataclass(frozen=True)
class RoutingShape:
    """What a model's routing record per token looks like: ``layers x top_k`` expert ids below ``num_experts``."""

    layers: int
    top_k: int
    num_experts: int


def moe_routers(model: nn.Module) -> list[nn.Module]:
    """The model's routers in layer order (the order ``modules()`` walks the decoder layers)."""
    found = []
    for m in model.modules():
        w = getattr(m, "weight", None)
        k, e = getattr(m, "top_k", None), getattr(m, "num_experts", None)
        if isinstance(k, int) and isinstance(e, int) and isinstance(w, torch.Tensor) and w.dim() == 2 \
                and w.shape[0] == e and 0 < k <= e:
            found.append(m)
    return found


def routing_shape(model: nn.Module) -> Optional[RoutingShape]:
    """The model's :class:`RoutingShape`, or None for a model without routers (a dense model). Every router must
    have the same top-k and expert count (what a per-token ``layers x top_k`` record assumes)."""
    routers = moe_routers(model)
    if not routers:
        return None
    shapes = {(int(r.top_k), int(r.num_experts)) for r in routers}
    if len(shapes) != 1:
        raise ValueError(f"routing: routers differ in (top_k, num_experts): {sorted(shapes)}; a per-token record "
                         "needs one shape")
    (k, e), = shapes
    return RoutingShape(len(routers), k, e)


def _router_output(module: nn.Module, output, top_k: int):
    """``(logits, weights, indices)`` of a router call, or RuntimeError naming a router of another shape."""
    if not (isinstance(output, tuple) and len(output) == 3) or output[2].dtype not in (torch.int64, torch.int32) \
            or output[2].dim() != 2 or output[2].shape[-1] != top_k:
        raise RuntimeError(f"router {type(module).__name__} does not return (logits, weights, indices [tokens, "
                           f"top_k={top_k}])")
    return output


@dataclass
class _Counts:
    """What the hooks counted since the last :meth:`RoutingHooks.take_metrics` (all tensors on the model's device,
    read once per step)."""

    compared: float = 0.0  # (token, layer) pairs with an engine choice
    differ: float = 0.0  # of which the learner's own top-k set differed
    fresh_compared: float = 0.0  # the same for tokens the engine made with the learner's current weights
    fresh_differ: float = 0.0
    load: Optional[torch.Tensor] = None  # [layers, experts] tokens routed to each expert (the experts used)


class RoutingHooks:
    """Forward hooks on every router of ``model``: replay given experts (``apply``) and count disagreement and
    expert load while :meth:`replaying` is active; outside it the model routes itself, untouched.

    One per model. :meth:`attach` installs them once and keeps them on the model (``model.asyncppo_routing``), so
    the forward code finds them through :func:`hooks_of` and a model without them (the reference) ignores it."""

    def __init__(self, model: nn.Module, shape: RoutingShape, apply: bool, by_version: bool = True):
        self.shape, self.apply = shape, bool(apply)
        self.by_version = by_version  # split disagreement by the record's weights version (engine records)
        self.counting = False  # count disagreement (the step's first pass at its starting weights)
        self.current_version = -1  # the learner's weights version during counting: tokens of it are "fresh"
        self._replay: Optional[torch.Tensor] = None  # [N, layers, top_k] for the forward running now
        self._fresh: Optional[torch.Tensor] = None  # [N] bool
        self._counts = _Counts()
        self._fresh_known = False  # the forwards counted knew each position's version (fresh/stale split)
        routers = moe_routers(model)
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(routers)]
        self._norm = [bool(getattr(r, "norm_topk_prob", True)) for r in routers]

    @classmethod
    def attach(cls, model: nn.Module, apply: bool, by_version: bool = True) -> Optional["RoutingHooks"]:
        """Install the hooks on ``model`` (None for a dense model: nothing to hook)."""
        shape = routing_shape(model)
        if shape is None:
            return None
        hooks = cls(model, shape, apply, by_version)
        model.asyncppo_routing = hooks
        return hooks

    @contextlib.contextmanager
    def replaying(self, experts: torch.Tensor, versions: Optional[torch.Tensor] = None) -> Iterator[None]:
        """Route the forward run inside by ``experts`` ``[rows, columns, layers, top_k]`` (:data:`NO_EXPERT`
        where the router chooses itself), aligned with the forward's ``input_ids``; ``versions`` ``[rows,
        columns]``: the weights version that made each position's record (for the fresh/stale split)."""
        L, K = self.shape.layers, self.shape.top_k
        if experts.shape[-2:] != (L, K):
            raise ValueError(f"routing: a record of {tuple(experts.shape[-2:])} per token for a model of {L} MoE "
                             f"layers, top-{K}")
        self._replay = experts.reshape(-1, L, K)
        self._fresh = None if versions is None or not self.by_version else \
            (versions.reshape(-1) == self.current_version)
        self._fresh_known = self._fresh is not None
        try:
            yield
        finally:
            self._replay = self._fresh = None

    def _hook(self, layer: int):
        def hook(module: nn.Module, args, output):
            if self._replay is None:
                return None
            logits, scores, own = _router_output(module, output, self.shape.top_k)
            given = self._replay[:, layer].to(own.device)
            if given.shape[0] != own.shape[0]:
                raise RuntimeError(f"routing: {given.shape[0]} recorded positions for a router call over "
                                   f"{own.shape[0]} (the record is not aligned with the forward's input)")
            valid = (given >= 0).all(dim=-1)
            used = torch.where(valid[:, None], given.long(), own)
            with torch.no_grad():
                self._count(layer, valid, own, given, used)
            if not self.apply:
                return None
            probs = torch.softmax(logits.float(), dim=-1)
            weights = probs.gather(1, used)
            if self._norm[layer]:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            weights = torch.where(valid[:, None], weights.to(scores.dtype), scores)
            return logits, weights, used
        return hook

    def _count(self, layer: int, valid: torch.Tensor, own: torch.Tensor, given: torch.Tensor, used: torch.Tensor):
        c = self._counts
        if c.load is None:
            c.load = torch.zeros((self.shape.layers, self.shape.num_experts), dtype=torch.float64, device=own.device)
        c.load[layer] += torch.bincount(used[valid].reshape(-1), minlength=self.shape.num_experts).to(c.load)
        if not self.counting:
            return
        differ = (own.sort(dim=-1).values != given.long().sort(dim=-1).values).any(dim=-1) & valid
        c.compared += float(valid.sum())
        c.differ += float(differ.sum())
        if self._fresh is not None:
            fresh = self._fresh.to(valid.device)
            c.fresh_compared += float((valid & fresh).sum())
            c.fresh_differ += float((differ & fresh).sum())

    def take_metrics(self) -> dict[str, float]:
        """The step's ``moe/*`` figures, and a fresh count for the next step:

        * ``moe/routing_mismatch``: of the (token, layer) pairs with an engine record, the fraction whose learner
          top-k set differs from the engine's, in the step's first pass (the learner's weights before the update);
        * ``moe/routing_mismatch_fresh`` / ``_stale``: the same over tokens the engine made with those very weights
          (numerics alone) and over older ones (numerics and the lag);
        * ``moe/expert_load``: the busiest expert's share of the routed tokens over the mean share (1 = balanced,
          ``num_experts / top_k`` = every token on the same experts), averaged over layers, over the step's
          forwards, counted on the experts actually used."""
        c, self._counts = self._counts, _Counts()
        out: dict[str, float] = {}
        if c.compared:
            out["moe/routing_mismatch"] = c.differ / c.compared
            out["moe/replayed_pairs"] = c.compared
        if c.fresh_compared:
            out["moe/routing_mismatch_fresh"] = c.fresh_differ / c.fresh_compared
        stale = c.compared - c.fresh_compared
        if stale > 0 and self._fresh_known:
            out["moe/routing_mismatch_stale"] = (c.differ - c.fresh_differ) / stale
        if c.load is not None and float(c.load.sum()) > 0:
            per_layer = c.load.max(dim=1).values / c.load.mean(dim=1).clamp(min=1e-12)
            out["moe/expert_load"] = float(per_layer.mean())
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


@torch.no_grad()
def check_replay(model: nn.Module, hooks: RoutingHooks, vocab: int, device=None) -> Optional[str]:
    """Why replay cannot serve ``model``, or None: one short forward whose own routing, recorded and replayed, must
    give the same logits. The hooks assume a router that returns ``(logits, weights, indices)`` with the weights the
    softmax of the logits at the chosen experts (renormalised or not, as ``norm_topk_prob`` says): Qwen2/3-MoE,
    Mixtral, OLMoE, GPT-OSS are such. A router with another rule (sigmoid scores with a bias and expert groups as in
    DeepSeek-V3 / GLM-4.5, or another output order as in Granite-MoE) would be replayed with wrong weights."""
    device = device or next(model.parameters()).device
    ids = torch.randint(1, max(2, vocab), (2, 8), generator=torch.Generator().manual_seed(0)).to(device)
    was_training = model.training
    model.eval()
    recorder = RoutingRecorder(model)
    try:
        plain = model(input_ids=ids, use_cache=False).logits.float()
        own = recorder.take().view(2, 8, hooks.shape.layers, hooks.shape.top_k)
        recorder.remove()
        apply, counting = hooks.apply, hooks.counting
        hooks.apply, hooks.counting = True, False
        try:
            with hooks.replaying(own):
                replayed = model(input_ids=ids, use_cache=False).logits.float()
        finally:
            hooks.apply, hooks.counting = apply, counting
            hooks.take_metrics()  # the check's counts are not the run's
    except Exception as e:  # a router of another shape: named, not raised from deep inside a forward
        return f"its routers cannot be replayed ({type(e).__name__}: {e})"
    finally:
        recorder.remove()
        model.train(was_training)
    scale = float(plain.abs().max()) or 1.0
    off = float((replayed - plain).abs().max())
    if off > 1e-3 * scale:
        return (f"its routers cannot be replayed: replaying the model's own experts moved its logits by {off:.3g} (of "
                f"{scale:.3g}), so they do not weight the chosen experts by the softmax of their logits")
    return None


def hooks_of(model: nn.Module) -> Optional[RoutingHooks]:
    """The :class:`RoutingHooks` attached to ``model`` (through FSDP or PEFT wrappers), or None."""
    for m in (model, getattr(model, "module", None), getattr(model, "base_model", None)):
        hooks = getattr(m, "asyncppo_routing", None) if m is not None else None
        if isinstance(hooks, RoutingHooks):
            return hooks
    return None


class RoutingRecorder:
    """Forward hooks that record what every router chose, for an engine that runs the model itself (the
    transformers engine): after a forward, :meth:`take` returns int64 ``[N, layers, top_k]`` in the order of the
    forward's flattened input."""

    def __init__(self, model: nn.Module):
        self.shape = routing_shape(model)
        if self.shape is None:
            raise ValueError("routing: the model has no mixture-of-experts routers to record")
        self._taken: list[Optional[torch.Tensor]] = [None] * self.shape.layers
        self._handles = [r.register_forward_hook(self._hook(i)) for i, r in enumerate(moe_routers(model))]

    def _hook(self, layer: int):
        def hook(module, args, output):
            self._taken[layer] = _router_output(module, output, self.shape.top_k)[2].detach()
        return hook

    def take(self) -> torch.Tensor:
        if any(t is None for t in self._taken):
            raise RuntimeError("routing: a router did not run in the last forward")
        out = torch.stack(self._taken, dim=1)
        self._taken = [None] * self.shape.layers
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
