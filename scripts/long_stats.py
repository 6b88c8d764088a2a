"""``data=long``: reference and generated response lengths, and peak memory of a launch at full-length responses.

    python scripts/long_stats.py lengths [RUN_DIR ...]   # reference lengths; generated lengths of each run
    python scripts/long_stats.py memory [--steps 3] [override ...]

``lengths``: mean, p50, p99 and max of the task's reference responses (train and held-out splits, in tokens of the
char-level tokenizer, eos not counted), then, for each run directory, the generated lengths its ``metrics.jsonl``
reports per step (``response_length/*``: their sample-weighted mean, the median and largest per-step p99, the max).

``memory``: one ``asyncppo launch data=long`` with the preset's settings and model, on prompts of the task's longest
kind only (``n // d = max_steps``: reference answers of 1,026 tokens, written to a data file, exact-match reward), so
responses run to ~``rollout.response_length`` (1,028) tokens: the worst case of the preset. (An untrained model was
tried first: it writes eos about one token in 17, so its responses averaged 17 tokens.) Every process of the launch carries a tag
in its environment; their resident memory (``VmHWM``, the kernel's peak) is sampled twice a second and the peak of
the learner and of the rollout worker is printed, with the engine's KV cache: its size (``rollout.kv_cache_gib``) and
what the most sequences it decodes at once (``min(max_num_seqs, prompts x samples)``, each at full length) take.
Results: docs/benchmarks.md, "data=long".
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

TAG_VAR = "ASYNCPPO_E2E_TAG"  # inherited by Ray and every actor: marks this launch's processes only


def _stats(xs: list[float]) -> str:
    xs = sorted(xs)
    mean = sum(xs) / len(xs)
    pct = lambda q: xs[int(q * (len(xs) - 1))]  # noqa: E731
    return f"mean {mean:.1f}  p50 {pct(0.5):.0f}  p99 {pct(0.99):.0f} ({pct(0.99) / mean:.1f}x mean)  max {xs[-1]:.0f}"


def lengths(run_dirs: list[str]) -> None:
    from asyncppo.data.tasks import get_task

    splits = get_task("long").splits()
    for name, rows in (("train", splits.train), ("held-out", splits.eval)):
        print(f"reference {name:9s} ({len(rows)} rows): {_stats([len(r['answer']) for r in rows])}")
    for run in run_dirs:
        recs = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if line.strip()]
        recs = [r for r in recs if "response_length/mean" in r]
        means = [r["response_length/mean"] for r in recs]
        p99s = sorted(r.get("response_length/p99", 0.0) for r in recs)
        print(f"generated {run} ({len(recs)} steps): mean {sum(means) / len(means):.1f}  per-step p99 median "
              f"{p99s[len(p99s) // 2]:.0f}, largest {p99s[-1]:.0f}  max {max(r['response_length/max'] for r in recs):.0f}")


def _tagged(tag: str) -> dict[int, str]:
    needle = f"{TAG_VAR}={tag}".encode()
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes():
                found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
    return found


def _hwm_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def memory(steps: int, overrides: list[str]) -> None:
    out = Path(tempfile.mkdtemp(prefix="long-memory-"))
    tag = f"long-memory-{uuid.uuid4().hex[:8]}"
    from asyncppo.data.long_task import LongTask

    task = LongTask()
    rows = [task.row(task.max_steps * d + r, d) for d in task.DIVISORS for r in range(d)]
    (out / "longest.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    cmd = [sys.executable, "-m", "asyncppo", "launch", "data=long", f"data.train_files=[{out / 'longest.jsonl'}]",
           "rollout.reward_fn=exact_match", f"trainer.total_steps={steps}", "trainer.eval_every=0",
           "trainer.logger.wandb=false", f"trainer.output_dir={out / 'run'}", *overrides]
    print("$", " ".join(cmd[1:]), flush=True)
    proc = subprocess.Popen(cmd, env=dict(os.environ, **{TAG_VAR: tag}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    peak: dict[str, float] = {"learner": 0.0, "rollout worker": 0.0}
    while proc.poll() is None:
        for pid, args in _tagged(tag).items():
            role = "learner" if "LearnerActor" in args else "rollout worker" if "RolloutActor" in args else None
            if role:
                try:
                    peak[role] = max(peak[role], _hwm_mib(pid))
                except OSError:
                    pass
        time.sleep(0.5)
    tail = proc.stdout.read()[-3000:] if proc.stdout else ""
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{tail}")
    recs = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    recs = [r for r in recs if "response_length/mean" in r]
    print(f"responses: mean {sum(r['response_length/mean'] for r in recs) / len(recs):.0f} tokens, "
          f"max {max(r['response_length/max'] for r in recs):.0f}, over {len(recs)} steps")
    for role, mib in peak.items():
        print(f"peak RSS (VmHWM) {role}: {mib:,.0f} MiB")
    _kv_report(overrides)


def _kv_report(overrides: list[str]) -> None:
    from asyncppo.config import load_config
    from asyncppo.data.tiny import resolve_model_path
    from asyncppo.launch.context_check import engine_kv_cache_gib, kv_bytes_per_token

    cfg = load_config(["data=long", *overrides])
    ro = cfg.rollout
    model_dir = resolve_model_path(cfg.model.path, sft_steps=cfg.trainer.sft_warmup_steps)
    model_cfg = json.loads((Path(model_dir) / "config.json").read_text())
    per_token = kv_bytes_per_token(model_cfg, ro.dtype)
    seqs = min(ro.max_num_seqs, ro.rollout_batch_size * ro.num_return_sequences_in_group)
    used = seqs * (ro.prompt_length + ro.response_length) * per_token
    cache = engine_kv_cache_gib(cfg) * 2**30
    print(f"engine KV cache: {engine_kv_cache_gib(cfg)} GiB allocated; {per_token} B per token; {seqs} sequences x "
          f"{ro.prompt_length + ro.response_length} tokens at once = {used / 2**20:.0f} MiB ({used / cache:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("lengths").add_argument("runs", nargs="*")
    mem = sub.add_parser("memory")
    mem.add_argument("--steps", type=int, default=3)
    mem.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.what == "lengths":
        lengths(args.runs)
    else:
        memory(args.steps, args.overrides)


if __name__ == "__main__":
    main()
