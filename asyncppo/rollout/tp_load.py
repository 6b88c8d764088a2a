"""Weight loading into a tensor-parallel vLLM engine: every rank or none.

With ``rollout.tensor_parallel_size = TP > 1`` the engine core still runs in the rollout worker's process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), but the model lives in TP worker processes (vLLM's multiprocess executor;
on CPU they talk over shared memory and gloo). A push must therefore reach all of them.

Which tensors each rank gets: the full checkpoint tensors, and vLLM cuts its shard on load. vLLM's weight loaders
(``ColumnParallelLinear.weight_loader`` and friends) take the *checkpoint* tensor and ``narrow`` it by TP rank,
including the q/k/v and gate/up fusions; a pre-cut shard has the wrong shape for them, so per-rank shards would
mean re-implementing every loader's slicing outside vLLM.

How they get there (``via``), measured on 2 busy cores, 52 MB fp32 model, TP=2 (docs/benchmarks.md,
"Tensor-parallel weight push"): ``"shm"`` (default) writes one safetensors file per call to ``/dev/shm`` and
every rank reads it: 0.72 s per push (vLLM's own file reload: 0.62 s) against 0.94-1.7 s for ``"rpc"``, the
tensors pickled through vLLM's executor queue (larger than its 24 MiB shared-memory chunks, they overflow through
a local socket, once per rank). The file is
written once whatever TP is, holds one call (``rollout.weight_bucket_mb`` of layer groups) and is removed after
the call; if it cannot be written (a small ``/dev/shm`` in a container), the call falls back to ``"rpc"``.
``ASYNCPPO_TP_STAGE_DIR`` picks another directory (it must be local to the node).

All or none, in two phases driven from the worker's process through ``collective_rpc`` with *method names* (no
Python callables, so no insecure serialisation; the tensors travel through vLLM's own executor queue, which is
local shared memory and a unix socket, never a network socket):

1. ``asyncppo_stage``: every rank receives the tensors (reads the file), checks names, shapes, dtypes and that the
   values are finite, and keeps them aside. Nothing is loaded. Each rank answers ``{"ok": bool, "error": str}`` and never raises:
   vLLM's executor reads the ranks' replies in order and stops at the first exception, which would leave the
   other ranks' replies queued and mis-pair every later call.
2. If any rank refused, ``asyncppo_discard`` on all ranks: every rank keeps its old weights, the engine still
   serves them, and :class:`TPLoadRejected` says which rank refused and why. Otherwise ``asyncppo_commit`` on all
   ranks: each runs vLLM's in-place ``reload_weights`` on what it staged (a mixture of experts' experts are cut
   by vLLM's fused-MoE weight loader and repacked for the CPU kernel instead, rollout/vllm_cpu_moe.py). A failure there (vLLM itself) cannot be
   undone on the ranks that succeeded, so it raises :class:`TPLoadBroken` and the engine refuses to serve
   (``VLLMEngine`` keeps that state) until a complete set of weights has been loaded.

Memory: each rank holds one call's tensors twice at most (staged + its loaded shard); the sync loader
(``sync/engine_load.py``) calls once per ``rollout.weight_bucket_mb`` of complete layer groups, so that stays
bounded. ``fail_ranks`` is a fault-injection hook for tests: those ranks refuse at stage time as a rank that could
not take the push would.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from typing import Any, Iterable, Sequence

import torch
from safetensors.torch import load_file, save_file

from asyncppo.rollout.vllm_cpu_moe import cpu_experts, load_experts, refusal, split_experts
from asyncppo.sync.reload_quiet import quiet_reload


class TPLoadRejected(RuntimeError):
    """A rank refused the staged weights; no rank loaded anything and the old weights still serve."""


class TPLoadBroken(RuntimeError):
    """Some rank failed while loading: ranks may now disagree, so the engine must not serve until a full reload."""


def manifest_of(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, tuple[int, ...], str]]:
    """What the driver sent, as each rank must find it: ``(name, shape, dtype)``."""
    return [(n, tuple(t.shape), str(t.dtype)) for n, t in named]


def check_staged(named: Sequence[tuple[str, Any]], manifest: Sequence[tuple[str, tuple[int, ...], str]]) -> str:
    """Why a rank must refuse ``named`` (empty string: accept). Pure, so tests can check it without an engine."""
    if len(named) != len(manifest):
        return f"received {len(named)} tensors, the driver sent {len(manifest)}"
    for (name, t), (m_name, m_shape, m_dtype) in zip(named, manifest):
        if name != m_name:
            return f"tensor {name!r} arrived where {m_name!r} was sent"
        if not isinstance(t, torch.Tensor):
            return f"{name!r} is a {type(t).__name__}, not a tensor"
        if tuple(t.shape) != tuple(m_shape) or str(t.dtype) != m_dtype:
            return f"{name!r} arrived as {tuple(t.shape)} {t.dtype}, sent as {tuple(m_shape)} {m_dtype}"
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            return f"{name!r} has non-finite values (NaN or inf): loading it would poison every later sample"
    return ""


class StagedWeightsExtension:
    """Mixed into every vLLM worker (``worker_extension_cls``); the methods run on each TP rank."""

    def asyncppo_stage(self, manifest: list, named: list | None = None, path: str | None = None,
                       fail_ranks: Sequence[int] = ()) -> dict:
        rank = int(getattr(self, "rank", 0))
        try:
            self._asyncppo_staged = None
            if rank in set(fail_ranks):
                return {"rank": rank, "ok": False, "error": "refused by fault injection (fail_ranks)"}
            if path is not None:
                loaded = load_file(path)
                named = [(n, loaded.pop(n)) for n, _, _ in manifest if n in loaded]
            why = check_staged(named, manifest)
            model = self.model_runner.model
            if not why and cpu_experts(model):  # a MoE kernel this push cannot repack: refused before any load
                why = refusal(model, named)
            if why:
                return {"rank": rank, "ok": False, "error": why}
            self._asyncppo_staged = list(named)
            return {"rank": rank, "ok": True, "error": ""}
        except Exception as exc:  # never raise through collective_rpc (module docstring)
            return {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"}

    def asyncppo_discard(self) -> dict:
        self._asyncppo_staged = None
        return {"rank": int(getattr(self, "rank", 0)), "ok": True, "error": ""}

    def asyncppo_commit(self) -> dict:
        rank = int(getattr(self, "rank", 0))
        staged, self._asyncppo_staged = getattr(self, "_asyncppo_staged", None), None
        if staged is None:
            return {"rank": rank, "ok": False, "error": "nothing staged"}
        try:
            model = self.model_runner.model
            others, experts = split_experts(staged) if cpu_experts(model) else (staged, {})
            if others:
                with quiet_reload():  # per-layer noise of a partial reload
                    self.reload_weights(weights_iterator=others)
            if experts:  # vLLM's reload would leave the CPU MoE kernel's packed experts stale: cut and repacked here
                load_experts(model, experts)
            return {"rank": rank, "ok": True, "error": ""}
        except Exception as exc:
            return {"rank": rank, "ok": False, "error": f"{type(exc).__name__}: {exc}"}


EXTENSION = f"{StagedWeightsExtension.__module__}.{StagedWeightsExtension.__qualname__}"


def _failures(replies: Iterable[dict]) -> list[str]:
    return [f"rank {r.get('rank', '?')}: {r.get('error')}" for r in replies if not r.get("ok")]


STAGE_PREFIX = "asyncppo-tp-"
_swept_roots: set[str] = set()  # a process sweeps each stage root once, at its first push: not on every step


def _sweep_stale_stages(root: str | None) -> None:
    """Remove stage directories left by processes that died mid-push (killed between writing the file and the
    ``finally`` that deletes it): in ``/dev/shm`` they would hold memory until reboot. A directory is named
    ``asyncppo-tp-<pid>-...`` after the process that wrote it, so only dead writers' directories are touched. A
    replacement engine is a new process, so it sweeps what its predecessor left at its own first push."""
    if not root or root in _swept_roots or not os.path.isdir(root):
        return
    _swept_roots.add(root)
    for entry in os.listdir(root):
        if not entry.startswith(STAGE_PREFIX):
            continue
        pid = entry[len(STAGE_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
        except PermissionError:  # alive, another user's
            pass


def _write_stage_file(named: list[tuple[str, torch.Tensor]]) -> str | None:
    """One safetensors file with ``named`` in a fresh directory (its path), or None when it cannot be written."""
    root = os.environ.get("ASYNCPPO_TP_STAGE_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    _sweep_stale_stages(root)
    d = None
    try:
        d = tempfile.mkdtemp(prefix=f"{STAGE_PREFIX}{os.getpid()}-", dir=root)
        seen: set[int] = set()
        tensors = {}
        for n, t in named:  # safetensors refuses shared storage (a tied lm_head is the embedding itself)
            ptr = t.untyped_storage().data_ptr()
            tensors[n] = t.clone() if ptr in seen else t
            seen.add(ptr)
        save_file(tensors, os.path.join(d, "push.safetensors"))
        return os.path.join(d, "push.safetensors")
    except OSError as exc:
        logging.getLogger(__name__).warning("tp_load: cannot stage weights in %s (%s); sending them through vLLM's "
                                            "executor queue instead", root, exc)
        if d:
            shutil.rmtree(d, ignore_errors=True)
        return None


def staged_reload(llm: Any, named: Iterable[tuple[str, torch.Tensor]], *, fail_ranks: Sequence[int] = (),
                  via: str = "shm") -> None:
    """Load ``named`` (checkpoint names, full tensors) into every TP rank of ``llm``, or into none (module docstring)."""
    if via not in ("shm", "rpc"):
        raise ValueError(f"tp_load: via must be 'shm' or 'rpc', got {via!r}")
    named = [(n, t.detach().to("cpu").contiguous()) for n, t in named]
    path = _write_stage_file(named) if via == "shm" else None
    try:
        payload = {"path": path} if path else {"named": named}
        replies = llm.collective_rpc("asyncppo_stage", kwargs={**payload, "manifest": manifest_of(named),
                                                               "fail_ranks": list(fail_ranks)})
        refused = _failures(replies)
        if refused:
            llm.collective_rpc("asyncppo_discard")
            raise TPLoadRejected("weight push refused, every rank keeps its old weights: " + "; ".join(refused))
        broken = _failures(llm.collective_rpc("asyncppo_commit"))
    finally:
        if path:
            shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    if broken:
        raise TPLoadBroken("weight load failed on some ranks after others loaded: " + "; ".join(broken))
    llm.reset_prefix_cache()
