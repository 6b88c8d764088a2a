"""Shared fixtures: the tiny model is built once per test session; the vLLM engine is started once per session.

* ``tiny_model_dir``: the built-in ``tiny-addition`` model built through the production path
  (:func:`asyncppo.data.tiny.ensure_builtin_model`) into a session tmp dir with a short warm start
  (``TINY_SFT_STEPS`` steps, a few seconds), so it emits digit strings ending in eos rather than noise —
  realistic outputs with clear greedy margins, so backend comparisons are not decided by float ties.
* ``random_model_dir``: the same architecture, untrained (0.2 s to build).
* ``vllm_engine``: one in-process vLLM engine over ``tiny_model_dir`` (start-up is seconds; vLLM also keeps
  process-wide state, so one engine per test process is the safe pattern). Tests that change its weights must
  restore them. A missing vLLM fails it (tests/vllm_required.py) unless ``ASYNCPPO_ALLOW_NO_VLLM=1``.

Tiers (tests/README.md): every test is marked by its folder, ``unit``, ``component`` or ``e2e``; an e2e test is also
``slow``, and so is every test listed in tests/measured_slow.py, so ``pytest -m "not slow"`` is the fast tier.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import zmq
from measured_slow import MEASURED_SLOW
from vllm_required import require_vllm

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

TINY_SFT_STEPS = 40


@pytest.fixture
def ctx():
    """A ZeroMQ context of the test's own, destroyed without lingering (the socket tests)."""
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from asyncppo.data.tiny import ensure_builtin_model

    cache = tmp_path_factory.mktemp("asyncppo-cache")
    return ensure_builtin_model("tiny-addition", cache_dir=str(cache), sft_steps=TINY_SFT_STEPS, seed=0, verbose=False)


@pytest.fixture(scope="session")
def random_model_dir(tmp_path_factory) -> str:
    from asyncppo.data.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny-random")), seed=0)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir):
    require_vllm()
    from asyncppo.rollout.engines import make_engine

    engine = make_engine("vllm", tiny_model_dir, dtype="float32", max_model_len=128, seed=0, kv_cache_gib=1)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def ref_model(tiny_model_dir):
    """A plain transformers copy of ``tiny_model_dir``: the independent reference for the engine tests."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def prompts(tiny_tokenizer):
    """16 held-out addition prompts as token ids."""
    from asyncppo.data.tasks import get_task

    rows = get_task("addition", seed=0).splits().eval[:16]
    return [tiny_tokenizer.encode(r["prompt"]) for r in rows]


TIERS = ("unit", "component", "e2e")


def _defined_names(module) -> set[str]:
    """Names defined in a test module, including methods of its test classes."""
    names = set(vars(module))
    for value in vars(module).values():
        if isinstance(value, type):
            names |= set(vars(value))
    return names


def pytest_collection_modifyitems(config, items):
    """Mark each test with its tier folder, and as ``slow`` where it is an e2e test or measured slow.

    A name in MEASURED_SLOW that a collected module does not define is an error: a renamed test would otherwise
    quietly move into the fast tier.
    """
    modules = {}
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS and item.path.parent.parent.name == "tests":
            item.add_marker(tier)
            if tier == "e2e":
                item.add_marker("slow")
        if getattr(item, "originalname", item.name) in MEASURED_SLOW.get(item.path.name, ()):
            item.add_marker("slow")
        if getattr(item, "module", None) is not None:
            modules[item.path.name] = item.module
    stale = [f"{name}::{test}" for name, module in modules.items()
             for test in sorted(set(MEASURED_SLOW.get(name, ())) - _defined_names(module))]
    if stale:
        raise pytest.UsageError(f"tests/measured_slow.py names tests that no longer exist: {stale}")


_prebuild: list[subprocess.Popen] = []


def pytest_collection_finish(session):
    """A session that will run component tests and then e2e launches (the whole suite) starts
    tests/prebuild_models.py beside it, at the lowest CPU priority: the built-in models those launches ask for are
    built in the time the component tests leave a core idle, not inside the launches. A session of e2e tests alone
    has no such time, and a builder would only compete with its first launch (and build models it may not need).
    ``ASYNCPPO_NO_PREBUILD=1`` turns it off."""
    tiers = {m for i in session.items for m in ("component", "e2e") if i.get_closest_marker(m)}
    off = os.environ.get("ASYNCPPO_NO_PREBUILD") == "1" or session.config.option.collectonly
    if off or tiers != {"component", "e2e"}:
        return
    here = Path(__file__).resolve().parent
    path = [str(here.parent), str(here), str(here / "e2e"), *os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    with open(Path(tempfile.gettempdir()) / "asyncppo-prebuild.log", "w") as log:  # the child keeps its own handle
        _prebuild.append(subprocess.Popen([sys.executable, "-m", "prebuild_models"], cwd=here.parent, env=env,
                                          stdout=log, stderr=subprocess.STDOUT))


def pytest_sessionfinish(session, exitstatus):
    for proc in _prebuild:  # a run stopped early: a build in progress removes its temporary directory on SIGTERM
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
