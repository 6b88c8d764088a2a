"""The checkpoints' disk against the space free, told before a run starts: sizes worked out by hand, the warning
and when there is none. (A real checkpoint's size against the estimate: tests/unit/test_checkpoint.py.)"""

from __future__ import annotations

from asyncppo.config import load_config
from asyncppo.launch.disk_plan import checkpoint_bytes, disk_lines
from asyncppo.launch.memory_plan import LearnerLoad, ModelShape

# vocab 10, hidden 4, one layer, one head of 4, MLP 8, no biases, untied: embeddings 40, attention q/k/v/o 4 x 16,
# MLP 3 x 32, two norms 8, final norm 4, head 40 -> 252 parameters
SHAPE = ModelShape(vocab=10, hidden=4, layers=1, heads=1, kv_heads=1, head_dim=4, intermediate=8, tied=False,
                   qkv_bias=False)


def _load(**kw):
    return LearnerLoad(**{"dtype_bytes": 4, "optimizer_bytes_per_param": 8, "critic": False, "reference": False,
                          "micro_batch_tokens": 1, **kw})


def test_sizes_by_hand():
    assert SHAPE.params() == 252
    assert checkpoint_bytes(SHAPE, _load()) == 252 * 4 + 252 * 8  # actor + its two moments
    assert checkpoint_bytes(SHAPE, _load(critic=True)) == 2 * (252 * 4 + 252 * 8)  # and the critic's
    assert checkpoint_bytes(SHAPE, _load(dtype_bytes=2, optimizer_bytes_per_param=4)) == 252 * 2 + 252 * 4
    # LoRA: the merged actor, then 10 adapter parameters in float32 with their two moments
    assert checkpoint_bytes(SHAPE, _load(adapter_params=10)) == 252 * 4 + 10 * 4 + 10 * 8


def test_the_warning_names_what_is_needed_and_what_is_free(tmp_path):
    cfg = load_config([])  # the default: the built-in model on the CPU learner (float32), value head on the actor
    lines, warning = disk_lines(cfg, str(tmp_path / "run"), free=lambda path: 64 << 30)
    assert warning is None and len(lines) == 1
    assert lines[0].startswith("checkpoints: ~6.1 MiB each, up to 3 on disk while the newest is written "
                               "(trainer.keep_checkpoints=2), ~20.2 MiB in all with the final model; 64.0 GiB free "
                               "there")
    lines, warning = disk_lines(cfg, str(tmp_path / "run"), free=lambda path: 10 << 20)
    assert warning == (f"WARNING: this run's checkpoints need ~20.2 MiB at {tmp_path / 'run'} but 10.0 MiB are "
                       "free: free space, lower trainer.keep_checkpoints, or choose a trainer.output_dir on a larger "
                       "disk (a checkpoint that cannot be written is skipped with a warning and the run trains on)")
    cfg = load_config(["trainer.keep_checkpoints=1"])  # two on disk at once: 2 x 6.1 + 2.0 MiB, rounded
    assert "~14.1 MiB" in disk_lines(cfg, str(tmp_path), free=lambda path: 10 << 20)[1]


def test_nothing_to_say_without_checkpoints_or_a_readable_model(tmp_path):
    for overrides in (["trainer.save_every=0"], [f"model.path={tmp_path / 'no-model-here'}"],
                      ["env=cartpole"]):  # embodied: kilobytes
        assert disk_lines(load_config(overrides), str(tmp_path), free=lambda path: 0) == ([], None), overrides


def test_unknown_free_space_is_said_not_warned(tmp_path):
    lines, warning = disk_lines(load_config([]), str(tmp_path), free=lambda path: None)
    assert warning is None and lines[0].endswith("free space unknown")
