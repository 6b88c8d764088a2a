"""``asyncppo bench shm-push``: the shared-device weight path (``--gpus N``) against gloo, the same push between two
processes on this machine.

``--gpus N`` puts a rollout engine and a learner rank on one device and moves weights through a host shared-memory
segment (sync/shm.py), gloo carrying only the signals. This measures whether that path earns its keep over plain
gloo: the same state dict pushed ``reps`` times over each, median seconds on the sender and the receiver side.
"""

from __future__ import annotations

import multiprocessing as mp
import statistics

import torch

from asyncppo.sync import WeightReceiver, WeightSender, find_free_port, make_sync_group


def state(mb: int) -> dict[str, torch.Tensor]:
    """~``mb`` MB of fp32 as 4 MiB matrices."""
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g)
            for i in range(max(1, mb * 1_000_000 // 4_194_304))}


def _receiver(port: int, backend: str, reps: int, q) -> None:
    group = make_sync_group("127.0.0.1", port, 1, 2, backend=backend, timeout_s=300, store_prefix="bench")
    rx = WeightReceiver(group)
    for _ in range(reps):
        rx.receive(on_bucket=lambda tensors: None)
    q.put([s.seconds for s in rx.history])
    group.close()


def measure(backend: str, payload: dict, reps: int) -> tuple[float, float]:
    """Median (sender, receiver) seconds of ``reps`` pushes of ``payload`` over ``backend``."""
    port, ctx = find_free_port(), mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, backend, reps, q))
    proc.start()
    group = make_sync_group("127.0.0.1", port, 0, 2, backend=backend, timeout_s=300, store_prefix="bench")
    sender = WeightSender(group)
    sent = [sender.push(payload, v).seconds for v in range(1, reps + 1)]
    received = q.get(timeout=600)
    proc.join(60)
    group.close()
    return statistics.median(sent), statistics.median(received)


def run(opts: dict, seed: int, work: str) -> dict:
    payload = state(opts["mb"])
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    rows = {backend: measure(backend, payload, opts["reps"]) for backend in ("gloo", "shm")}
    figures = {"gloo/shm": rows["gloo"][0] / rows["shm"][0]}
    units = {"gloo/shm": "ratio"}
    for backend, (s, r) in rows.items():
        figures[f"{backend} sender s"], units[f"{backend} sender s"] = s, "s"
        figures[f"{backend} GB/s"], units[f"{backend} GB/s"] = nbytes / 1e9 / s, "GB/s"
        print(f"[shm-push] {backend:<5} {s:7.3f} s / {r:7.3f} s  {nbytes / 1e9 / s:6.2f} GB/s", flush=True)
    return {"figures": figures, "units": units,
            "detail": {"payload_mb": nbytes / 1e6, "sender_receiver_s": {k: list(v) for k, v in rows.items()}}}
