"""A weight push from a learner sharded with FSDP2 over 2 gloo ranks (CPU), gathered one layer group at a time.

Three real processes: learner ranks 0 and 1 (``maybe_shard`` = FSDP2, the production path) and a rollout-side
receiver that loads every push into a real transformers engine through the layer-group loader. Checked:
the gathered groups are exactly the unsharded model's state dict (``torch.equal``) and come in engine layer groups;
rank 0 never holds more than one group (budget 1 byte) or the byte budget; the engine ends with exactly the pushed
version's weights, although the learner changed its parameters while the last groups were still on the wire.
In-process tests of the hand-over (sync/group_stream.py) and of a worker joining after a streamed push follow.
"""

from __future__ import annotations

import os
import types

import pytest
import torch

from asyncppo.data.tiny import build_tiny_model
from asyncppo.learner import distributed as D
from asyncppo.learner.gather import GatherAccounting, drain, iter_full_groups, push_layer_groups, push_metas
from asyncppo.learner.models import load_actor, maybe_shard
from asyncppo.sync import find_free_port
from asyncppo.sync.engine_load import layer_group
from asyncppo.sync.fanout import WeightFanout, member_prefix
from asyncppo.sync.group_stream import GroupStream, GroupStreamAborted
from asyncppo.sync.layout import TensorMeta, plan_buckets
from spawn_ranks import spawn_ranks

PREFIX = "fsdp-push"
CPU = torch.device("cpu")
SHIFT = 1000.0  # what the learner adds to every parameter after push v1 (a stale tail would show it)


def _learner(rank: int, port: int, sync_port: int, model_dir: str, out_dir: str) -> None:
    D.init_learner_group(rank, 2, "127.0.0.1", port, "gloo", timeout_s=60)
    result: dict = {}
    try:
        actor = maybe_shard(load_actor(model_dir, torch.float32, CPU), 2, CPU)
        result["sharded"] = [type(t).__name__ for t in actor.state_dict().values()]
        # 1. the generator alone: rank 0 takes a group, checks it, drops it, then the next one
        if rank == 0:
            acc, groups = GatherAccounting(), []
            for named in iter_full_groups(actor, 0, acc, CPU):
                groups.append([(n, t.clone()) for n, t in named])
                acc.release(sum(t.numel() * t.element_size() for _, t in named))
                del named
            result.update(groups=groups, acc=(acc.peak, acc.max_group, acc.held, acc.groups),
                          metas=push_metas(actor))
        else:
            drain(actor, rank)
        # 2. streamed pushes through the fan-out into the receiver; the follower runs the production loop
        if rank == 0:
            fanout = WeightFanout("127.0.0.1", sync_port, PREFIX, timeout_s=60, bucket_bytes=4096)
            fanout.add(0)
            fanout.wait_joined([0], timeout_s=60)
            pushes = []
            plain = load_actor(model_dir, torch.float32, CPU)  # rank 0's unsharded copy, refreshed as service does
            plain_state = plain.state_dict()
            with torch.no_grad():
                for t in plain_state.values():
                    t.zero_()

            def mirror(named):
                with torch.no_grad():
                    for n, t in named:
                        plain_state[n].copy_(t)

            for version, budget in ((1, 1), (2, 2 * result["acc"][1])):
                acc = GatherAccounting()
                D.broadcast_gather(0)
                stream = push_layer_groups(fanout, actor, version, budget, device=CPU, accounting=acc,
                                           on_group=mirror)
                if version == 1:
                    result["mirror"] = {k: v.clone() for k, v in plain_state.items()}
                # the next "optimiser step" on both ranks while the last groups may still be on the wire (the
                # follower's run_follower takes a checkpoint command as its cue to shift its shard)
                D.broadcast_checkpoint(version)
                _shift(actor)
                fanout.wait()
                pushes.append((acc.peak, acc.held, stream.peak_held, budget))
            result["pushes"] = pushes
            result["failures"] = list(fanout.failures)
            D.broadcast_stop()
            fanout.close()
        else:
            D.run_follower(types.SimpleNamespace(actor=actor, critic=None), on_checkpoint=lambda v: _shift(actor))
    finally:
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        D.destroy()


def _shift(model) -> None:
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.add_(SHIFT)


def _receiver(port: int, model_dir: str, out_dir: str) -> None:
    from asyncppo.rollout.engines import make_engine
    from asyncppo.sync import WeightReceiver, make_sync_group
    from asyncppo.sync.engine_load import receive_into_engine

    engine = make_engine("hf", model_dir, dtype="float32", num_threads=1)
    group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=60, store_prefix=member_prefix(PREFIX, 0, 0))
    receiver = WeightReceiver(group)
    got = {}
    for _ in range(2):
        version = receive_into_engine(receiver, engine, flush_bytes=1, model_config=model_dir, dtype="float32")
        got[version] = {k: v.clone() for k, v in engine.model.state_dict().items()}
    group.close()
    torch.save(got, os.path.join(out_dir, "receiver.pt"))


def _proc(index: int, port: int, sync_port: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    if index < 2:
        _learner(index, port, sync_port, model_dir, out_dir)
    else:
        _receiver(sync_port, model_dir, out_dir)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    model_dir = build_tiny_model(str(tmp_path_factory.mktemp("tiny")), hidden=64, layers=3, heads=1,
                                 intermediate=160, seed=11)
    out = str(tmp_path_factory.mktemp("out"))
    spawn_ranks(_proc, lambda: (find_free_port(), find_free_port(), model_dir, out), 3)
    ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    received = torch.load(os.path.join(out, "receiver.pt"), weights_only=False)
    return model_dir, ranks, received


def _reference(model_dir):
    return load_actor(model_dir, torch.float32, CPU).state_dict()


def test_fsdp2_shards_the_model_on_cpu_with_gloo(run):
    _, ranks, _ = run
    for r in ranks:
        assert set(r["sharded"]) == {"DTensor"}  # every entry is sharded: the gather below is real


def test_layer_group_gather_equals_the_unsharded_state_dict_one_group_at_a_time(run):
    model_dir, ranks, _ = run
    want = _reference(model_dir)
    groups = ranks[0]["groups"]
    flat = [(n, t) for g in groups for n, t in g]
    assert [n for n, _ in flat] == list(want)  # every tensor once, in state-dict order
    for name, tensor in flat:
        assert tensor.dtype == want[name].dtype and torch.equal(tensor, want[name]), name
    # each yield is exactly one engine layer group: embed, 3 decoder layers, final norm, lm_head
    keys = [{layer_group(n) for n, _ in g} for g in groups]
    assert all(len(k) == 1 for k in keys)
    assert [k.pop() for k in keys] == ["model.embed_tokens", "model.layers.0", "model.layers.1",
                                       "model.layers.2", "model.norm", "lm_head"]
    sizes = [sum(t.numel() * t.element_size() for _, t in g) for g in groups]
    peak, max_group, held, count = ranks[0]["acc"]
    assert (peak, max_group, held, count) == (max(sizes), max(sizes), 0, 6)
    assert peak < sum(sizes) / 2  # the bound is far below the whole model
    # the header came from the DTensor metadata alone and matches the gathered tensors
    assert [(m.name, m.shape) for m in ranks[0]["metas"]] == [(n, tuple(t.shape)) for n, t in flat]


def test_streamed_push_bounds_rank0_and_delivers_exactly_the_pushed_version(run):
    model_dir, ranks, received = run
    want = _reference(model_dir)
    sizes = [sum(t.numel() * t.element_size() for _, t in g) for g in ranks[0]["groups"]]
    total, largest = sum(sizes), max(sizes)
    (peak1, held1, stream1, _), (peak2, held2, stream2, budget2) = ranks[0]["pushes"]
    assert (held1, held2) == (0, 0)  # every group was released once the worker took it
    assert peak1 == stream1 == largest  # budget 1 byte: exactly one group alive at a time
    assert largest <= peak2 == stream2 <= budget2 < total  # the budget bounds it, below the whole model
    assert ranks[0]["failures"] == []
    # the 4 KiB buckets here pack the last layer's norms, the final norm and lm_head into one bucket: a push that
    # freed a group only after its bucket went out would deadlock on it (broadcast.py, push_lazy)
    metas = ranks[0]["metas"]
    assert any(len({layer_group(metas[p.index].name) for p in b.pieces}) > 1 for b in plan_buckets(metas, 4096))
    assert sorted(received) == [1, 2]
    for name, value in want.items():  # rank 0's unsharded copy was refreshed group by group during the push
        assert torch.equal(ranks[0]["mirror"][name], value), name
    for name, value in want.items():  # v1: the weights at the push, not the shifted ones of the next step
        assert torch.equal(received[1][name], value), name
        assert torch.equal(received[2][name], value + SHIFT), name


# ---------------------------------------------------------------------------------------------------------------
def _stream(consumers, budget, alive=None):
    metas = [TensorMeta(f"t{i}", "float32", (25,)) for i in range(6)]  # 100 bytes each; groups of 2 -> 200 bytes
    return GroupStream(metas, [[0, 1], [2, 3], [4, 5]], consumers, budget, alive=alive)


def _group(k):
    return [(i, torch.full((25,), float(i))) for i in (2 * k, 2 * k + 1)]


def test_group_stream_holds_at_most_the_budget_and_frees_a_group_once_every_consumer_packed_it():
    import threading

    s = _stream(["a", "b"], budget=400)
    s.wait_room()
    s.put(_group(0))
    s.wait_room()  # 200 + 200 <= 400: no wait
    s.put(_group(1))
    assert s.held == 400
    blocked = threading.Thread(target=s.wait_room)
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive()  # a third group would exceed the budget
    assert torch.equal(s.get("a", 1), torch.full((25,), 1.0))
    for i in (0, 1):
        s.sent("a", i)
    assert s.held == 400  # "b" has not packed group 0 yet
    for i in (0, 1):
        s.sent("b", i)
    blocked.join(5)
    assert not blocked.is_alive() and s.held == 200
    s.put(_group(2))
    assert s.peak_held == 400


def test_group_stream_drops_a_dead_consumer_and_wakes_consumers_when_the_producer_fails():
    import threading

    dead = set()
    s = _stream(["a", "b"], budget=1, alive=lambda c: c not in dead)
    s.put(_group(0))
    for i in (0, 1):
        s.sent("a", i)
    dead.add("b")  # "b" died without packing: the producer must not wait for it forever
    s.wait_room()
    assert s.held == 0
    errors = []

    def consumer():
        try:
            s.get("a", 3)
        except GroupStreamAborted as e:
            errors.append(str(e))

    waiting = threading.Thread(target=consumer)
    waiting.start()
    s.abort(RuntimeError("gather failed"))
    waiting.join(5)
    assert not waiting.is_alive() and "t3" in errors[0] and "gather failed" in errors[0]


def test_a_worker_joining_after_a_streamed_push_is_behind_until_the_next_push():
    """No snapshot is kept for a streamed push: a late joiner is reported by ``behind()`` (the learner then pushes
    at its next step) and must never be handed an older snapshot as if it were current."""
    import threading

    from asyncppo.sync import WeightReceiver, make_sync_group

    port = find_free_port()
    fanout = WeightFanout("127.0.0.1", port, PREFIX, timeout_s=60, bucket_bytes=4096)
    got: dict = {0: [], 1: []}

    def worker(w, n):
        group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=60, store_prefix=member_prefix(PREFIX, w, 0))
        receiver = WeightReceiver(group)
        for _ in range(n):
            version, tensors = receiver.receive()
            got[w].append((version, float(dict(tensors)["t0"][0])))
        group.close()

    metas = [TensorMeta(f"t{i}", "float32", (25,)) for i in range(6)]

    def produce(v):
        return ([(i, torch.full((25,), 10.0 * v + i)) for i in (2 * k, 2 * k + 1)] for k in range(3))

    threads = [threading.Thread(target=worker, args=(0, 3), daemon=True)]
    try:
        fanout.add(0)
        threads[0].start()
        fanout.wait_joined([0])
        fanout.push_async({m.name: torch.zeros(25) for m in metas}, 1)  # an old-style snapshot push first
        fanout.wait()
        fanout.push_groups(metas, [[0, 1], [2, 3], [4, 5]], produce(2), 2, budget_bytes=1)
        fanout.wait()
        assert fanout.behind() == []
        fanout.add(1)  # joins after the streamed push: gets nothing stale (not the v1 snapshot)
        threads.append(threading.Thread(target=worker, args=(1, 1), daemon=True))
        threads[1].start()
        fanout.wait_joined([1])
        assert fanout.behind() == [1] and got[1] == []
        fanout.push_groups(metas, [[0, 1], [2, 3], [4, 5]], produce(3), 3, budget_bytes=1)
        fanout.wait()
        for t in threads:
            t.join(30)
        assert got == {0: [(1, 0.0), (2, 20.0), (3, 30.0)], 1: [(3, 30.0)]}
        assert fanout.behind() == [] and fanout.failures == []
    finally:
        fanout.close()
