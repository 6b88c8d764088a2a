"""``asyncppo selftest`` on a machine without Ray, pyzmq, Hydra or vLLM (a bare GPU machine): the command imports
and runs, the rungs needing those are skipped with the reason, and the rest pass. The libraries are blocked in a
subprocess by planting None in sys.modules, which makes any import of them fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# what a bare GPU machine lacks (it has torch, transformers, msgpack, pyarrow)
BLOCKED = ("ray", "zmq", "hydra", "omegaconf", "vllm", "wandb", "matplotlib", "gymnasium", "math_verify")
RUN = """
import sys
for name in {blocked!r}:
    sys.modules[name] = None
from asyncppo.cli import main
sys.exit(main(["selftest", "--device", "cpu", "--out", {out!r},
               "--only", "learner_step,vllm_engine,shared_push,shared_mode"]))
"""


def test_selftest_runs_without_the_launch_stack(tmp_path):
    out = str(tmp_path / "bare")
    proc = subprocess.run([sys.executable, "-c", RUN.format(blocked=BLOCKED, out=out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rungs = {r["name"]: r for r in json.loads((Path(out) / "selftest.json").read_text())["rungs"]}
    assert rungs["learner_step"]["status"] == "passed"
    assert rungs["shared_push"]["status"] == "passed"  # the --gpus weight path needs none of them
    assert rungs["shared_mode"]["status"] == "skipped"
    assert all(name in rungs["shared_mode"]["detail"] for name in ("ray", "zmq", "hydra"))
    assert rungs["vllm_engine"]["status"] == "skipped" and "vllm is not importable" in rungs["vllm_engine"]["detail"]
    assert rungs["hf_engine"]["detail"] == "not selected (--only)"
    assert (Path(out) / "selftest.md").is_file()
