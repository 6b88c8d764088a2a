"""The rungs with more than one process: a weight push between two processes on one device over shared memory,
``--gpus 1`` shared mode (a real launch), a 1 GB NCCL push between two GPUs, async against sync on two GPUs.

The shared-device push needs only torch and transformers, so it runs on a bare GPU machine too: it is the
``--gpus 1`` weight path (sync/shm.py) without Ray, ZeroMQ or Hydra, which the full launch needs.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time

from asyncppo.selftest.ladder import Context, Skip
from asyncppo.selftest.launches import importable, launch_run, mean_of, missing_launch_stack


def _engine_side(model_dir: str, device: str, port: int, pushes: int, q) -> None:
    """The engine process: an HF engine on ``device`` loading every push as a rollout worker does."""
    try:
        import torch  # heavy: torch

        from asyncppo.rollout.engines import make_engine
        from asyncppo.sync import WeightReceiver, make_sync_group
        from asyncppo.sync.engine_load import receive_into_engine

        dtype = "bfloat16" if device == "cuda" else "float32"
        engine = make_engine("hf", model_dir, dtype=dtype, max_model_len=256, device=device)
        group = make_sync_group("127.0.0.1", port, 1, 2, backend="shm", timeout_s=300, store_prefix="selftest")
        rx = WeightReceiver(group)
        loads = []
        for _ in range(pushes):
            t0 = time.perf_counter()
            receive_into_engine(rx, engine, model_config=model_dir, dtype=dtype, device=device)
            if device == "cuda":
                torch.cuda.synchronize()
            loads.append(time.perf_counter() - t0)
        probe = [p.detach().float().sum().item() for p in list(engine.model.parameters())[:2]]
        q.put(("ok", loads, probe))
        group.close()
        engine.close()
    except BaseException as exc:  # reported to the parent
        q.put(("error", f"{type(exc).__name__}: {exc}", []))


def shared_push(ctx: Context) -> dict:
    """Learner (this process) -> engine (a child process) on the same device through the shared-memory segment."""
    import torch  # heavy: torch

    from asyncppo.learner.models import full_state_dict, load_actor
    from asyncppo.sync import WeightSender, find_free_port, make_sync_group

    pushes, port = 3, find_free_port()
    q = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=_engine_side, args=(ctx.model_dir, ctx.device, port, pushes, q))
    child.start()
    try:
        dtype = torch.bfloat16 if ctx.device == "cuda" else torch.float32
        actor = load_actor(ctx.model_dir, dtype, torch.device(ctx.device))
        group = make_sync_group("127.0.0.1", port, 0, 2, backend="shm", timeout_s=300, store_prefix="selftest")
        sender = WeightSender(group)
        with torch.no_grad():
            for p in actor.parameters():
                p.fill_(0.5)  # the engine must end with exactly these values
        state = full_state_dict(actor)
        push_s = [sender.push(state, version).seconds for version in range(1, pushes + 1)]
        status, loads, probe = q.get(timeout=600)
        group.close()
    finally:
        child.join(60)
        if child.is_alive():
            child.kill()
    if status != "ok":
        raise RuntimeError(f"engine process: {loads}")
    if any(abs(v / n - 0.5) > 1e-3 for v, n in zip(probe, [p.numel() for p in list(actor.parameters())[:2]])):
        raise RuntimeError(f"the engine did not receive the pushed values (sums {probe})")
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    return {"MB": round(nbytes / 1e6, 1), "push s": round(min(push_s), 3), "load s": round(min(loads), 3),
            "GB/s": round(nbytes / 1e9 / min(push_s), 2)}


def shared_mode(ctx: Context) -> dict:
    """``asyncppo launch --gpus 1`` for ``ctx.shared_steps`` steps: engine and learner on one device."""
    missing = missing_launch_stack()
    if missing:
        raise Skip(f"needs {', '.join(missing)} (Ray actors, the ZeroMQ stream, the Hydra config), not importable "
                   "here; the shared-device weight push rung covers the sync path without them")
    cuda = ctx.device == "cuda"
    args = ["--gpus", "1", f"cluster.shared_device={ctx.device}", f"model.path={ctx.model_dir}",
            f"trainer.total_steps={ctx.shared_steps}", "data.num_eval_prompts=16", "trainer.eval_every=0",
            "rollout.rollout_batch_size=32" if cuda else "rollout.rollout_batch_size=8"]
    if cuda:
        args += ["model.dtype=bfloat16", "rollout.dtype=bfloat16", "rollout.response_length=64",
                 "rollout.engine=" + ("vllm" if importable("vllm") else "hf")]
    t0 = time.perf_counter()
    out, records = launch_run(ctx, "shared-run", args, 540 if cuda else 300)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, "placement.json")) as f:
        backend = json.load(f)["endpoints"].get("sync_backend")
    if backend != "shm" or len(records) != ctx.shared_steps:
        raise RuntimeError(f"expected {ctx.shared_steps} steps over the shm weight path, got {len(records)} over "
                           f"{backend!r}")
    later = records[1:] or records
    return {"steps": len(records), "wall s": round(wall, 1), "gen busy": mean_of(later, "util/rollout_busy"),
            "train busy": mean_of(later, "util/train_busy"), "push s": mean_of(later, "sync/push_s"),
            "step s": mean_of(later, "time/step_s"), "sync": backend}


def _nccl_receiver(port: int, pushes: int, q) -> None:
    try:
        import torch  # heavy: torch

        from asyncppo.sync import WeightReceiver, make_sync_group

        torch.cuda.set_device(1)
        group = make_sync_group("127.0.0.1", port, 1, 2, backend="nccl", timeout_s=300)
        rx = WeightReceiver(group)
        for _ in range(pushes):
            rx.receive(on_bucket=lambda tensors: None)
        torch.cuda.synchronize()
        q.put(("ok", [s.seconds for s in rx.history]))
        group.close()
    except BaseException as exc:
        q.put(("error", f"{type(exc).__name__}: {exc}"))


def nccl_push(ctx: Context) -> dict:
    """1 GiB of bfloat16 tensors (16 x 64 MiB) from GPU 0 to GPU 1 over NCCL, the disaggregated pools' push."""
    if ctx.device != "cuda" or ctx.gpu_count < 2:
        raise Skip(f"needs >= 2 CUDA devices; found {ctx.gpu_count}")
    import torch  # heavy: torch

    from asyncppo.sync import WeightSender, find_free_port, make_sync_group

    pushes, port = 3, find_free_port()
    q = mp.get_context("spawn").Queue()
    child = mp.get_context("spawn").Process(target=_nccl_receiver, args=(port, pushes, q))
    child.start()
    try:
        torch.cuda.set_device(0)
        group = make_sync_group("127.0.0.1", port, 0, 2, backend="nccl", timeout_s=300)
        state = {f"w{i}": torch.randn(32 << 20, dtype=torch.bfloat16, device="cuda") for i in range(16)}
        push_s = [WeightSender(group, bucket_bytes=256 << 20).push(state, v).seconds for v in range(1, pushes + 1)]
        status, received = q.get(timeout=300)
        group.close()
    finally:
        child.join(60)
    if status != "ok":
        raise RuntimeError(f"receiver: {received}")
    nbytes = 16 * (32 << 20) * 2
    return {"GiB": nbytes / 2**30, "push s": round(min(push_s), 3), "GB/s": round(nbytes / 1e9 / min(push_s), 1)}


def async_vs_sync(ctx: Context) -> dict:
    """``data=reverse`` on one rollout GPU and one train GPU, ``max_staleness`` 0 (synchronous) against 2."""
    if ctx.device != "cuda" or ctx.gpu_count < 2:
        raise Skip(f"needs >= 2 CUDA devices; found {ctx.gpu_count}")
    missing = missing_launch_stack()
    if missing:
        raise Skip(f"needs {', '.join(missing)} for the launches, not importable here")
    figures = {}
    for k in (0, 2):
        args = ["data=reverse", "--rollout-gpus", "1", "--train-gpus", "1", f"rollout.max_staleness={k}",
                "trainer.total_steps=30", "trainer.eval_every=0", "data.num_eval_prompts=16"]
        t0 = time.perf_counter()
        _, records = launch_run(ctx, f"reverse-k{k}", args, 420)  # the first builds and warm-starts the model
        figures[f"k={k} wall s"] = round(time.perf_counter() - t0, 1)
        figures[f"k={k} step s"] = mean_of(records[1:], "time/step_s")
    figures["speed-up"] = round(figures["k=0 wall s"] / figures["k=2 wall s"], 2)
    return figures
