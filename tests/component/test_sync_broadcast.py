"""Weight broadcast over a real gloo group across real processes: bit-exactness, bucketing, versions, errors."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from asyncppo.sync import (
    SyncGroupError,
    WeightReceiver,
    WeightSender,
    WeightSyncProtocolError,
    find_free_port,
    layer_group,
    make_sync_group,
)
from asyncppo.sync.layout import ALIGN, Header, TensorMeta, decode_header, encode_header, plan_buckets

BUCKET = 4096


def make_state(seed: int) -> dict[str, torch.Tensor]:
    """Mixed dtypes and shapes, special float values, a tensor 3.x buckets long, a 0-d and an empty tensor."""
    g = torch.Generator().manual_seed(seed)
    f32 = torch.randn(7, 13, generator=g)
    f32[0, 0], f32[0, 1], f32[0, 2], f32[0, 3] = float("nan"), float("inf"), float("-inf"), -0.0
    return {
        "model.embed.weight": f32,
        "model.layers.0.big": torch.randn(1000, 3, 2, generator=g),  # 24000 bytes > BUCKET: sent in chunks
        "model.layers.0.bf16": torch.randn(33, 5, generator=g).to(torch.bfloat16),
        "model.layers.0.f16_t": torch.randn(9, 11, generator=g).to(torch.float16).t(),  # non-contiguous
        "model.layers.1.ids": torch.randint(-2**62, 2**62, (17,), generator=g, dtype=torch.int64),
        "model.layers.1.mask": torch.rand(3, 3, 3, generator=g) > 0.5,
        "model.layers.1.u8": torch.randint(0, 256, (BUCKET - 5,), generator=g, dtype=torch.uint8),
        "scalar": torch.tensor(3.5, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "tail.weight": torch.randn(5, generator=g),
    }


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _receiver(port: int, rank: int, world: int, use_callback: bool, q) -> None:
    try:
        group = make_sync_group("127.0.0.1", port, rank, world, timeout_s=60)
        rx = WeightReceiver(group)
        report = []
        for seed in (1, 2):
            batches = []
            if use_callback:
                version, out = rx.receive(on_bucket=lambda b: batches.append([(n, t.clone()) for n, t in b]))
                assert out is None
                got = [x for b in batches for x in b]
            else:
                version, got = rx.receive()
            want = make_state(seed)
            report.append({
                "version": version,
                "names": [n for n, _ in got],
                "exact": all(bit_equal(t, want[n]) for n, t in got),
                "callbacks": len(batches),
                "max_bucket": rx.stats.max_bucket_bytes,
                "buckets": rx.stats.num_buckets,
            })
        group.close()
        q.put((rank, report))
    except BaseException as e:  # reported to the test, which fails with it
        q.put((rank, repr(e)))


def _run_receivers(world: int, port: int):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_receiver, args=(port, r, world, r == 2, q), daemon=True) for r in range(1, world)]
    for p in procs:
        p.start()
    return q, procs


def test_push_arrives_bit_exact_on_two_receivers_in_bounded_buckets():
    port = find_free_port()
    q, procs = _run_receivers(3, port)
    group = make_sync_group("127.0.0.1", port, 0, 3, timeout_s=60)
    tx = WeightSender(group, bucket_bytes=BUCKET)
    s1 = tx.push(make_state(1), version=3)
    # push_async snapshots: overwriting the live tensors right after the call must not change what arrives.
    live = make_state(2)
    tx.push_async(live, version=7)
    for t in live.values():
        t.zero_() if t.dtype != torch.bool else t.fill_(False)
    tx.wait()
    s2 = tx.stats
    results = dict(q.get(timeout=90) for _ in procs)
    for p in procs:
        p.join(30)
    group.close()

    state = make_state(1)
    payload = sum(t.numel() * t.element_size() for t in state.values())
    assert s1.version == 3 and s2.version == 7
    assert s1.payload_bytes == payload and s1.num_tensors == len(state)
    assert s1.max_bucket_bytes <= BUCKET and s1.num_buckets > payload // BUCKET  # several buckets, none too big
    assert s2.snapshot_seconds > 0
    for rank in (1, 2):
        report = results[rank]
        assert isinstance(report, list), report
        assert [r["version"] for r in report] == [3, 7]
        for r in report:
            assert r["names"] == list(state)  # order kept
            assert r["exact"], f"rank {rank} v{r['version']} not bit-exact"
            assert 0 < r["max_bucket"] <= BUCKET
            assert r["buckets"] == s1.num_buckets
    # the callback receiver got one call per bucket that completes a tensor (chunks of 'big' complete only once)
    big_chunks = -(-state["model.layers.0.big"].numel() * 4 // BUCKET)
    assert results[2][0]["callbacks"] == s1.num_buckets - (big_chunks - 1)


def test_bucket_plan_by_hand():
    metas = [TensorMeta("a", "float32", (3,)),  # 12 bytes at 0
             TensorMeta("b", "bfloat16", (5,)),  # 10 bytes at 16 (aligned)
             TensorMeta("c", "uint8", (40,)),  # does not fit 26 + pad -> next bucket at 0
             TensorMeta("d", "float32", (30,)),  # 120 bytes > 64 -> chunks 64 + 56
             TensorMeta("e", "int8", (1,))]
    plan = plan_buckets(metas, 64)
    assert [(b.nbytes, b.chunk, [(p.index, p.offset, p.src_start, p.nbytes) for p in b.pieces], b.complete)
            for b in plan] == [
        (26, False, [(0, 0, 0, 12), (1, 16, 0, 10)], (0, 1)),
        (40, False, [(2, 0, 0, 40)], (2,)),
        (64, True, [(3, 0, 0, 64)], ()),
        (56, True, [(3, 0, 64, 56)], (3,)),
        (1, False, [(4, 0, 0, 1)], (4,)),
    ]
    assert all(p.offset % ALIGN == 0 for b in plan for p in b.pieces)


def test_header_round_trip_and_rejections():
    h = Header(version=5, bucket_bytes=1024, tensors=(TensorMeta("x", "bfloat16", (2, 3)),))
    assert decode_header(encode_header(h)) == h
    import msgpack

    def bad(obj, match):
        with pytest.raises(WeightSyncProtocolError, match=match):
            decode_header(msgpack.packb(obj))

    ok = {"version": 1, "bucket_bytes": 1024, "tensors": [["x", "float32", [2]]]}
    bad({**ok, "version": -1}, "'version'=-1")
    bad({**ok, "tensors": [["x", "complex_thing", [2]]]}, "dtype='complex_thing': allowed")
    bad({**ok, "tensors": [["x", "float32", [2]], ["x", "float32", [1]]]}, "'x' appears twice")
    bad({**ok, "tensors": [["x", "float32", [-1]]]}, r"shape=\[-1\]")
    bad({**ok, "extra": 1}, "header keys")
    with pytest.raises(WeightSyncProtocolError, match="not valid msgpack"):
        decode_header(b"\xc1\xc1")


def test_layer_group_names():
    assert layer_group("model.layers.12.self_attn.q_proj.weight") == "model.layers.12"
    assert layer_group("model.layers.0.mlp.experts.3.w1") == "model.layers.0"
    assert layer_group("lm_head.weight") == "lm_head"
    assert layer_group("model.embed_tokens.weight") == "model.embed_tokens"
    assert layer_group("bias") == "bias"


def test_unreachable_store_names_the_address_and_respects_the_timeout():
    port = find_free_port()  # nobody listens there
    t0 = time.monotonic()
    with pytest.raises(SyncGroupError, match=f"127.0.0.1:{port}"):
        make_sync_group("127.0.0.1", port, rank=1, world_size=2, timeout_s=2)
    assert time.monotonic() - t0 < 20
    with pytest.raises(SyncGroupError, match="no-such-host.invalid:29999"):
        make_sync_group("no-such-host.invalid", 29999, rank=1, world_size=2, timeout_s=2)


def test_missing_rank_times_out_with_a_clear_error():
    port = find_free_port()
    t0 = time.monotonic()
    with pytest.raises(SyncGroupError, match=rf"127.0.0.1:{port} did not form within 2s .*2 ranks joined"):
        make_sync_group("127.0.0.1", port, rank=0, world_size=2, timeout_s=2)
    assert time.monotonic() - t0 < 20


def test_bad_arguments_are_named():
    with pytest.raises(SyncGroupError, match="backend='mpi'"):
        make_sync_group("127.0.0.1", 1234, 0, 1, backend="mpi")
    with pytest.raises(SyncGroupError, match="rank=2"):
        make_sync_group("127.0.0.1", 1234, 2, 2)
    with pytest.raises(SyncGroupError, match="port=0"):
        make_sync_group("127.0.0.1", 0, 0, 1)


def _garbage_receiver(port: int, q) -> None:
    try:
        group = make_sync_group("127.0.0.1", port, 1, 2, timeout_s=60)
        WeightReceiver(group).receive()
        q.put("no error")
    except WeightSyncProtocolError as e:
        q.put(f"protocol: {e}")
    except BaseException as e:
        q.put(repr(e))


def test_receiver_rejects_a_foreign_broadcast():
    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_garbage_receiver, args=(port, q), daemon=True)
    p.start()
    group = make_sync_group("127.0.0.1", port, 0, 2, timeout_s=60)
    group.broadcast(torch.tensor([1, 2, 3], dtype=torch.int64))
    msg = q.get(timeout=60)
    p.join(30)
    group.close()
    assert msg.startswith("protocol: not a weight-sync push: magic 0x1"), msg


def test_sender_validates_its_input():
    port = find_free_port()
    group = make_sync_group("127.0.0.1", port, 0, 1, timeout_s=10)  # world of one: broadcasts are local no-ops
    tx = WeightSender(group, bucket_bytes=BUCKET)
    with pytest.raises(ValueError, match="version=-1"):
        tx.push({"a": torch.ones(2)}, version=-1)
    with pytest.raises(TypeError, match=r"weights\[1\] \('b'\) must be a torch.Tensor"):
        tx.push([("a", torch.ones(2)), ("b", [1.0])], version=0)
    with pytest.raises(WeightSyncProtocolError, match="dtype torch.complex64 cannot be pushed"):
        tx.push({"c": torch.ones(2, dtype=torch.complex64)}, version=0)
    stats = tx.push({"a": torch.ones(2)}, version=0)  # still usable after rejected input
    assert stats.version == 0 and stats.payload_bytes == 8
    group.close()
