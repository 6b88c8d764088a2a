"""Placement with tensor-parallel rollout engines: N rollout GPUs give N / TP engines of TP GPUs, one bundle each."""

from __future__ import annotations

import pytest

from asyncppo.config import load_config
from asyncppo.config.validate import ConfigError
from asyncppo.launch.plan import (check_engine_fits, format_plan, make_placement_plan, num_rollout_engines,
                                  rollout_bundle)


# several learner ranks train a separate critic (validate.py); the default task preset may share the backbone
SEPARATE_CRITIC = ["model.shared_backbone=false"]


VLLM = "rollout.engine=vllm"  # TP is a vLLM feature; the built-in task's preset generates with transformers


def _plan(*overrides):
    return make_placement_plan(load_config([VLLM, *overrides]))


def test_rollout_8_gpus_tp2_with_4_learners():
    cfg = load_config([VLLM, "cluster.rollout_gpus=8", "rollout.tensor_parallel_size=2", "cluster.train_gpus=4",
                       "cluster.cpus_per_worker=2", *SEPARATE_CRITIC])
    plan = make_placement_plan(cfg)
    assert [(r.name, r.gpus, r.gpu_ids, r.tp) for r in plan.rollouts] == [
        ("rollout-0", 2, (0, 1), 2), ("rollout-1", 2, (2, 3), 2), ("rollout-2", 2, (4, 5), 2),
        ("rollout-3", 2, (6, 7), 2)]
    assert [(r.name, r.gpus, r.gpu_ids) for r in plan.learners] == [
        ("learner-0", 1, (0,)), ("learner-1", 1, (1,)), ("learner-2", 1, (2,)), ("learner-3", 1, (3,))]
    assert plan.total_gpus == 12 and plan.total_cpus == 16.0
    assert plan.weight_sync_world_size == 5  # learner rank 0 + one rank per engine, not per GPU
    assert num_rollout_engines(cfg) == 4 and rollout_bundle(cfg) == {"CPU": 2.0, "GPU": 2.0}
    text = format_plan(plan)
    assert "4 learner rank(s), 4 rollout worker(s) [engine=vllm], 12 GPU(s), 16 CPU(s)" in text
    assert "engine 0: GPUs 0,1 (TP=2, one bundle, one node)" in text
    assert "engine 3: GPUs 6,7 (TP=2, one bundle, one node)" in text
    assert "4 two-rank group(s)" in text


def test_rollout_4_gpus_tp4_is_one_engine():
    cfg = load_config([VLLM, "cluster.rollout_gpus=4", "rollout.tensor_parallel_size=4", "cluster.train_gpus=2",
                       *SEPARATE_CRITIC])
    plan = make_placement_plan(cfg)
    assert [(r.name, r.gpus, r.gpu_ids) for r in plan.rollouts] == [("rollout-0", 4, (0, 1, 2, 3))]
    assert plan.total_gpus == 6 and plan.weight_sync_world_size == 2
    assert rollout_bundle(cfg) == {"CPU": 1.0, "GPU": 4.0}
    assert "engine 0: GPUs 0,1,2,3 (TP=4" in format_plan(plan)


def test_tp1_plan_is_unchanged():
    plan = _plan("cluster.rollout_gpus=3", "cluster.train_gpus=1")
    assert [(r.gpus, r.gpu_ids, r.tp) for r in plan.rollouts] == [(1, (0,), 1), (1, (1,), 1), (1, (2,), 1)]
    assert "engine 1: GPU 1;" in format_plan(plan) and "TP=" not in format_plan(plan)


def test_cpu_tp_reserves_tp_cpus_per_worker():
    cfg = load_config([VLLM, "rollout.tensor_parallel_size=2", "cluster.rollout_workers=2", "cluster.cpus_per_worker=1.5"])
    plan = make_placement_plan(cfg)
    assert [(r.device, r.gpus, r.cpus, r.tp) for r in plan.rollouts] == [("cpu", 0, 3.0, 2), ("cpu", 0, 3.0, 2)]
    assert rollout_bundle(cfg) == {"CPU": 3.0} and num_rollout_engines(cfg) == 2
    assert plan.total_cpus == 1.5 + 6.0
    assert "engine 0: TP=2 engine processes on CPU" in format_plan(plan)


@pytest.mark.parametrize("overrides, key, words", [
    (["cluster.rollout_gpus=6", "rollout.tensor_parallel_size=4"], "cluster.rollout_gpus",
     "must be a multiple of rollout.tensor_parallel_size x pipeline_parallel_size = 4"),
    (["cluster.rollout_gpus=16", "rollout.tensor_parallel_size=16", "cluster.gpus_per_node=8"],
     "rollout.tensor_parallel_size", "must fit on one node (cluster.gpus_per_node=8)"),
    (["rollout.engine=hf", "rollout.tensor_parallel_size=2"], "rollout.tensor_parallel_size",
     "must be 1 with rollout.engine=hf"),
    (["rollout.pipeline_parallel_size=2", "cluster.rollout_gpus=2"], "rollout.pipeline_parallel_size",
     "must be 1"),
    (["rollout.tensor_parallel_size=0"], "rollout.tensor_parallel_size", "0"),
    (["cluster.gpus_per_node=-1"], "cluster.gpus_per_node", "-1"),
])
def test_invalid_splits_are_refused_before_anything_starts(overrides, key, words):
    with pytest.raises(ConfigError) as info:
        load_config([VLLM, *overrides])
    line = next((p for p in info.value.problems if p.startswith(key)), None)
    assert line is not None and words in line, info.value.problems


def test_engine_wider_than_any_ray_node_is_refused_at_launch():
    cfg = load_config([VLLM, "cluster.rollout_gpus=16", "rollout.tensor_parallel_size=16"])  # gpus_per_node unknown
    with pytest.raises(ValueError, match="16 GPUs per engine, but the largest Ray node has 8 GPU"):
        check_engine_fits(cfg, [8.0, 8.0])
    check_engine_fits(cfg, [16.0, 8.0])  # fits on the big node
    check_engine_fits(load_config([VLLM, "rollout.tensor_parallel_size=2"]), [0.0])  # CPU rollout: no GPU check
