"""The learner's torch thread count on CPU: ``trainer.cpu_threads``, unless ``$ASYNCPPO_LEARNER_THREADS`` says
otherwise; and the ``asyncppo`` command makes idle OpenMP threads sleep (a spinning second thread starves a process
sharing its core: docs/benchmarks.md)."""

import os
import subprocess
import sys

import torch

from asyncppo.config import load_config
from asyncppo.launch.actors import set_learner_threads
from asyncppo.launch.resolve import actor_env


def test_cpu_threads_come_from_the_config_and_the_env_var_wins(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("ASYNCPPO_LEARNER_THREADS", raising=False)
        set_learner_threads({"trainer": {"cpu_threads": 2}})
        assert torch.get_num_threads() == 2
        set_learner_threads({"trainer": {"cpu_threads": 1}})
        assert torch.get_num_threads() == 1
        monkeypatch.setenv("ASYNCPPO_LEARNER_THREADS", "2")
        set_learner_threads({"trainer": {"cpu_threads": 1}})
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_built_in_recipe_uses_two_learner_threads_and_the_transformers_engine():
    cfg = load_config([])
    assert cfg.trainer.cpu_threads == 2 and cfg.rollout.engine == "hf"
    assert load_config(["data=reverse"]).trainer.cpu_threads == 1  # other presets keep the schema's default


def test_actors_and_the_command_get_a_passive_openmp_wait_policy(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert actor_env(load_config([]))["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")  # a user's explicit choice is kept
    assert actor_env(load_config([]))["OMP_WAIT_POLICY"] == "ACTIVE"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    code = ("import os, asyncppo.cli as c; c.main(['launch', '--dry-run']) ; "
            "import sys; print('POLICY', os.environ.get('OMP_WAIT_POLICY'), file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "POLICY PASSIVE" in res.stderr
