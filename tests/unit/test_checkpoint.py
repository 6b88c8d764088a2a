"""Learner checkpoints on a real tiny transformers model: a resumed learner continues bit for bit, a crash in the middle
of a save never leaves a checkpoint that looks complete, and a resumed admission controller keeps the staleness bound."""

from __future__ import annotations

import os

import pytest
import torch

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner import checkpoint as C
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.models import load_actor, load_critic, load_reference
from asyncppo.learner.run_files import latest_name
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.learner.value_head import SharedValueHead
from asyncppo.staleness import AdmissionController

from test_learner import _groups  # the random prompt groups the learner tests use

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=1, intermediate=128, seed=3)


def _cfg() -> AsyncPPOConfig:
    """Every stateful part switched on: critic (gae), adaptive KL-in-reward, running reward norm, warm-up schedule,
    shuffled mini-batches (the generator)."""
    cfg = AsyncPPOConfig()
    a = cfg.algorithm
    a.clip_ratio_low = a.clip_ratio_high = a.pg_clip
    a.loss_agg_norm_length = 8
    a.adv_estimator = "gae"
    a.add_token_level_kl = True
    a.kl_penalty = "k1"
    a.kl_ctrl.type = "adaptive"
    a.kl_ctrl.init_kl_coef = 0.05
    a.reward_norm = "running"
    a.ppo_mini_batch_size = 2
    a.ppo_epochs = 2
    cfg.trainer.warmup_steps = 5
    cfg.trainer.lr = 1e-3
    return cfg


def _build(cfg, actor_path, model_dir, ckpt=None):
    actor = load_actor(actor_path, torch.float32, CPU)
    critic = load_critic(model_dir, torch.float32, CPU)
    ref = load_reference(model_dir, torch.float32, CPU)
    updater = PPOUpdate(cfg, actor, critic, ref, CPU)
    state = C.restore(ckpt, updater, critic) if ckpt is not None else None
    return updater, state


def _batches(start, n):
    return [collate_groups(_groups(num_groups=4, n=4, seed=s), 0) for s in range(start, start + n)]


def _flat(module):
    return torch.cat([p.detach().flatten() for p in module.parameters()])


def _save(run_dir, version, updater, tokenizer_dir, keep=2, **extra):
    from transformers import AutoTokenizer

    return C.save_checkpoint(run_dir, version, actor=updater.actor, tokenizer=AutoTokenizer.from_pretrained(
        tokenizer_dir), updater=updater, critic=updater.critic, keep=keep, extra=extra)


def test_round_trip_resumes_bit_for_bit(model_dir, tmp_path):
    cfg = _cfg()
    torch.manual_seed(0)
    a, _ = _build(cfg, model_dir, model_dir)
    for b in _batches(0, 3):
        a.step(b)
    run = str(tmp_path / "run")
    rng_at_save = torch.get_rng_state()
    ckpt = _save(run, 3, a, model_dir, samples_trained=48)
    # the uninterrupted run goes on ...
    metrics_a = [a.step(b) for b in _batches(3, 2)]

    torch.manual_seed(999)  # a fresh process would have some other RNG state
    found = C.resolve_checkpoint(run)  # a run dir resolves through checkpoints/latest
    assert found == ckpt and found.version == 3
    assert open(os.path.join(run, "checkpoints", "latest")).read().strip() == "step_3"
    b, state = _build(cfg, found.actor_dir, model_dir, found)
    assert state["version"] == 3 and state["extra"] == {"samples_trained": 48}
    # every restored state equals the saved one (the file itself loads with weights_only=True)
    raw = torch.load(found.state_file, weights_only=True)
    assert raw["actor_opt"]["state"][0]["step"] == 12  # 3 updates x 2 epochs x (4 groups / mini-batch of 2)
    assert torch.equal(torch.get_rng_state(), rng_at_save)  # restored over the seed 999 above
    assert torch.equal(b.generator.get_state(), raw["generator"])
    assert b.kl_ctrl.value != cfg.algorithm.kl_ctrl.init_kl_coef  # adapted before the save, and restored
    assert b.reward_stats.count == 3 * 16
    # ... and the resumed one reproduces it exactly: weights, optimiser moments, lr schedule, KL coef, shuffling
    metrics_b = [b.step(x) for x in _batches(3, 2)]
    assert torch.equal(_flat(a.actor), _flat(b.actor))
    assert torch.equal(_flat(a.critic), _flat(b.critic))
    for key in ("actor/lr", "actor/kl_coef", "actor/pg_loss", "critic/vf_loss", "actor/mismatch_kl"):
        assert [m[key] for m in metrics_a] == [m[key] for m in metrics_b], key
    assert a.kl_ctrl.value == b.kl_ctrl.value
    assert a.reward_stats.state_dict() == b.reward_stats.state_dict()
    assert torch.equal(a.generator.get_state(), b.generator.get_state())
    sa, sb = a.actor_opt.state_dict()["state"], b.actor_opt.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)


def test_without_restore_the_continuation_differs(model_dir, tmp_path):
    """The round trip test can fail: loading only the actor weights (fresh optimiser, schedule, KL coef) diverges."""
    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    for b in _batches(0, 3):
        a.step(b)
    ckpt = _save(str(tmp_path / "run"), 3, a, model_dir)
    b, _ = _build(cfg, ckpt.actor_dir, model_dir)
    assert torch.equal(_flat(a.actor), _flat(b.actor))
    a.step(_batches(3, 1)[0])
    b.step(_batches(3, 1)[0])
    assert not torch.equal(_flat(a.actor), _flat(b.actor))


def test_checkpoint_actor_is_a_plain_hf_model_dir(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    a.step(_batches(0, 1)[0])
    ckpt = _save(str(tmp_path / "run"), 1, a, model_dir)
    m = AutoModelForCausalLM.from_pretrained(ckpt.actor_dir)
    assert torch.equal(_flat(m), _flat(a.actor))
    assert AutoTokenizer.from_pretrained(ckpt.actor_dir).encode("12+34=") == AutoTokenizer.from_pretrained(
        model_dir).encode("12+34=")


def test_crash_mid_save_keeps_latest_on_the_previous_checkpoint(model_dir, tmp_path):
    """A learner killed in the middle of a save leaves an unfinished ``.tmp-step_N`` (here: step 2's files as a kill
    after the critic leaves them, copied from a real save, without its trainer state and meta); nothing names it."""
    import shutil

    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    run = str(tmp_path / "run")
    root = os.path.join(run, "checkpoints")
    _save(run, 1, a, model_dir)
    scratch = _save(str(tmp_path / "scratch"), 2, a, model_dir).path
    shutil.copytree(os.path.join(scratch, C.ACTOR_DIR), os.path.join(root, ".tmp-step_2", C.ACTOR_DIR))
    shutil.copy(os.path.join(scratch, C.CRITIC_FILE), os.path.join(root, ".tmp-step_2", C.CRITIC_FILE))
    assert not os.path.exists(os.path.join(root, "step_2"))
    assert open(os.path.join(root, "latest")).read().strip() == "step_1"
    assert C.resolve_checkpoint(run).version == 1
    # the next good save replaces the leftovers
    _save(run, 3, a, model_dir)
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"]
    assert C.resolve_checkpoint(run).version == 3


def test_a_save_that_hits_a_file_size_limit_is_a_clear_error_that_leaves_nothing_behind(model_dir, tmp_path):
    """A real write failure (the OS refuses a file past ``RLIMIT_FSIZE``, as a full disk refuses one past its
    space): a :class:`CheckpointWriteError` naming the checkpoint, the error and the free space; the unfinished
    directory is removed; ``latest`` still names the previous checkpoint; once the limit is lifted the next save
    is written as usual."""
    import resource
    import signal

    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    run = str(tmp_path / "run")
    root = os.path.join(run, "checkpoints")
    _save(run, 1, a, model_dir)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # config.json fits, the weights do not
        with pytest.raises(C.CheckpointWriteError) as err:
            _save(run, 2, a, model_dir)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, old_handler)
    message = str(err.value)
    assert message.startswith(f"checkpoint step_2 could not be written to {root}: ")
    assert "File too large" in message and "GiB free of" in message, message
    assert sorted(os.listdir(root)) == ["latest", "step_1"]  # no .tmp-step_2 left taking space
    assert open(os.path.join(root, "latest")).read().strip() == "step_1"
    assert latest_name(run) == "step_1" and C.resolve_checkpoint(run).version == 1
    _save(run, 3, a, model_dir)
    assert sorted(os.listdir(root)) == ["latest", "step_1", "step_3"] and C.resolve_checkpoint(run).version == 3


def test_a_checkpoints_path_that_is_not_a_directory_is_the_same_clear_error(model_dir, tmp_path):
    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").write_text("not a directory")
    with pytest.raises(C.CheckpointWriteError, match=r"checkpoint step_4 could not be written .*FileExistsError"):
        _save(str(run), 4, a, model_dir)
    assert latest_name(str(run)) is None and (run / "checkpoints").read_text() == "not a directory"


def test_keeps_the_newest_checkpoints(model_dir, tmp_path):
    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    run = str(tmp_path / "run")
    for v in (2, 4, 6, 8):
        _save(run, v, a, model_dir, keep=2)
    assert sorted(os.listdir(os.path.join(run, "checkpoints"))) == ["latest", "step_6", "step_8"]
    assert C.resolve_checkpoint(os.path.join(run, "checkpoints", "step_6")).version == 6
    os.remove(os.path.join(run, "checkpoints", "latest"))  # lost 'latest': the newest complete one
    assert C.resolve_checkpoint(run).version == 8


def test_missing_or_incompatible_checkpoint_is_a_clear_error(model_dir, tmp_path):
    with pytest.raises(C.CheckpointError, match="no checkpoint found"):
        C.resolve_checkpoint(str(tmp_path))
    with pytest.raises(C.CheckpointError, match="no such directory"):
        C.resolve_checkpoint(str(tmp_path / "nope"))
    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    ckpt = _save(str(tmp_path / "run"), 1, a, model_dir)
    C.check_compatible(ckpt, model_dir, needs_critic=True)  # the model it came from: fine
    other = build_tiny_model(str(tmp_path / "other"), hidden=128, heads=2, intermediate=128)
    with pytest.raises(C.CheckpointError, match="hidden_size: checkpoint 64 vs model 128"):
        C.check_compatible(ckpt, other, needs_critic=True)
    # the kind of critic is recorded: resuming a value model's checkpoint into a value-head run (or back) is refused
    assert ckpt.critic_kind == "model"
    C.check_compatible(ckpt, model_dir, needs_critic=True, wanted_critic="model")
    with pytest.raises(C.CheckpointError, match="holds a separate value model as its critic, but this run trains a "
                                                 "value head on the actor"):
        C.check_compatible(ckpt, model_dir, needs_critic=True, wanted_critic="head")
    head_updater = PPOUpdate(cfg, load_actor(model_dir, torch.float32, CPU), SharedValueHead(64), None, CPU)
    head_ckpt = _save(str(tmp_path / "run-head"), 1, head_updater, model_dir)
    assert head_ckpt.critic_kind == "head"
    with pytest.raises(C.CheckpointError, match="model.shared_backbone=True that wrote it"):
        C.check_compatible(head_ckpt, model_dir, needs_critic=True, wanted_critic="model")
    os.remove(ckpt.critic_file)
    with pytest.raises(C.CheckpointError, match="no critic"):
        C.check_compatible(ckpt, model_dir, needs_critic=True)


# ------------------------------------------------------------------------------------------------ admission on resume
def _drain(ctrl):
    out = []
    while (t := ctrl.try_acquire()) is not None:
        out.append(t)
    return out


@pytest.mark.parametrize("B,k,V", [(3, 0, 4), (2, 1, 6), (4, 2, 3)])
def test_resumed_admission_matches_an_uninterrupted_run(B, k, V):
    """Resumed at version V, the controller grants exactly what a controller that ran through V would grant next,
    and never more than (k + 1) * B tickets are in flight."""
    through = AdmissionController(B, k)
    pending = []
    for v in range(V):  # the old run: B groups trained per version, the rest in flight
        through.set_version(v)
        pending += _drain(through)
        for t in pending[:B]:
            through.consumed(t)
        pending = pending[B:]
    for t in pending:
        through.release(t)  # in flight at the crash: lost with the old process
    resumed = AdmissionController(B, k, start_version=V)
    assert resumed.version == V
    pending = []
    for v in range(V, V + 6):
        resumed.set_version(v)
        through.set_version(v)
        got = _drain(resumed)
        assert got == _drain(through)
        if v == V:  # the workers are not starved either: the full window opens at once
            assert len(got) == (k + 1) * B
        pending += got
        assert len(pending) == resumed.stats()["in_flight"] <= (k + 1) * B
        assert all(t.min_version >= v - k for t in got)
        assert all(t.index >= V * B for t in got)
        for t in pending[:B]:
            resumed.consumed(t)
            through.consumed(t)
        pending = pending[B:]
    # without the offset the same version would flood the workers
    assert len(_drain(AdmissionController(B, k, version=V))) == (k + V + 1) * B > (k + 1) * B


# ------------------------------------------------------------------------------------------------ options
def test_checkpoint_options_are_validated():
    from asyncppo.config import ConfigError, load_config

    cfg = load_config(["trainer.save_every=3", "trainer.resume_from=/runs/a"])
    assert (cfg.trainer.save_every, cfg.trainer.keep_checkpoints, cfg.trainer.resume_from) == (3, 2, "/runs/a")
    with pytest.raises(ConfigError, match=r"trainer.keep_checkpoints=0: must be > 0"):
        load_config(["trainer.keep_checkpoints=0"])
    # several learner ranks checkpoint too (sharded: tests/component/test_checkpoint_sharded.py)
    cfg = load_config(["trainer.save_every=3", "cluster.train_gpus=2", "rollout.rollout_batch_size=8"])
    assert cfg.cluster.train_gpus == 2 and cfg.trainer.save_every == 3


def test_the_disk_plan_estimates_a_real_checkpoint_within_a_few_percent(model_dir, tmp_path):
    """launch/disk_plan.py's size of one checkpoint against the bytes a real save of the same model writes (actor,
    critic, both optimisers; float32 on CPU): the tokenizer, configs and the trainer state's small parts are the
    difference."""
    import json

    from asyncppo.launch.disk_plan import checkpoint_bytes
    from asyncppo.launch.memory_plan import LearnerLoad, shape_from_config

    cfg = _cfg()
    a, _ = _build(cfg, model_dir, model_dir)
    a.step(_batches(0, 1)[0])  # AdamW's moments exist once it has stepped
    path = _save(str(tmp_path / "run"), 1, a, model_dir).path
    written = sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
    with open(os.path.join(model_dir, "config.json")) as f:
        shape = shape_from_config(json.load(f))
    estimate = checkpoint_bytes(shape, LearnerLoad(dtype_bytes=4, optimizer_bytes_per_param=8, critic=True,
                                                   reference=False, micro_batch_tokens=1))
    assert 0.9 < written / estimate < 1.1, (written, estimate)


def test_a_bug_in_the_write_is_raised_as_it_is_not_turned_into_a_warning(tmp_path):
    """Only the storage's refusals become :class:`CheckpointWriteError` (which the loop warns about and trains on);
    a ``TypeError`` of our own making is raised as it is, after the unfinished directory is removed."""
    run = str(tmp_path / "run")
    with pytest.raises(TypeError, match="not a storage problem"):
        with C.writing(run, 5) as (root, name, tmp):
            assert name == "step_5" and os.path.isdir(tmp)
            raise TypeError("not a storage problem")
    assert os.listdir(os.path.join(run, "checkpoints")) == []
    with pytest.raises(C.CheckpointWriteError, match="step_6 could not be written .*OSError: \\[Errno 28\\]"):
        with C.writing(run, 6):
            raise OSError(28, "No space left on device")


def test_step_of_reads_a_checkpoints_step_from_its_name_and_nothing_else():
    from asyncppo.learner.run_files import step_of

    assert step_of("step_300") == 300 and step_of("step_0") == 0
    for other in ("latest", ".tmp-step_5", "step_", "step_5a", "step_-1", "final"):
        assert step_of(other) is None, other
