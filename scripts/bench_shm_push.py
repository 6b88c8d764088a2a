"""Benchmark the shared-device weight path (``--gpus N``): the same push over gloo and over the shared-memory
segment (sync/shm.py), between two processes on this machine, printed side by side with their ratio.

    .venv/bin/python scripts/bench_shm_push.py [--mb 200] [--reps 3]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncppo.sync import WeightReceiver, WeightSender, find_free_port, make_sync_group  # noqa: E402


def state(mb: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"layers.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(max(1, mb * 1_000_000 // 4_194_304))}


def _receiver(port: int, backend: str, reps: int, q) -> None:
    group = make_sync_group("127.0.0.1", port, 1, 2, backend=backend, timeout_s=300, store_prefix="bench")
    rx = WeightReceiver(group)
    for _ in range(reps):
        rx.receive(on_bucket=lambda tensors: None)
    q.put([s.seconds for s in rx.history])
    group.close()


def measure(backend: str, payload: dict, reps: int) -> tuple[float, float]:
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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=200)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    payload = state(args.mb)
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    rows = {backend: measure(backend, payload, args.reps) for backend in ("gloo", "shm")}
    print(f"payload {nbytes / 1e6:.0f} MB, median of {args.reps} pushes (sender / receiver seconds, GB/s)")
    for backend, (s, r) in rows.items():
        print(f"  {backend:<5} {s:7.3f} s / {r:7.3f} s  {nbytes / 1e9 / s:6.2f} GB/s")
    print(f"  gloo / shm: {rows['gloo'][0] / rows['shm'][0]:.2f}x")


if __name__ == "__main__":
    main()
