"""``asyncppo bench weight-sync``: the weight broadcast over gloo, one sender and one receiver process.

For each payload (the tiny Qwen2's state dict, a ~``mb`` MB synthetic state dict) it times a full push (preamble,
header, buckets) as seen by the receiver and by the sender, next to an in-memory ``copy_`` of the same tensors
into preallocated ones: the floor any transport is measured against, so the ratio says what the transport adds.
With ``vllm=true`` it then times how long a vLLM CPU engine takes to load the tiny model's weights:
``reload_weights`` on tensors already in memory, and a whole push received straight into the engine (all at once,
and layer group by layer group).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import time

import torch

from asyncppo.sync import (
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


def cases(opts: dict, model_dir: str):
    """(label, state builder, bucket bytes) of each push timed."""
    return [
        ("tiny Qwen2 (2 layers, h128)", lambda: tiny_state(model_dir), 64 << 20),
        ("tiny Qwen2, 256 KiB buckets", lambda: tiny_state(model_dir), 256 << 10),
        (f"{opts['mb']} MB fp32, 64 MiB buckets", lambda: big_state(opts["mb"]), 64 << 20),
        (f"{opts['mb']} MB fp32, 16 MiB buckets", lambda: big_state(opts["mb"]), 16 << 20),
    ]


def receiver_main(port: int, opts: dict, model_dir: str, q) -> None:
    group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=300)
    rx = WeightReceiver(group)
    res = {}
    for name, _, _ in cases(opts, model_dir):
        times = []
        for _ in range(opts["reps"]):
            group.broadcast(torch.zeros(1))  # start together
            rx.receive()
            times.append(rx.stats.seconds)
        res[name] = times
    if opts["vllm"]:
        os.environ.update(VLLM_ENV)
        from vllm import LLM

        t0 = time.perf_counter()
        llm = LLM(model=model_dir, dtype="float32", max_model_len=64, enforce_eager=True, seed=0)
        res["vllm_start"] = [time.perf_counter() - t0]
        local = tiny_state(model_dir)
        vllm_reload_weights(llm, list(local.items()))  # warm-up
        times = []
        for _ in range(opts["reps"]):
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
            for _ in range(opts["reps"]):
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


def run(opts: dict, seed: int, work: str) -> dict:
    torch.set_num_threads(1)
    model_dir = tiny_model_dir(work)
    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=receiver_main, args=(port, opts, model_dir, q), daemon=True)
    proc.start()
    group = make_sync_group("127.0.0.1", port, 0, 2, timeout_s=300)
    rows = []
    for name, build, bucket in cases(opts, model_dir):
        state = build()
        tx = WeightSender(group, bucket_bytes=bucket)
        send = []
        for rep in range(opts["reps"]):
            group.broadcast(torch.zeros(1))
            send.append(tx.push(state, version=rep).seconds)
        rows.append((name, tx.stats, send, copy_baseline(state, opts["reps"])))
        del state
    if opts["vllm"]:
        tx = WeightSender(group, bucket_bytes=64 << 10)
        state = tiny_state(model_dir)
        for _ in range(2):
            for rep in range(opts["reps"]):
                group.broadcast(torch.zeros(1))
                tx.push(state, version=100 + rep)
    recv = q.get(timeout=600)
    proc.join(60)
    group.close()
    med = statistics.median
    figures, units, table = {}, {}, []
    for name, st, send, copy in rows:
        r, s, c = med(recv[name]), med(send), med(copy)
        table.append({"payload": name, "mb": st.payload_bytes / 1e6, "buckets": st.num_buckets, "recv_s": r,
                      "send_s": s, "copy_s": c})
        for key, value, unit in ((f"recv s {name}", r, "s"), (f"recv/copy {name}", r / c, "ratio"),
                                 (f"GB/s {name}", st.payload_bytes / r / 1e9, "GB/s")):
            figures[key], units[key] = value, unit
        print(f"[weight-sync] {name}: recv {r:.4f} s, send {s:.4f} s, copy_ {c:.4f} s, {r / c:.1f}x", flush=True)
    if opts["vllm"]:
        figures["vllm engine start s"], units["vllm engine start s"] = recv["vllm_start"][0], "s"
        for label in ("vllm reload_weights (in memory, one call)", "push -> engine, one call",
                      "push -> engine, per layer group"):
            figures[f"{label} s"], units[f"{label} s"] = med(recv[label]), "s"
    return {"figures": figures, "units": units, "detail": {"rows": table}}
