"""The placement plan derived from cluster options."""

from __future__ import annotations

from asyncppo.config import load_config
from asyncppo.launch.plan import format_plan, make_placement_plan


def test_cpu_only_plan():
    plan = make_placement_plan(load_config(["cluster.rollout_workers=3", "cluster.cpus_per_worker=0.5"]))
    assert [(r.name, r.kind, r.device, r.gpus) for r in plan.roles] == [
        ("learner-0", "learner", "cpu", 0),
        ("rollout-0", "rollout", "cpu", 0),
        ("rollout-1", "rollout", "cpu", 0),
        ("rollout-2", "rollout", "cpu", 0),
    ]
    assert plan.total_gpus == 0 and plan.total_cpus == 2.0
    assert plan.weight_sync_world_size == 4
    assert plan.engine == "hf"  # the built-in task's preset (configs/data/addition.yaml)


def test_gpu_plan_one_gpu_per_role():
    cfg = load_config(["cluster.rollout_gpus=3", "cluster.train_gpus=2", "cluster.rollout_workers=7",
                       "rollout.engine=hf", "cluster.trajectory_port=5555"])
    plan = make_placement_plan(cfg)
    assert [r.name for r in plan.learners] == ["learner-0", "learner-1"]
    assert [r.name for r in plan.rollouts] == ["rollout-0", "rollout-1", "rollout-2"]  # rollout_workers ignored
    assert all(r.device == "gpu" and r.gpus == 1 for r in plan.roles)
    assert plan.total_gpus == 5 and plan.weight_sync_world_size == 4
    text = format_plan(plan)
    assert "2 learner rank(s), 3 rollout worker(s) [engine=hf], 5 GPU(s)" in text
    assert "trajectory=5555" in text and "control=auto" in text
    assert len([line for line in text.splitlines() if line.strip().startswith(("learner-", "rollout-"))]) == 5


def test_mixed_plan_gpu_learner_cpu_rollout():
    plan = make_placement_plan(load_config(["cluster.train_gpus=1", "cluster.rollout_workers=2"]))
    assert [(r.kind, r.device) for r in plan.roles] == [("learner", "gpu"), ("rollout", "cpu"), ("rollout", "cpu")]
