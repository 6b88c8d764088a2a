"""The resolved launch plan (launch/resolve.py): the facts --dry-run prints, and the refusals made before Ray starts."""

from __future__ import annotations

import pytest

from asyncppo.cli import main
from asyncppo.config import load_config
from asyncppo.launch.resolve import LaunchError, plan_launch, ray_on_loopback, resolve_plan


def test_plan_from_the_config_alone():
    plan = plan_launch(load_config(["cluster.rollout_gpus=2", "cluster.train_gpus=1",
                                    "+cluster.rollout_resources.rollout_node=1"]))
    assert (plan.num_learners, plan.num_workers) == (1, 2)
    assert plan.learner_bundle == {"CPU": 1.0, "GPU": 1.0}
    assert plan.worker_bundle == {"CPU": 1.0, "GPU": 1.0, "rollout_node": 1.0}
    assert plan.ray_on_loopback and plan.replace_dead_workers and plan.model_path == ""
    assert plan.ray_init["runtime_env"]["env_vars"]["OMP_WAIT_POLICY"]
    # embodied runs replace a dead env worker too (they ended on a death before)
    assert plan_launch(load_config(["env=cartpole"])).replace_dead_workers
    assert not plan_launch(load_config(["env=cartpole", "cluster.max_worker_restarts=0"])).replace_dead_workers


@pytest.mark.parametrize("overrides, restarts", [
    ([], 3),  # checkpoints by default (save_every=20): on, up to trainer.max_learner_restarts
    (["trainer.save_every=0"], 0),  # no checkpoints: a restart would start over, so auto_resume defaults off
    (["trainer.save_every=10"], 3),
    (["trainer.save_every=10", "trainer.max_learner_restarts=1"], 1),
    (["trainer.save_every=10", "trainer.auto_resume=false"], 0),
    (["trainer.auto_resume=true"], 3),  # forced without checkpoints: restarts from version 0
])
def test_learner_restarts_follow_auto_resume(overrides, restarts):
    assert plan_launch(load_config(overrides)).max_learner_restarts == restarts


def test_ray_stays_on_loopback_only_for_a_local_or_loopback_cluster():
    assert ray_on_loopback(load_config([]))
    assert ray_on_loopback(load_config(["cluster.address=127.0.0.1:6379"]))
    assert not ray_on_loopback(load_config(["cluster.address=auto"]))
    assert not ray_on_loopback(load_config(["cluster.address=10.0.0.5:6379"]))


def test_dry_run_prints_the_launch_plan_as_comments(capsys):
    assert main(["launch", "--dry-run", "cluster.rollout_workers=2"]) == 0
    out = capsys.readouterr().out
    for fact in ("# run directory: ", "# ray.init: ", "# bundles: 1 x learner", "# actor environment: ",
                 "# dead rollout workers: replaced", "# model: builtin:"):
        assert fact in out, fact


@pytest.mark.filterwarnings("ignore:model.path=builtin")  # a built-in model with a data file: warned, legal
def test_a_missing_data_file_is_refused_before_anything_starts(tmp_path):
    missing = tmp_path / "nope.jsonl"
    cfg = load_config([f"data.train_files=[{missing}]", f"trainer.output_dir={tmp_path / 'run'}"])
    with pytest.raises(LaunchError, match="does not exist or is not readable"):
        resolve_plan(cfg)
    assert not (tmp_path / "run").exists()


def test_a_directory_holding_a_run_is_refused(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    with pytest.raises(LaunchError, match="already holds a run"):
        resolve_plan(load_config([f"trainer.output_dir={tmp_path}"]))
