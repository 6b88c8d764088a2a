"""``asyncppo selftest``: its arguments and the ladder in order. Importing this module imports nothing heavy (the
command line builds every parser at start)."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

HELP = "measure what only a GPU can show (learner step, engines, --gpus 1, NCCL push) and write JSON + markdown"
DESCRIPTION = (
    "Run the self-test ladder on the devices found here, with a locally built Qwen2 of Qwen2.5-0.5B's shape (random "
    "weights; a tiny one with --device cpu). Each rung is reported as passed (with figures), failed (with the error) "
    "or skipped (with the reason); the results go to OUT/selftest.json and OUT/selftest.md (a table for "
    "docs/benchmarks.md). Needs torch and transformers; the rungs that need vLLM, Ray, pyzmq or Hydra are skipped "
    "with the reason when those are missing. See docs/quickstart-gpu.md.")

# name -> title, in ladder order; the functions live in rungs_device.py / rungs_variants.py / rungs_multi.py /
# rungs_long.py / rungs_moe.py
RUNGS = {
    "learner_step": "PPO learner step",
    "learner_variants": "learner step, every estimator, loss and correction",
    "hf_engine": "transformers engine",
    "vllm_engine": "vLLM engine",
    "shared_push": "shared-device weight push (shm)",
    "shared_mode": "--gpus 1 shared mode",
    "shared_long": "--gpus 1, data=long: async vs sync",
    "nccl_push": "1 GiB NCCL weight push",
    "async_vs_sync": "async vs sync, data=reverse",
    "moe": "mixture of experts: learner step with routing replay, engine recording experts",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("selftest", help=HELP, description=DESCRIPTION)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="cuda: the 0.5B ladder on the GPUs; cpu: the same ladder at tiny sizes (what CI runs); "
                   "auto: cuda when torch sees a GPU")
    p.add_argument("--out", metavar="DIR", default=None, help="where to write (default selftest-<time>/)")
    p.add_argument("--only", metavar="RUNG,...", default="",
                   help=f"run these rungs only, the others reported as skipped (of {', '.join(RUNGS)})")
    p.add_argument("--shared-steps", type=int, default=20, metavar="N",
                   help="learner steps of the --gpus 1 launch (default 20)")
    p.set_defaults(func=run)


def _ladder():
    from asyncppo.selftest import rungs_device as D  # heavy: torch (inside the rungs)
    from asyncppo.selftest import rungs_multi as M
    from asyncppo.selftest.rungs_long import shared_long
    from asyncppo.selftest.rungs_moe import moe
    from asyncppo.selftest.rungs_variants import learner_variants

    return {"learner_step": D.learner_step, "learner_variants": learner_variants, "hf_engine": D.hf_engine,
            "vllm_engine": D.vllm_engine, "shared_push": M.shared_push, "shared_mode": M.shared_mode,
            "shared_long": shared_long, "nccl_push": M.nccl_push, "async_vs_sync": M.async_vs_sync,
            "moe": moe}


def run(args: argparse.Namespace) -> int:
    """Build the model, run every rung, write the results; exit 0 unless a rung failed."""
    import torch  # heavy: torch

    from asyncppo.selftest.ladder import Context, RungResult, environment, run_rung, write
    from asyncppo.selftest.model import build_selftest_model

    only = [name for name in args.only.split(",") if name.strip()]
    unknown = [name for name in only if name not in RUNGS]
    if unknown:
        print(f"asyncppo: --only {','.join(unknown)}: unknown rung(s); choose from {', '.join(RUNGS)}",
              file=sys.stderr)
        return 2
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("asyncppo: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    started = time.time()
    out = os.path.abspath(args.out or time.strftime("selftest-%Y%m%d-%H%M%S"))
    ctx = Context(device=device, out_dir=out, size="0.5b" if device == "cuda" else "tiny",
                  shared_steps=args.shared_steps, gpu_count=torch.cuda.device_count() if device == "cuda" else 0)
    os.makedirs(out, exist_ok=True)
    t0 = time.perf_counter()
    ctx.model_dir = build_selftest_model(os.path.join(out, f"model-{ctx.size}"), ctx.size,
                                         dtype="bfloat16" if device == "cuda" else "float32")
    print(f"[selftest] {ctx.size} model built in {time.perf_counter() - t0:.1f} s: {ctx.model_dir}", flush=True)
    results = []
    for name, fn in _ladder().items():
        if only and name not in only:
            results.append(RungResult(name, RUNGS[name], "skipped", 0.0, {}, "not selected (--only)"))
            continue
        result = run_rung(name, RUNGS[name], fn, ctx)
        results.append(result)
        print(f"[selftest] {result.title}: {result.status} ({result.seconds:g} s) "
              f"{result.figures or ''} {result.detail}".rstrip(), flush=True)
    command = "asyncppo " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["selftest"] else None
    json_path, md_path = write(results, ctx, environment(ctx), started, command or f"asyncppo selftest --device {device}")
    print(f"[selftest] wrote {json_path} and {md_path}")
    return 1 if any(r.status == "failed" for r in results) else 0
