"""``asyncppo bench fanout``: push cost of one shared group of 1 + N ranks (one broadcast) against one two-rank group
per worker (sync/fanout.py, N pushes in parallel threads), side by side.

The learner pushes to each rollout worker over its own group so that one worker's death breaks nobody
(docs/reliability.md); this measures what that costs against a single broadcast. Each configuration: rank 0 pushes
``reps`` versions of ``mb`` MiB of float32 tensors (64 tensors) and times push + wait (snapshot copy included)
until every worker received it; gloo on CPU over loopback.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.multiprocessing as mp


def _tensors(mb: int) -> dict[str, torch.Tensor]:
    n = (mb << 20) // 4 // 64
    return {f"layer{i}.weight": torch.randn(n) for i in range(64)}


def _receiver(w: int, mode: str, port: int, workers: int, reps: int) -> None:
    from asyncppo.sync import WeightReceiver, make_sync_group
    from asyncppo.sync.fanout import member_prefix

    torch.set_num_threads(1)
    if mode == "shared":
        group = make_sync_group("127.0.0.1", port, 1 + w, 1 + workers, timeout_s=300, store_prefix="bench")
    else:
        group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=300, store_prefix=member_prefix("bench", w, 0))
    receiver = WeightReceiver(group)
    for _ in range(reps):
        receiver.receive()
    group.close()


def _run(mode: str, workers: int, mb: int, reps: int) -> float:
    from asyncppo.sync import WeightSender, find_free_port, make_sync_group
    from asyncppo.sync.fanout import WeightFanout

    port = find_free_port()
    ctx = mp.get_context("spawn")
    if mode == "fanout":  # rank 0's store must exist before the workers connect
        sender = WeightFanout("127.0.0.1", port, "bench", timeout_s=300)
        for w in range(workers):
            sender.add(w, 0)
    procs = [ctx.Process(target=_receiver, args=(w, mode, port, workers, reps)) for w in range(workers)]
    for p in procs:
        p.start()
    if mode == "shared":
        group = make_sync_group("127.0.0.1", port, 0, 1 + workers, timeout_s=300, store_prefix="bench")
        sender = WeightSender(group, bucket_bytes=64 << 20)
    else:
        sender.wait_joined(range(workers))
    tensors = _tensors(mb)
    times = []
    for v in range(1, reps + 1):
        t0 = time.perf_counter()
        sender.push_async(tensors, v)
        sender.wait()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    if mode == "shared":
        group.close()
    else:
        sender.close()
    return statistics.median(times)


def run(opts: dict, seed: int, work: str) -> dict:
    torch.set_num_threads(1)
    figures, units = {}, {}
    for workers in opts["workers"]:
        for mb in opts["mb"]:
            shared = _run("shared", int(workers), int(mb), opts["reps"])
            fanout = _run("fanout", int(workers), int(mb), opts["reps"])
            key = f"{workers} workers {mb} MiB"
            figures[f"fanout/shared {key}"], units[f"fanout/shared {key}"] = fanout / shared, "ratio"
            figures[f"shared s {key}"], units[f"shared s {key}"] = shared, "s"
            figures[f"fanout s {key}"], units[f"fanout s {key}"] = fanout, "s"
            print(f"[fanout] {key}: shared {shared:.3f} s, fanout {fanout:.3f} s, ratio {fanout / shared:.2f}",
                  flush=True)
    return {"figures": figures, "units": units, "detail": {}}
