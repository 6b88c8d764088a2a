"""The asyncppo command line, run as real subprocesses (console script and python -m)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncppo.config import config_from_yaml, load_config

PY = Path(sys.executable)
SCRIPT = PY.parent / "asyncppo"


def _run(*args: str, module: bool = False) -> subprocess.CompletedProcess:
    cmd = [str(PY), "-m", "asyncppo", *args] if module else [str(SCRIPT), *args]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)


def test_console_script_is_installed():
    assert SCRIPT.is_file(), "pip install -e . should have created the asyncppo console script"


def test_top_level_help():
    res = _run("--help")
    assert res.returncode == 0
    assert "launch" in res.stdout and "docs/configuration.md" in res.stdout


def test_launch_help_explains_every_flag():
    res = _run("launch", "--help", module=True)
    assert res.returncode == 0
    for flag in ("--rollout-gpus", "--train-gpus", "--dry-run", "--config-dir", "KEY=VALUE"):
        assert flag in res.stdout
    assert "examples:" in res.stdout and "algorithm=grpo" in res.stdout and "docs/configuration.md" in res.stdout


def test_no_command_prints_help_and_exits_2():
    res = _run()
    assert res.returncode == 2 and "launch" in res.stdout


@pytest.mark.parametrize("module", [False, True], ids=["console-script", "python-m"])
def test_dry_run_prints_round_tripping_yaml_and_plan(module):
    overrides = ["algorithm=grpo", "algorithm.pg_clip=0.28", "rollout.max_staleness=4"]
    # overrides both before and after the flags
    res = _run("launch", overrides[0], "--dry-run", "--rollout-gpus", "2", *overrides[1:], module=module)
    assert res.returncode == 0, res.stderr
    printed = config_from_yaml(res.stdout)  # the plan is in YAML comments: the whole output parses
    assert printed.algorithm.adv_estimator == "grpo" and printed.algorithm.pg_clip == 0.28
    assert printed.algorithm.clip_ratio_low == 0.28 and printed.rollout.max_staleness == 4
    assert printed.cluster.rollout_gpus == 2
    expected = load_config(overrides + ["cluster.rollout_gpus=2"])
    expected.trainer.output_dir = printed.trainer.output_dir  # a timestamp taken in the other process
    assert printed == expected
    assert "# placement plan: 1 learner rank(s), 2 rollout worker(s) [engine=hf], 2 GPU(s)" in res.stdout
    assert "rollout-1" in res.stdout and "learner-0" in res.stdout


def test_flags_map_to_cluster_keys_and_win():
    res = _run("launch", "--dry-run", "--train-gpus", "2", "cluster.train_gpus=1", "cluster.rollout_workers=3")
    assert res.returncode == 0, res.stderr
    cfg = config_from_yaml(res.stdout)
    assert cfg.cluster.train_gpus == 2 and cfg.cluster.rollout_gpus == 0
    assert "2 learner rank(s), 3 rollout worker(s)" in res.stdout


def test_bad_value_exits_2_with_clear_message():
    res = _run("launch", "--dry-run", "algorithm.clip_ratio_c=0.9", "rollout.sync_every=0")
    assert res.returncode == 2
    assert "algorithm.clip_ratio_c=0.9: must be > 1" in res.stderr
    assert "rollout.sync_every=0" in res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""


def test_bad_type_exits_2():
    res = _run("launch", "--dry-run", "rollout.max_staleness=lots")
    assert res.returncode == 2 and "rollout.max_staleness" in res.stderr and "lots" in res.stderr
    assert "Traceback" not in res.stderr


def test_unknown_key_exits_2_naming_it():
    res = _run("launch", "--dry-run", "rollout.max_stalenes=4", module=True)
    assert res.returncode == 2
    assert "rollout.max_stalenes: unknown key" in res.stderr and "rollout.max_staleness" in res.stderr
    assert "Traceback" not in res.stderr


def test_unknown_flag_exits_2():
    # (--gpus, the example this test used, is now a flag: the shared-device mode)
    res = _run("launch", "--dry-run", "--gpu-count", "2")
    assert res.returncode == 2 and "--gpu-count" in res.stderr


def test_warning_goes_to_stderr_and_run_continues():
    res = _run("launch", "--dry-run", "algorithm.use_kl_loss=true", "algorithm.add_token_level_kl=true")
    assert res.returncode == 0
    assert "warning:" in res.stderr and "penalised twice" in res.stderr
