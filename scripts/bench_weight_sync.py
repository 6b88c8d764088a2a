"""Benchmark the weight broadcast: one sender, one receiver process, a real gloo group on this machine.

For each payload (the tiny Qwen2's state dict, a ~100 MB synthetic state dict) it times a full push (preamble,
header, buckets) as seen by the receiver and by the sender, next to an in-memory ``copy_`` of the same tensors
into preallocated ones (the floor any transport is measured against), and prints the ratio. Then it times how
long a vLLM CPU engine takes to load the tiny model's weights: ``reload_weights`` on tensors already in memory,
and a whole push received straight into the engine (all at once, and layer group by layer group).

    .venv/bin/python scripts/bench_weight_sync.py [--reps 5] [--mb 100] [--no-vllm]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from asyncppo.sync import (  # noqa: E402
    LayerGroupLoader,
    WeightReceiver,
    WeightSender,
    find_free_port,
    make_sync_group,
    vllm_reload_weights,
)

VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def tiny_model_dir(root: str) -> str:
    from asyncppo.data.tiny import build_tiny_model

    return build_tiny_model(os.path.join(root, "tiny"), seed=0)


def tiny_state(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()


def big_state(mb: int) -> dict[str, torch.Tensor]:
    """~``mb`` MB of fp32 in transformer-like shapes (4 MB matrices, small norms)."""
    out, g, i = {}, torch.Generator().manual_seed(0), 0
    while sum(t.numel() * 4 for t in out.values()) < mb * 1_000_000:
        out[f"model.layers.{i}.mlp.weight"] = torch.randn(1024, 1024, generator=g)
        out[f"model.layers.{i}.norm.weight"] = torch.ones(1024)
        i += 1
    return out


def cases(args, model_dir):
    return [
        ("tiny Qwen2 (2 layers, h128)", lambda: tiny_state(model_dir), 64 << 20),
        ("tiny Qwen2, 256 KiB buckets", lambda: tiny_state(model_dir), 256 << 10),
        (f"{args.mb} MB fp32, 64 MiB buckets", lambda: big_state(args.mb), 64 << 20),
        (f"{args.mb} MB fp32, 16 MiB buckets", lambda: big_state(args.mb), 16 << 20),
    ]


def receiver_main(port: int, args, model_dir: str, q) -> None:
    group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=300)
    rx = WeightReceiver(group)
    res = {}
    for name, _, _ in cases(args, model_dir):
        times = []
        for _ in range(args.reps):
            group.broadcast(torch.zeros(1))  # start together
            rx.receive()
            times.append(rx.stats.seconds)
        res[name] = times
    if not args.no_vllm:
        os.environ.update(VLLM_ENV)
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(model=model_dir, dtype="float32", max_model_len=64, enforce_eager=True, seed=0)
        res["vllm_start"] = [time.perf_counter() - t0]
        local = tiny_state(model_dir)
        vllm_reload_weights(llm, list(local.items()))  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            vllm_reload_weights(llm, list(local.items()))
            times.append(time.perf_counter() - t0)
        res["vllm reload_weights (in memory, one call)"] = times

        class Engine:
            calls = 0

            def update_weights(self, named):
                Engine.calls += 1
                vllm_reload_weights(llm, named, quiet_partial=True)

        for label, flush in (("push -> engine, one call", None), ("push -> engine, per layer group", 1)):
            times = []
            for _ in range(args.reps):
                group.broadcast(torch.zeros(1))
                t0 = time.perf_counter()
                LayerGroupLoader(Engine(), flush_bytes=flush, model_config=model_dir, dtype="float32").receive(rx)
                times.append(time.perf_counter() - t0)
            res[label] = times
    group.close()
    q.put(res)


def copy_baseline(state: dict[str, torch.Tensor], reps: int) -> list[float]:
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    times = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        for k, v in state.items():
            dst[k].copy_(v)
        times.append(time.perf_counter() - t0)
    return times[1:]  # the first pass faults the destination pages in


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--no-vllm", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="bench-sync-")
    model_dir = tiny_model_dir(root)
    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=receiver_main, args=(port, args, model_dir, q), daemon=True)
    proc.start()
    group = make_sync_group("127.0.0.1", port, 0, 2, timeout_s=300)
    rows = []
    for name, build, bucket in cases(args, model_dir):
        state = build()
        tx = WeightSender(group, bucket_bytes=bucket)
        send = []
        for rep in range(args.reps):
            group.broadcast(torch.zeros(1))
            send.append(tx.push(state, version=rep).seconds)
        rows.append((name, tx.stats, send, copy_baseline(state, args.reps)))
        del state
    if not args.no_vllm:
        tx = WeightSender(group, bucket_bytes=64 << 10)
        state = tiny_state(model_dir)
        for _ in range(2):
            for rep in range(args.reps):
                group.broadcast(torch.zeros(1))
                tx.push(state, version=100 + rep)
    recv = q.get(timeout=600)
    proc.join(60)
    group.close()

    med = statistics.median
    print(f"torch {torch.__version__}, gloo, 1 sender -> 1 receiver process, {os.cpu_count()} cores, "
          f"median of {args.reps}")
    print(f"{'payload':34s} {'MB':>7s} {'buckets':>7s} {'recv s':>8s} {'send s':>8s} {'copy_ s':>8s} "
          f"{'recv/copy':>9s} {'GB/s':>6s}")
    for name, st, send, copy in rows:
        r, s, c = med(recv[name]), med(send), med(copy)
        print(f"{name:34s} {st.payload_bytes / 1e6:7.2f} {st.num_buckets:7d} {r:8.4f} {s:8.4f} {c:8.4f} "
              f"{r / c:8.1f}x {st.payload_bytes / r / 1e9:6.2f}")
    if not args.no_vllm:
        print(f"vLLM engine start (tiny, fp32): {recv['vllm_start'][0]:.2f} s")
        for label in ("vllm reload_weights (in memory, one call)", "push -> engine, one call",
                      "push -> engine, per layer group"):
            print(f"{label:45s} median {med(recv[label]):.4f} s  (min {min(recv[label]):.4f})")


if __name__ == "__main__":
    main()
