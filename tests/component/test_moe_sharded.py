"""A mixture of experts on the FSDP2 learner with two ranks (gloo, CPU, float32: transformers' grouped expert matmul takes no float64), routing replay on.

The fused expert tensors (``[experts, 2 x width, hidden]``) shard along their first dimension like any parameter,
and the replay hooks sit on routers inside the sharded layers. Checked: one PPO step on two ranks, each forwarding
its half of the rows with the engine's experts replayed, leaves the weights one rank leaves after the same step on
the whole batch (up to float32 summation order, bounded below; the step moved them), with the same gradient norm."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
from transformers import Qwen2Config  # noqa: E402

from asyncppo.data.tiny_moe import moe_model  # noqa: E402
from asyncppo.learner import distributed as D  # noqa: E402
from asyncppo.learner import sharding as S  # noqa: E402
from asyncppo.learner.batch import collate_groups  # noqa: E402
from asyncppo.learner.models import load_actor  # noqa: E402
from asyncppo.learner.ppo import PPOUpdate  # noqa: E402
from asyncppo.models.moe_routing import RoutingHooks, moe_routers  # noqa: E402
from asyncppo.stream.records import Sample, TrajectoryGroup  # noqa: E402
from asyncppo.stream.routing import RoutingColumn  # noqa: E402

from tests.component.test_learner_distributed import WORLD, _cfg, _free_port, _fsdp  # noqa: E402
from spawn_ranks import spawn_ranks  # noqa: E402

EXPERTS, TOP_K, LAYERS = 4, 2, 2
OPTIONS = dict(adv_estimator="grpo", use_critic=False, ppo_mini_batch_size=2, lr=1e-2)


def _groups(seed=0, vocab=32):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        prompt = rng.integers(4, vocab, size=int(rng.integers(3, 6))).astype(np.int32)
        samples, records = [], []
        for _ in range(2):
            length = int(rng.integers(2, 6))
            samples.append(Sample(rng.integers(4, vocab, size=length).astype(np.int32),
                                  (-rng.random(length) * 3).astype(np.float32), float(rng.random()), "length", 0, 0))
            rows = np.stack([np.stack([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(LAYERS)])
                             for _ in range(len(prompt) + length)])
            rows[-1] = -1  # the last token: no record
            records.append(rows)
        groups.append(TrajectoryGroup(f"0-{g}", 0, prompt, samples, routing=RoutingColumn.from_samples(records,
                                                                                                       EXPERTS)))
    return groups


def _actor(model_dir, shard: bool):
    actor = load_actor(model_dir, torch.float32, torch.device("cpu"))
    RoutingHooks.attach(actor, apply=True)
    return _fsdp(actor) if shard else actor


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    D.init_learner_group(rank, WORLD, "127.0.0.1", port, "gloo", timeout_s=60)
    result: dict = {}
    try:
        cfg = _cfg(OPTIONS)
        actor = _actor(model_dir, shard=True)
        updater = S.ShardedPPOUpdate(cfg, actor, None, None, torch.device("cpu"), rank=rank, world_size=WORLD)
        if rank == 0:
            result["metrics"] = updater.step(D.broadcast_batch(collate_groups(_groups(), pad_token_id=0)))
            D.broadcast_gather(0)
            result["actor"] = D.gather_full_state_dict(actor, rank)
            D.broadcast_stop()
        else:
            result["steps"] = D.run_follower(updater)
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        D.destroy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    dense = Qwen2Config(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64,
                        tie_word_embeddings=False, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    model = moe_model(dense, experts=EXPERTS, top_k=TOP_K, expert_intermediate=16)
    with torch.no_grad():
        for r in moe_routers(model):
            r.weight.normal_(0, 1.0)
    path = str(tmp_path_factory.mktemp("moe") / "model")
    model.save_pretrained(path)
    return path


def test_two_fsdp_ranks_with_routing_replay_equal_one_rank(model_dir, tmp_path):
    spawn_ranks(_worker, lambda: (_free_port(), model_dir, str(tmp_path)), WORLD)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    assert ranks[1]["steps"] == 1
    actor = _actor(model_dir, shard=False)
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    metrics = PPOUpdate(_cfg(OPTIONS), actor, None, None, torch.device("cpu")).step(
        collate_groups(_groups(), pad_token_id=0))
    two = ranks[0]["actor"]
    experts = [k for k in initial if "experts" in k]
    assert experts and all(initial[k].dim() == 3 for k in experts)  # fused [experts, ...] tensors, sharded on dim 0
    moved = max(float((actor.state_dict()[k] - initial[k]).abs().max()) for k in experts)
    assert moved > 1e-4
    # float32, so not bit for bit: Adam's first step is ~lr x sign(grad), and where a gradient element is near 0 the
    # two summation orders can move it differently (measured: at most 1e-4 of a 0.02 step, on 0.05% of elements)
    for key, value in actor.state_dict().items():
        off = (two[key] - value).abs()
        assert float(off.max()) <= 0.01 * moved, key
        assert float((off > 2e-5).float().mean()) <= 0.005, key
    assert ranks[0]["metrics"]["actor/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-4)
    assert 1.0 <= metrics["moe/expert_load"] <= EXPERTS / TOP_K
