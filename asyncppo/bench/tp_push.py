"""``asyncppo bench tp-push``: a weight push into a vLLM CPU engine with tensor parallelism 1 and 2.

For each TP it starts one engine over a ~55 MB fp32 Qwen2 (hidden 512, 4 layers, head_dim 64) and loads the
model's full state dict ``reps`` times, median wall time per push, three ways:

* ``inproc``  (TP=1 only): ``VLLMEngine.update_weights``, tensors handed over in-process (the production TP=1 path);
* ``shm``     (TP=2): ``VLLMEngine.update_weights`` -> rollout/tp_load.py: each call's tensors written once as a
  safetensors file in /dev/shm, read, checked and staged by every rank, then committed on all (the TP>1 default);
* ``rpc``     (TP=2): the same, with the tensors pickled through vLLM's executor queue to each rank;
* ``path``    (TP=2): the state dict written to /dev/shm, then vLLM's own ``reload_weights(weights_path=...)`` on
  every rank: the floor for a file, with no checks and no all-or-none step.

Each runs with one call per push (``flush_mb`` 0) and with layer-group calls of ``flush_mb`` MB, as the sync
loader would. Engines start in child processes one after the other; greedy output is compared after each mode so a
mode that loads wrong weights shows up. Why: the TP>1 transfer was chosen from these numbers (docs/benchmarks.md).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import tempfile
import time

VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def _groups(state: dict, flush_bytes: int) -> list[list]:
    """Complete layer groups, batched to about ``flush_bytes`` (0: one call), as LayerGroupLoader flushes."""
    from asyncppo.sync.engine_load import layer_group

    by_group: dict[str, list] = {}
    for k, v in state.items():
        by_group.setdefault(layer_group(k), []).append((k, v))
    if not flush_bytes:
        return [list(state.items())]
    calls, cur, size = [], [], 0
    for items in by_group.values():
        cur += items
        size += sum(t.numel() * t.element_size() for _, t in items)
        if size >= flush_bytes:
            calls.append(cur)
            cur, size = [], 0
    return calls + ([cur] if cur else [])


def _run(model_dir: str, tp: int, reps: int, flush_mb: int, q) -> None:
    os.environ.update(VLLM_ENV)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from asyncppo.rollout.vllm_engine import VLLMEngine

    t0 = time.perf_counter()
    engine = VLLMEngine(model_dir, dtype="float32", max_model_len=64, seed=0, tensor_parallel_size=tp)
    start_s = time.perf_counter() - t0
    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    prompt = [[3, 4, 13, 5, 6, 14]]
    ref = engine.generate(prompt, n=1, max_tokens=8, temperature=0.0)[0][0].token_ids.tolist()
    rows = []
    modes = ["inproc"] if tp == 1 else ["shm", "rpc", "path"]
    for mode in modes:
        for flush in ([0, flush_mb << 20] if mode != "path" else [0]):
            calls = _groups(state, flush)
            times = []
            for _ in range(reps):
                t = time.perf_counter()
                if mode == "path":
                    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
                        save_file({k: v.contiguous() for k, v in state.items()}, os.path.join(d, "model.safetensors"))
                        engine.llm.collective_rpc("reload_weights", kwargs={"weights_path": d})
                        engine.llm.reset_prefix_cache()
                else:
                    engine.tp_transfer = mode if mode in ("shm", "rpc") else "shm"
                    for c in calls:
                        engine.update_weights(c)
                times.append(time.perf_counter() - t)
            same = engine.generate(prompt, n=1, max_tokens=8, temperature=0.0)[0][0].token_ids.tolist() == ref
            rows.append({"tp": tp, "mode": mode, "calls": len(calls), "median_s": statistics.median(times),
                         "min_s": min(times), "greedy_unchanged": same})
    engine.close()
    q.put({"start_s": start_s, "rows": rows})


def run(opts: dict, seed: int, work: str) -> dict:
    from asyncppo.data.tiny import build_tiny_model

    model_dir = build_tiny_model(os.path.join(work, "m"), hidden=512, layers=4, heads=8, intermediate=1536)
    ctx = mp.get_context("spawn")
    figures, units, detail = {}, {}, {"tp": {}}
    for tp in opts["tp"]:
        q = ctx.Queue()
        p = ctx.Process(target=_run, args=(model_dir, int(tp), opts["reps"], opts["flush_mb"], q))
        p.start()
        res = q.get(timeout=1200)
        p.join(60)
        detail["tp"][str(tp)] = res
        figures[f"TP={tp} engine start s"], units[f"TP={tp} engine start s"] = res["start_s"], "s"
        for r in res["rows"]:
            key = f"TP={r['tp']} {r['mode']} {r['calls']} call(s) s"
            figures[key], units[key] = (r["median_s"] if r["greedy_unchanged"] else None), "s"
            print(f"[tp-push] {key}: median {r['median_s']:.3f} (min {r['min_s']:.3f}), greedy unchanged "
                  f"{r['greedy_unchanged']}", flush=True)
    return {"figures": figures, "units": units, "detail": detail}
