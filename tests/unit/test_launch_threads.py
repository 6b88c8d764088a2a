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


def test_cpu_lists_take_ids_and_ranges_and_refuse_the_rest_by_name():
    """``--rollout-cpus`` / ``$ASYNCPPO_*_CPUS`` are taskset-style lists: ``0-7,9`` is nine CPUs."""
    import pytest

    from asyncppo.launch.actors import parse_cpu_list

    assert parse_cpu_list("1") == {1}
    assert parse_cpu_list("0-3, 9,") == {0, 1, 2, 3, 9}
    assert parse_cpu_list("8,9,10,11,12,13,14,15") == set(range(8, 16)) == parse_cpu_list("8-15")
    with pytest.raises(ValueError, match=r"ASYNCPPO_ROLLOUT_CPUS='0-x'.*'0-x' is neither"):
        parse_cpu_list("0-x", "ASYNCPPO_ROLLOUT_CPUS")
    with pytest.raises(ValueError, match=r"'7-3' is not a range"):
        parse_cpu_list("7-3")


def test_an_actor_pins_itself_to_a_range(monkeypatch):
    from asyncppo.launch.actors import pin_cpus

    before = os.sched_getaffinity(0)
    first = min(before)
    try:
        monkeypatch.setenv("ASYNCPPO_ROLLOUT_CPUS", f"{first}-{first}")  # a range of one allowed CPU
        pin_cpus("ASYNCPPO_ROLLOUT_CPUS")
        assert os.sched_getaffinity(0) == {first}
    finally:
        os.sched_setaffinity(0, before)
