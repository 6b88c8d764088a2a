"""The shared-memory weight-sync path (``--gpus N``: engine and learner rank on one device) across two real
processes: bit-exact pushes larger than the segment, nothing left in the segment directory, a dead peer's error."""

from __future__ import annotations

import multiprocessing as mp
import os

import torch

from asyncppo.sync import WeightReceiver, WeightSender, find_free_port, make_sync_group
from asyncppo.sync import shm

PREFIX = "run-secret/w0/g0"


def _state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(600_000, generator=g),  # 2.4 MB: three chunks of a 1 MiB segment
        "bf16": torch.randn(3000, 7, generator=g).to(torch.bfloat16),
        "small": torch.randn(5, generator=g),  # below DIRECT_BYTES: over gloo itself
    }


def _receiver(port: int, shm_dir: str, q) -> None:
    try:
        os.environ["ASYNCPPO_SHM_DIR"] = shm_dir
        group = make_sync_group("127.0.0.1", port, 1, 2, backend="shm", timeout_s=60, store_prefix=PREFIX)
        rx = WeightReceiver(group)
        exact = []
        for seed in (1, 2):
            version, got = rx.receive()
            want = _state(seed)
            exact.append((version, all(torch.equal(t, want[n]) for n, t in got), len(got)))
        q.put(("ok", exact, group.device.type))
        group.close()
    except BaseException as e:  # reported to the test
        q.put(("error", repr(e), ""))


def test_shm_push_is_bit_exact_and_leaves_no_segment(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCPPO_SHM_DIR", str(tmp_path))
    monkeypatch.setattr(shm, "SEGMENT_BYTES", 1 << 20)
    port = find_free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(port, str(tmp_path), q))
    proc.start()
    group = make_sync_group("127.0.0.1", port, 0, 2, backend="shm", timeout_s=60, store_prefix=PREFIX)
    assert group.shm is not None and group.shm.segment.numel() == 1 << 20
    assert list(tmp_path.iterdir()) == []  # the name is gone once both ranks mapped it
    tx = WeightSender(group, bucket_bytes=4 << 20)
    tx.push(_state(1), version=1)
    tx.push_async(_state(2), version=2)
    tx.wait()
    status, exact, device = q.get(timeout=120)
    proc.join(60)
    assert status == "ok", exact
    assert exact == [(1, True, 3), (2, True, 3)] and device == "cpu"
    # the 2.4 MB tensor and the 84 kB bf16 one went through the segment, twice; the 20-byte one did not
    payload = 600_000 * 4 + 3000 * 7 * 2
    assert group.shm.bytes_moved >= 2 * payload
    group.close()


def _joins_then_dies(port: int, shm_dir: str) -> None:
    os.environ["ASYNCPPO_SHM_DIR"] = shm_dir
    make_sync_group("127.0.0.1", port, 1, 2, backend="shm", timeout_s=10, store_prefix=PREFIX)
    os._exit(0)  # gone without a word, as a killed engine process


def test_a_dead_peer_fails_the_push_naming_the_group(tmp_path, monkeypatch):
    import pytest

    from asyncppo.sync import SyncGroupError

    monkeypatch.setenv("ASYNCPPO_SHM_DIR", str(tmp_path))
    port = find_free_port()
    proc = mp.get_context("spawn").Process(target=_joins_then_dies, args=(port, str(tmp_path)))
    proc.start()
    group = make_sync_group("127.0.0.1", port, 0, 2, backend="shm", timeout_s=10, store_prefix=PREFIX)
    proc.join(30)
    with pytest.raises(SyncGroupError, match=rf"backend shm.*127.0.0.1:{port}|127.0.0.1:{port}.*backend shm"):
        WeightSender(group, bucket_bytes=4 << 20).push(_state(1), version=1)
    group.close()
