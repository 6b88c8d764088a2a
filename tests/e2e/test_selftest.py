"""``asyncppo selftest --device cpu``: every CPU rung passes, the GPU-only rungs are skipped with their reasons, and
the JSON and markdown are written. Its ``--gpus 1`` rung is the end-to-end run of the shared-device mode on CPU (a
real launch: learner and engine in two Ray actors on one device, weights over the shared-memory segment)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from process_tags import TAG_VAR, assert_no_leftovers, new_tag

REPO = Path(__file__).resolve().parents[2]
TAG = new_tag("e2e-selftest")
CPU_RUNGS = ("learner_step", "learner_variants", "hf_engine", "vllm_engine", "shared_push", "shared_mode",
             "shared_long", "moe")


def test_cpu_selftest_passes_every_cpu_rung(tmp_path):
    out = tmp_path / "st"
    env = dict(os.environ, PYTHONUNBUFFERED="1", **{TAG_VAR: TAG})
    proc = subprocess.run([sys.executable, "-m", "asyncppo", "selftest", "--device", "cpu", "--out", str(out),
                           "--shared-steps", "8"], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    doc = json.loads((out / "selftest.json").read_text())
    rungs = {r["name"]: r for r in doc["rungs"]}
    for name in CPU_RUNGS:
        assert rungs[name]["status"] == "passed", rungs[name]
    for name in ("nccl_push", "async_vs_sync"):
        assert rungs[name]["status"] == "skipped" and "needs >= 2 CUDA devices" in rungs[name]["detail"]
    assert rungs["learner_step"]["figures"]["tokens/s"] > 0 and rungs["hf_engine"]["figures"]["tokens/s"] > 0
    moe = rungs["moe"]["figures"]  # a learner step with routing replay; the engine with and without recording
    assert moe["learner tokens/s"] > 0 and moe["engine tokens/s"] > 0 and moe["engine tokens/s recording"] > 0
    assert 1.0 <= moe["expert load"] <= 2.0  # 4 experts, top-2
    variants = rungs["learner_variants"]["figures"]
    assert variants["passed"] == variants["variants"] >= 29  # the CUDA-only ones (bf16, flex) are left out here
    shared = rungs["shared_mode"]["figures"]
    assert shared["steps"] == 8 and shared["sync"] == "shm"  # the run went over the shared-memory weight path
    assert 0 < shared["gen busy"] <= 1 and 0 < shared["train busy"] <= 1
    with open(out / "shared-run" / "placement.json") as f:
        placement = json.load(f)
    assert placement["endpoints"]["shared_devices"] == 1
    long = rungs["shared_long"]["figures"]  # data=long under --gpus 1: synchronous against the preset
    assert long["sync lag max"] == 0 and 0 <= long["async lag max"] <= 4
    assert long["sync learner s"] > 0 and long["async learner s"] > 0
    assert long["speed-up"] == round(long["sync learner s"] / long["async learner s"], 2)
    for name in ("long-sync", "long-async"):
        with open(out / name / "config.yaml") as f:
            config = f.read()
        assert "task: long" in config and ("max_staleness: 0" in config) == (name == "long-sync")
    md = (out / "selftest.md").read_text()
    assert "| --gpus 1 shared mode | passed |" in md and md.count("| skipped |") == 2
    assert_no_leftovers(TAG)
