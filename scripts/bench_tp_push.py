"""Time a weight push into a vLLM CPU engine with tensor parallelism 1 and 2 (docs/benchmarks.md).

For each TP it starts one engine over a ~55 MB fp32 Qwen2 (hidden 512, 4 layers, head_dim 64) and loads the
model's full state dict ``--reps`` times, median wall time per push, three ways:

* ``inproc``  (TP=1 only): ``VLLMEngine.update_weights``, tensors handed over in-process (the production TP=1 path);
* ``shm``     (TP=2): ``VLLMEngine.update_weights`` -> rollout/tp_load.py: each call's tensors written once as a
  safetensors file in /dev/shm, read, checked and staged by every rank, then committed on all (the TP>1 default);
* ``rpc``     (TP=2): the same, with the tensors pickled through vLLM's executor queue to each rank;
* ``path``    (TP=2): the state dict written to /dev/shm, then vLLM's own ``reload_weights(weights_path=...)`` on
  every rank: the floor for a file, with no checks and no all-or-none step.

Each runs with one call per push (``--flush-mb`` 0) and with layer-group calls of ``--flush-mb`` MB, as the sync
loader would. Engines start in child processes one after the other; greedy output is compared after each mode so a
mode that loads wrong weights shows up.

    .venv/bin/python scripts/bench_tp_push.py [--reps 5] [--flush-mb 8]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--flush-mb", type=int, default=8)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    from asyncppo.data.tiny import build_tiny_model

    with tempfile.TemporaryDirectory() as root:
        model_dir = build_tiny_model(os.path.join(root, "m"), hidden=512, layers=4, heads=8, intermediate=1536)
        mb = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                 if f.endswith(".safetensors")) / 2**20
        ctx = mp.get_context("spawn")
        print(f"model: Qwen2 h512 x 4 layers, {mb:.1f} MB fp32; {args.reps} pushes per row, median", flush=True)
        print(f"{'tp':>2} {'mode':<7} {'calls':>5} {'median s':>9} {'min s':>7}  greedy unchanged", flush=True)
        for tp in args.tp:
            q = ctx.Queue()
            p = ctx.Process(target=_run, args=(model_dir, tp, args.reps, args.flush_mb, q))
            p.start()
            res = q.get(timeout=1200)
            p.join(60)
            print(f"   (TP={tp} engine start {res['start_s']:.1f} s)", flush=True)
            for r in res["rows"]:
                print(f"{r['tp']:>2} {r['mode']:<7} {r['calls']:>5} {r['median_s']:>9.3f} {r['min_s']:>7.3f}  "
                      f"{r['greedy_unchanged']}", flush=True)
            print(json.dumps(res), file=sys.stderr)


if __name__ == "__main__":
    main()
