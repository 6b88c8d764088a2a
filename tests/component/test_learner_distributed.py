"""Several learner ranks on CPU (2 processes, gloo, FSDP2): batch transport is bit-exact, shards cover the batch,
row gathers are exact, and a PPO step on 2 ranks updates the parameters exactly as 1 rank on the whole batch."""

from __future__ import annotations

import os
import socket
import sys
import subprocess
import re

import numpy as np
import pytest
import torch
from torch import nn

from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner import distributed as D
from asyncppo.learner import sharding as S
from asyncppo.learner.batch import collate_groups, mini_batches
from asyncppo.learner.forward import chunked, count_chunks, policy_forward
from asyncppo.learner.models import load_actor, load_critic, load_reference
from asyncppo.config.checks import uses_critic, uses_reference
from asyncppo.learner.ppo import PPOUpdate
from asyncppo.stream.routing import RoutingColumn
from asyncppo.stream.records import Sample, TrajectoryGroup
from spawn_ranks import spawn_ranks

WORLD = 2
# Each rank gets one whole group of every 2-group mini-batch and runs 2 micro-batches of 1 sample on it.
SCENARIOS = {
    "grpo": dict(adv_estimator="grpo", ppo_epochs=2, ppo_mini_batch_size=2, micro_batch_size=1, lr=1e-3),
    "gae_kl": dict(adv_estimator="gae", whiten_advantages=True, use_kl_loss=True, kl_loss_coef=0.1,
                   loss_agg_mode="seq-mean-token-mean", ppo_mini_batch_size=2, micro_batch_size=1, lr=1e-3),
    # Same as gae_kl, with PPOUpdate's no-grad preparation routed through ShardedPPOUpdate._no_grad_rows: this
    # simulates the proposed ppo.py hook (``chunked(...)`` -> ``self._no_grad_rows(...)`` in step phase 1).
    "gae_kl_sharded_prep": dict(adv_estimator="gae", whiten_advantages=True, use_kl_loss=True, kl_loss_coef=0.1,
                                loss_agg_mode="seq-mean-token-mean", ppo_mini_batch_size=2, micro_batch_size=1,
                                lr=1e-3),
    "rpp_whole": dict(adv_estimator="reinforce_plus_plus", ppo_mini_batch_size=0, micro_batch_size=0, lr=1e-3),
    # one optimizer step over 2 micro-batches per rank (4 on one rank): the proximal log-probs come from the
    # training forwards on both sides (learner/passes.py), gathered from the ranks for the correction's figures
    "grpo_fused": dict(adv_estimator="grpo", ppo_mini_batch_size=0, micro_batch_size=2, off_policy_correction="tis",
                       off_policy_level="sequence", lr=1e-3),
}
# the scenarios whose step takes the proximal log-probs from its training forwards on two ranks (and on one)
FUSED = {"rpp_whole", "grpo_fused"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _groups(num_groups=4, n=2, seed=0, vocab=16, eos=1):
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(num_groups):
        prompt = rng.integers(4, vocab, size=int(rng.integers(3, 7))).astype(np.int32)
        samples = []
        for _ in range(n):
            length = int(rng.integers(1, 6))
            ids = rng.integers(4, vocab, size=length).astype(np.int32)
            samples.append(Sample(response_ids=ids, behavior_logprobs=(-rng.random(length) * 3).astype(np.float32),
                                  reward=float(rng.random()), finish_reason="length", version_min=g, version_max=g))
        # an MoE run's routing column (2 layers x top-2 of 8): the batch's one 4-D int16 field travels too
        routing = RoutingColumn.from_samples(
            [rng.integers(-1, 8, size=(len(prompt) + s.num_tokens, 2, 2)) for s in samples], 8)
        groups.append(TrajectoryGroup(group_id=f"0-{g}", worker_id=0, prompt_ids=prompt, samples=samples,
                                      routing=routing))
    return groups


def _batch():
    return collate_groups(_groups(), pad_token_id=0)


def _halves(batch):
    """Each rank's rows of ``batch`` as :func:`asyncppo.learner.sharding.sharded_no_grad` splits them."""
    per = -(-batch.size // WORLD)
    return [batch.select(torch.arange(r * per, min((r + 1) * per, batch.size))) for r in range(WORLD)]


def _uneven_budget() -> int:
    """A token bound under which the two ranks' rows of :func:`_batch` cut into different numbers of chunks."""
    for budget in range(4, 64):
        counts = {count_chunks(half, 3, budget) for half in _halves(_batch())}
        if len(counts) > 1:
            return budget
    raise AssertionError("no token bound splits the ranks' rows unevenly")


def _cfg(options: dict) -> AsyncPPOConfig:
    cfg = AsyncPPOConfig()
    cfg.algorithm.clip_ratio_low = cfg.algorithm.clip_ratio_high = cfg.algorithm.pg_clip
    cfg.algorithm.loss_agg_norm_length = 8
    for key, value in options.items():
        if key == "lr":
            cfg.trainer.lr = cfg.trainer.critic_lr = value
        else:
            setattr(cfg.algorithm, key, value)
    return cfg


def _fsdp(model: nn.Module) -> nn.Module:
    """What ``models.maybe_shard`` does on GPUs (it skips CPU; FSDP2 works on CPU with gloo)."""
    from torch.distributed.fsdp import fully_shard

    layers = next(m for m in model.modules() if isinstance(m, nn.ModuleList))
    for layer in layers:
        fully_shard(layer)
    return fully_shard(model)


def _models(cfg, model_dir, shard: bool):
    dev = torch.device("cpu")
    actor = load_actor(model_dir, torch.float64, dev)
    critic = load_critic(model_dir, torch.float64, dev).double() if uses_critic(cfg) else None
    ref = load_reference(model_dir, torch.float64, dev) if uses_reference(cfg) else None
    if ref is not None:
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in ref.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    if shard:
        actor = _fsdp(actor)
        critic = _fsdp(critic) if critic is not None else None
    return actor, critic, ref


def ppo_module_restore() -> None:
    import asyncppo.learner.ppo as ppo_module

    ppo_module.chunked = chunked


def _worker(rank: int, port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    D.init_learner_group(rank, WORLD, "127.0.0.1", port, "gloo", timeout_s=60)
    result: dict = {}
    try:
        full = _batch()
        full.old_logprobs = torch.randn(full.size, full.response_len, dtype=torch.float64)  # optional, other dtype
        got = D.broadcast_batch(full if rank == 0 else None)
        result["broadcast"] = got

        local = torch.arange(rank * 100, rank * 100 + (rank + 2) * (rank + 3), dtype=torch.float64)
        result["gather2d"] = S.all_gather_rows(local.view(rank + 2, rank + 3), pad_value=-1)
        result["gather1d"] = S.all_gather_rows(torch.arange(rank + 1) + 10 * rank)

        actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
        result["sharded_logprobs"] = S.sharded_no_grad(
            lambda b: policy_forward(actor, b, 1.0, False)[0], _batch(), 3)

        # a token bound on an FSDP actor: the ranks' rows make different numbers of chunks, and a rank that makes
        # fewer forwards than another would leave FSDP's all-gathers waiting (the test would hang, then fail)
        sharded_actor = _fsdp(load_actor(model_dir, torch.float64, torch.device("cpu")))
        calls: list[int] = []

        def counted(b):
            calls.append(b.size)
            return policy_forward(sharded_actor, b, 1.0, False)[0]

        result["bounded_logprobs"] = S.sharded_no_grad(counted, _batch(), 3, _uneven_budget())
        result["bounded_calls"] = calls

        for name, options in SCENARIOS.items():
            cfg = _cfg(options)
            actor, critic, ref = _models(cfg, model_dir, shard=True)
            updater = S.ShardedPPOUpdate(cfg, actor, critic, ref, torch.device("cpu"), rank=rank, world_size=WORLD)
            prep_rows: list[int] = []
            if name.endswith("sharded_prep"):  # record how many rows each no-grad forward sees on this rank
                split = updater._no_grad_rows

                def hooked(fn, batch, rows, _split=split):
                    prep_rows.append(batch.size)
                    return _split(lambda b: (prep_rows.append(-b.size), fn(b))[1], batch, rows)

                updater._no_grad_rows = hooked
            if rank == 0:
                metrics = updater.step(D.broadcast_batch(_batch()))
                D.broadcast_gather(0)
                result[f"{name}/actor"] = D.gather_full_state_dict(actor, rank)
                if critic is not None:
                    D.broadcast_gather(1)
                    result[f"{name}/critic"] = D.gather_full_state_dict(critic, rank)
                D.broadcast_stop()
                result[f"{name}/grad_norm"] = metrics["actor/grad_norm"]
                result[f"{name}/metrics"] = metrics
            else:
                result[f"{name}/steps"] = D.run_follower(updater)
                result[f"{name}/nonzero_gather"] = D.gather_full_state_dict(actor, rank)
            result[f"{name}/prep_rows"] = prep_rows
            ppo_module_restore()
            if rank == 0:
                D.gather_full_state_dict(actor, rank)  # pairs with the follower's direct call above
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        D.destroy()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, heads=1, intermediate=128, seed=3)


@pytest.fixture(scope="module")
def ranks(model_dir, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ranks"))
    spawn_ranks(_worker, lambda: (_free_port(), model_dir, out), WORLD)
    return [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]


# ---------------------------------------------------------------------------------------------------------------
def test_broadcast_batch_is_bit_exact(ranks):
    sent = _batch()
    for rank in ranks:
        got = rank["broadcast"]
        assert got.prompt_len == sent.prompt_len
        for name in D._TENSOR_FIELDS:
            if name == "old_logprobs":
                continue
            a, b = getattr(sent, name), getattr(got, name)
            if a is None:
                assert b is None, name
            else:
                assert a.dtype == b.dtype and torch.equal(a, b), name
    # the optional float64 field travelled too, identical on both ranks
    assert ranks[0]["broadcast"].old_logprobs.dtype == torch.float64
    assert torch.equal(ranks[0]["broadcast"].old_logprobs, ranks[1]["broadcast"].old_logprobs)


def test_all_gather_rows_pads_widths_and_keeps_row_counts(ranks):
    want = torch.full((5, 4), -1.0, dtype=torch.float64)
    want[:2, :3] = torch.arange(6, dtype=torch.float64).view(2, 3)
    want[2:, :4] = torch.arange(100, 112, dtype=torch.float64).view(3, 4)
    for rank in ranks:
        assert torch.equal(rank["gather2d"], want)
        assert rank["gather1d"].tolist() == [0, 10, 11]


def test_sharded_no_grad_equals_whole_batch_forward(ranks, model_dir):
    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    batch = _batch()
    want = chunked(lambda b: policy_forward(actor, b, 1.0, False)[0], batch, 3)
    for rank in ranks:
        got = rank["sharded_logprobs"]
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_sharded_no_grad_under_a_token_bound_runs_as_many_forwards_on_every_rank(ranks, model_dir):
    budget = _uneven_budget()
    counts = [count_chunks(half, 3, budget) for half in _halves(_batch())]
    assert counts[0] != counts[1]  # the bound cuts the ranks' rows differently, so the filler forwards are needed
    actor = load_actor(model_dir, torch.float64, torch.device("cpu"))
    want = chunked(lambda b: policy_forward(actor, b, 1.0, False)[0], _batch(), 3)
    for rank in ranks:
        assert len(rank["bounded_calls"]) == max(counts)
        torch.testing.assert_close(rank["bounded_logprobs"], want, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_two_ranks_update_equals_one_rank_on_whole_batch(ranks, model_dir, name):
    cfg = _cfg(SCENARIOS[name])
    actor, critic, ref = _models(cfg, model_dir, shard=False)
    initial = {k: v.clone() for k, v in actor.state_dict().items()}
    metrics = PPOUpdate(cfg, actor, critic, ref, torch.device("cpu")).step(_batch())
    two = ranks[0][f"{name}/actor"]
    assert set(two) == set(initial)
    moved = max(float((actor.state_dict()[k] - initial[k]).abs().max()) for k in initial)
    assert moved > 1e-4  # the step really changed the weights, so equality below is not vacuous
    for key, value in actor.state_dict().items():
        torch.testing.assert_close(two[key], value, rtol=0, atol=1e-10, msg=key)
    if critic is not None:
        for key, value in critic.state_dict().items():
            torch.testing.assert_close(ranks[0][f"{name}/critic"][key], value, rtol=0, atol=1e-10, msg=key)
    assert ranks[0][f"{name}/grad_norm"] == pytest.approx(metrics["actor/grad_norm"], rel=1e-9)
    two_metrics = ranks[0][f"{name}/metrics"]
    assert two_metrics["actor/fused_proximal"] == float(name in FUSED)
    for key in ("actor/mismatch_kl", "actor/is_weight_mean", "actor/is_ratio_p95", "actor/is_chi2_seq"):
        if key in metrics:  # the correction's batch figures: from every rank's rows, as on one rank
            assert two_metrics[key] == pytest.approx(metrics[key], rel=1e-9, abs=1e-12), key
    assert ranks[1][f"{name}/steps"] == 1
    assert ranks[1][f"{name}/nonzero_gather"] is None
    if name.endswith("sharded_prep"):  # old log-probs, reference, values: each rank forwards 4 of the 8 rows
        for rank in ranks:
            assert rank[f"{name}/prep_rows"] == [8, -4] * 3


# ---------------------------------------------------------------------------------------------------------------
def test_shard_rows_keeps_groups_whole_and_covers_every_row_once():
    groups = _groups(num_groups=5, n=3)
    groups[1].samples = groups[1].samples[:1]  # uneven group sizes
    batch = collate_groups(groups, pad_token_id=0)
    batch.scores = torch.arange(batch.size, dtype=torch.float32)  # row identity
    for world in (1, 2, 3, 7):
        shards = [S.shard_rows(batch, r, world) for r in range(world)]
        seen = torch.cat([s.scores for s in shards]).long().tolist()
        assert sorted(seen) == list(range(batch.size))
        owner = {}
        for r, s in enumerate(shards):
            if s.size:
                k = int(s.group_index.max()) + 1
                assert sorted(set(s.group_index.tolist())) == list(range(k))  # contiguous renumbering
            for row in s.scores.long().tolist():
                owner.setdefault(int(batch.group_index[row]), set()).add(r)
        assert all(len(v) == 1 for v in owner.values())  # no group is split across ranks
    two = [S.shard_rows(batch, r, 2).size for r in range(2)]
    assert two == [7, 6]  # groups of 3,1,3,3,3 rows: balanced by rows, not by groups


def test_mismatched_micro_batch_counts_are_reported_not_deadlocked():
    batch = collate_groups(_groups(num_groups=3, n=2), pad_token_id=0)
    assert S.micro_batch_counts(batch, 2, 1, 0) == [4, 2]  # 3 groups over 2 ranks
    assert S.micro_batch_counts(batch, 2, 0, 0) == [1, 1]
    mini = next(mini_batches(batch, 1, torch.Generator().manual_seed(0)))
    assert S.micro_batch_counts(mini, 2, 0, 0) == [1, 0]  # one group cannot feed two ranks


def test_init_learner_group_times_out_with_a_clear_error():
    # In a fresh interpreter: an in-process vLLM engine elsewhere in the test session owns the default group.
    code = (
        "import sys, time, torch\n"
        "from asyncppo.learner import distributed as D\n"
        f"port = {_free_port()}\n"
        "t0 = time.monotonic()\n"
        "try:\n"
        "    D.init_learner_group(1, 2, '127.0.0.1', port, 'gloo', timeout_s=2)\n"
        "except D.LearnerGroupError as e:\n"
        "    print('ERROR:', e)\n"
        "print('ELAPSED', time.monotonic() - t0, 'INIT', torch.distributed.is_initialized())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert re.search(r"ERROR: learner rank 1/2 could not form the learner group at tcp://127.0.0.1", out), out
    elapsed = float(re.search(r"ELAPSED (\S+)", out).group(1))
    assert elapsed < 30 and "INIT False" in out, out