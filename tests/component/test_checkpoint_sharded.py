"""Checkpoints of a learner on several ranks (2 processes, gloo, FSDP2 on CPU): each rank writes its own shards with
torch.distributed.checkpoint through the learner's command protocol, and a fresh 2-rank learner restored from them
continues bit for bit like the one that never stopped (weights, optimiser moments, schedule, KL controller, running
reward statistics and the mini-batch generator all restored)."""

from __future__ import annotations

import os

import pytest
import torch

from asyncppo.learner import checkpoint as C
from asyncppo.learner import distributed as D
from asyncppo.learner import sharding as S
from asyncppo.learner.batch import collate_groups
from asyncppo.learner.models import load_actor, load_critic, load_reference
from spawn_ranks import spawn_ranks

from test_checkpoint import _cfg as _stateful_cfg
from test_learner import _groups
from test_learner_distributed import _fsdp, _free_port

WORLD = 2
CPU = torch.device("cpu")


def _batches(start: int, n: int):
    return [collate_groups(_groups(num_groups=4, n=4, seed=s), 0) for s in range(start, start + n)]


def _cfg():
    cfg = _stateful_cfg()
    cfg.algorithm.micro_batch_size = 1  # equal micro-batch counts on both ranks (equal group sizes)
    return cfg


def _learner(cfg, actor_dir: str, model_dir: str, rank: int):
    torch.manual_seed(7)  # the critic's value head starts alike in both phases (phase 2 restores it anyway)
    actor = _fsdp(load_actor(actor_dir, torch.float64, CPU))
    critic = _fsdp(load_critic(model_dir, torch.float64, CPU).double())
    ref = load_reference(model_dir, torch.float64, CPU)
    return S.ShardedPPOUpdate(cfg, actor, critic, ref, CPU, rank=rank, world_size=WORLD), critic


def _train_and_gather(updater, critic, rank: int, batches, on_checkpoint=None):
    """Rank 0 drives (batches, then gathers actor and critic); the follower executes its commands until stop."""
    if rank > 0:
        D.run_follower(updater, on_checkpoint=on_checkpoint)
        return None
    for b in batches:
        updater.step(D.broadcast_batch(b))
    D.broadcast_gather(0)
    actor = D.gather_full_state_dict(updater.actor, rank)
    D.broadcast_gather(1)
    return actor, D.gather_full_state_dict(critic, rank)


def _worker(rank: int, port: int, model_dir: str, run_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    D.init_learner_group(rank, WORLD, "127.0.0.1", port, "gloo", timeout_s=120)
    result: dict = {}
    try:
        cfg = _cfg()
        # phase 1: two steps, a sharded checkpoint at version 2 (written by both ranks), two more steps
        updater, critic = _learner(cfg, model_dir, model_dir, rank)
        if rank == 0:
            from transformers import AutoTokenizer

            for b in _batches(0, 2):
                updater.step(D.broadcast_batch(b))
            D.broadcast_gather(0)
            plain = load_actor(model_dir, torch.float64, CPU)
            plain.load_state_dict(D.gather_full_state_dict(updater.actor, rank))

            def sharded(path: str) -> None:
                D.broadcast_checkpoint(2)
                C.save_sharded(path, updater, critic)

            C.save_checkpoint(run_dir, 2, actor=plain, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                              updater=updater, critic=critic, sharded=sharded, extra={"samples_trained": 32})
            result["after"] = _train_and_gather(updater, critic, rank, _batches(2, 2))
            D.broadcast_stop()
        else:
            _train_and_gather(updater, critic, rank, None, on_checkpoint=lambda v: C.save_sharded(
                C.sharded_tmp_dir(run_dir, v), updater, critic))
        # phase 2: a fresh 2-rank learner from the checkpoint continues with the same two batches
        ckpt = C.resolve_checkpoint(run_dir)
        updater2, critic2 = _learner(cfg, ckpt.actor_dir, model_dir, rank)
        state = C.restore(ckpt, updater2, critic2)  # collective: both ranks
        result["extra"] = state["extra"]
        result["resumed"] = _train_and_gather(updater2, critic2, rank, _batches(2, 2))
        if rank == 0:
            D.broadcast_stop()
        # control: the same weights without the restored optimiser/schedule/generator state continue differently
        updater3, critic3 = _learner(cfg, ckpt.actor_dir, model_dir, rank)
        result["weights_only"] = _train_and_gather(updater3, critic3, rank, _batches(2, 2))
        if rank == 0:
            D.broadcast_stop()
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        D.destroy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from asyncppo.data.tiny import build_tiny_model

    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=1, intermediate=128, seed=3)


def test_two_rank_checkpoint_round_trip_is_bit_exact(model_dir, tmp_path):
    run_dir, out = str(tmp_path / "run"), str(tmp_path / "out")
    os.makedirs(out)
    spawn_ranks(_worker, lambda: (_free_port(), model_dir, run_dir, out), WORLD)
    r0 = torch.load(os.path.join(out, "rank0.pt"), weights_only=False)
    ckpt = C.resolve_checkpoint(run_dir)
    assert ckpt.version == 2 and ckpt.has_critic
    shards = sorted(os.listdir(os.path.join(ckpt.path, C.SHARDED_DIR)))
    assert sum(name.endswith(".distcp") for name in shards) == WORLD, shards  # one file per rank
    assert not os.path.exists(os.path.join(ckpt.path, C.CRITIC_FILE))  # the critic lives in the shards
    state = C.load_trainer_state(ckpt.state_file)
    assert state["sharded"] and state["actor_opt"] is None and state["extra"]["samples_trained"] == 32
    (actor_a, critic_a), (actor_b, critic_b) = r0["after"], r0["resumed"]
    initial = load_actor(model_dir, torch.float64, CPU).state_dict()
    assert max(float((actor_a[k] - initial[k]).abs().max()) for k in initial) > 1e-4  # training moved the weights
    for name, a in actor_a.items():
        assert torch.equal(a, actor_b[name]), name
    for name, a in critic_a.items():
        assert torch.equal(a, critic_b[name]), name
    actor_c, _ = r0["weights_only"]
    assert any(not torch.equal(a, actor_c[name]) for name, a in actor_a.items())
