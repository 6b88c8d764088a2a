"""``--gpus N``: the memory split of one shared device (hand-computed numbers), the placement, and the refusal of an
impossible split by name before anything starts."""

from __future__ import annotations

import json

import pytest

from asyncppo import cli
from asyncppo.config import load_config
from asyncppo.launch.memory_plan import GIB, LearnerLoad, ModelShape, shape_from_config, split_memory
from asyncppo.launch.plan import format_plan, make_placement_plan
from asyncppo.launch.resolve import plan_launch
from asyncppo.launch.shared_device import resolve_shared_device

# Qwen2.5-0.5B's config.json (the fields the planner reads)
QWEN_05B = {"model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "intermediate_size": 4864,
            "tie_word_embeddings": True}


def test_parameter_count_of_a_05b_qwen2_by_hand():
    shape = shape_from_config(QWEN_05B)
    assert shape.head_dim == 64 and shape.qkv_bias and shape.tied
    embed = 151936 * 896  # 136,134,656
    q = 896 * 896 + 896  # 803,712 (with bias)
    kv = 896 * 128 + 128  # 114,816 each for k and v (2 kv heads x 64)
    o = 896 * 896  # 802,816
    mlp = 3 * 896 * 4864  # 13,074,432
    layer = q + 2 * kv + o + mlp + 2 * 896  # 14,912,384
    assert layer == 14_912_384
    assert shape.params() == embed + 24 * layer + 896 == 494_032_768  # tied: no separate head
    assert shape.kv_bytes_per_token(2) == 2 * 24 * 2 * 64 * 2 == 12_288


def test_split_of_05b_bf16_with_fp32_adamw_on_80gib():
    """bf16 weights and gradients, AdamW moments in fp32 (8 bytes/param), 4096 tokens per micro-batch."""
    shape = shape_from_config(QWEN_05B)
    load = LearnerLoad(dtype_bytes=2, optimizer_bytes_per_param=8, critic=False, reference=False,
                       micro_batch_tokens=4096)
    s = split_memory(shape, 80 * GIB, 0.5, 2, load)
    p = 494_032_768
    assert s.weights * GIB == p * 2 == 988_065_536 and s.gradients == s.weights
    assert s.optimizer * GIB == p * 8 == 3_952_262_144
    # activations: 4096 tokens x 24 layers x (10 x 896 + 3 x 4864 = 23,552) x 2 bytes + 3 x 4096 x 151936 x 4 bytes
    assert s.activations * GIB == 4096 * 24 * 23_552 * 2 + 3 * 4096 * 151_936 * 4 == 12_098_469_888
    assert s.learner_total * GIB == 18_026_863_104  # = 16.79 GiB
    assert s.engine == 40.0 and s.learner_budget == 39.0  # 80 - 40 - 2 x 0.5 GiB of CUDA contexts
    # KV cache: 40 GiB - 0.92 GiB of bf16 weights - 1 GiB workspace = 40,887,865,600 bytes / 12,288 per token
    assert s.kv_cache * GIB == 40 * GIB - 988_065_536 - GIB
    assert s.kv_tokens == 3_327_463
    assert s.max_utilization == pytest.approx((79 * GIB - 18_026_863_104) / (80 * GIB))  # 0.7776
    assert s.problem == ""


def test_impossible_splits_name_the_option():
    shape = shape_from_config(QWEN_05B)
    light = LearnerLoad(dtype_bytes=2, optimizer_bytes_per_param=4, critic=False, reference=False,
                        micro_batch_tokens=256)
    crowded = split_memory(shape, 16 * GIB, 0.9, 2, light)  # the learner gets 16 - 14.4 - 1 = 0.6 GiB of its ~4.4
    need = 494_032_768 * (2 + 2 + 4) + 256 * 24 * 23_552 * 2 + 3 * 256 * 151_936 * 4  # 4,708,574,208 = 4.39 GiB
    assert crowded.learner_budget == pytest.approx(0.6) and crowded.learner_total * GIB == need
    assert crowded.max_utilization == pytest.approx((15 * GIB - need) / (16 * GIB))  # 0.663
    assert "lower rollout.gpu_memory_utilization to 0.66 or less" in crowded.problem
    assert split_memory(shape, 16 * GIB, crowded.max_utilization - 0.01, 2, light).problem == ""
    starved = split_memory(shape, 16 * GIB, 0.1, 2, light)  # 1.6 GiB: weights 0.92 + 1 workspace leave no KV cache
    assert "raise rollout.gpu_memory_utilization" in starved.problem and starved.kv_tokens == 0
    heavy = LearnerLoad(dtype_bytes=4, optimizer_bytes_per_param=8, critic=True, reference=True,
                        micro_batch_tokens=2048)
    alone = split_memory(shape, 16 * GIB, 0.5, 2, heavy)  # ~24 GiB: more than the whole device
    assert alone.max_utilization < 0 and "model.dtype=bfloat16" in alone.problem


def test_auto_device_follows_the_probe():
    cfg = load_config(["cluster.shared_gpus=1"])
    assert resolve_shared_device(cfg, lambda: True).cluster.shared_device == "cuda"
    assert resolve_shared_device(cfg, lambda: False).cluster.shared_device == "cpu"
    plain = load_config([])
    assert resolve_shared_device(plain, lambda: True) is plain  # no --gpus: untouched


def test_two_shared_cuda_devices_place_a_learner_rank_and_an_engine_on_each():
    cfg = load_config(["cluster.shared_gpus=2", "cluster.shared_device=cuda", "algorithm=grpo",
                       "rollout.rollout_batch_size=8"])
    plan = make_placement_plan(cfg)
    assert [(r.name, r.device, r.gpus, r.gpu_ids) for r in plan.roles] == [
        ("learner-0", "gpu", 0.5, (0,)), ("learner-1", "gpu", 0.5, (1,)),
        ("rollout-0", "gpu", 0.5, (0,)), ("rollout-1", "gpu", 0.5, (1,))]
    assert plan.total_gpus == 2
    assert "shares device 1 with rollout-1" in format_plan(plan)
    launch = plan_launch(cfg)
    assert launch.bundles() == [{"CPU": 2.0, "GPU": 1.0}] * 2
    assert launch.learner_slot(1) == (1, {"CPU": 1.0, "GPU": 0.5})
    assert launch.worker_slot(1) == (1, {"CPU": 1.0, "GPU": 0.5})  # the same bundle: the same GPU
    assert "VLLM_TARGET_DEVICE" not in launch.ray_init["runtime_env"]["env_vars"]


def test_shared_cpu_device_has_no_gpu_in_its_bundle():
    launch = plan_launch(load_config(["cluster.shared_gpus=1", "cluster.shared_device=cpu"]))
    assert launch.bundles() == [{"CPU": 2.0}] and launch.worker_slot(0) == (0, {"CPU": 1.0})
    assert launch.ray_init["runtime_env"]["env_vars"]["VLLM_TARGET_DEVICE"] == "cpu"


def _model_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN_05B))
    return str(tmp_path)


def test_dry_run_shows_the_split(tmp_path, capsys):
    code = cli.main(["launch", "--dry-run", "--gpus", "1", "cluster.shared_device=cuda", "cluster.device_memory_gib=80",
                     f"model.path={_model_dir(tmp_path)}", "model.dtype=bfloat16", "rollout.dtype=bfloat16"])
    out = capsys.readouterr().out
    assert code == 0
    assert "# memory of one shared device: 80.00 GiB; engine 40.00 GiB" in out
    assert "AdamW" in out and "KV cache" in out


def test_impossible_split_is_refused_by_name(tmp_path, capsys):
    code = cli.main(["launch", "--dry-run", "--gpus", "1", "cluster.shared_device=cuda", "cluster.device_memory_gib=8",
                     "rollout.gpu_memory_utilization=0.9", f"model.path={_model_dir(tmp_path)}"])
    err = capsys.readouterr().err
    assert code == 2
    assert "--gpus 1" in err and "rollout.gpu_memory_utilization" in err and "learner needs about" in err


def test_gpus_excludes_the_separate_pools(capsys):
    assert cli.main(["launch", "--dry-run", "--gpus", "1", "--train-gpus", "1"]) == 2
    assert "cluster.shared_gpus" in capsys.readouterr().err


def test_several_shared_devices_must_split_the_mini_batch_evenly():
    from asyncppo.config import ConfigError

    with pytest.raises(ConfigError, match="cluster.shared_gpus"):
        load_config(["cluster.shared_gpus=3", "rollout.rollout_batch_size=8"])  # 4 mini-batches of 2 groups
    with pytest.raises(ConfigError, match="rollout.tensor_parallel_size"):
        load_config(["cluster.shared_gpus=1", "rollout.engine=vllm", "rollout.tensor_parallel_size=2"])
