"""Peak memory per learner rank during a weight push from an FSDP2 learner: whole-model gather vs layer groups.

Three processes on one machine: learner ranks 0 and 1 (gloo, ``maybe_shard`` = FSDP2 on CPU) and one rollout-side
receiver on a real fan-out sync group. For each mode rank 0 pushes the same weights; every rank reports

* ``held``: the peak bytes of gathered full tensors alive at once, by accounting (whole: the gathered state dict
  plus the push snapshot; layer groups: :class:`asyncppo.learner.gather.GatherAccounting`),
* ``rss``: the peak resident set size above the value just before the push (sampled every 2 ms by a thread;
  ``MALLOC_MMAP_THRESHOLD_`` is pinned so freed tensors go back to the OS and the numbers are not hidden by malloc).

The receiver checks a float64 checksum of every received tensor against rank 0's, so a push that lost or mixed up
bytes fails loudly. Usage: ``python scripts/bench_push_memory.py [--hidden 384 --layers 6 --budget-mb 16]``.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time

os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")  # before torch allocates anything (children inherit it)

import torch  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

PREFIX = "bench-push-memory"
MB = 1 << 20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """Peak RSS above the start value while the ``with`` block runs."""

    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(0.002)

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        self.delta = self.peak - self.base


def _checksums(named) -> dict[str, float]:
    return {n: float(t.double().sum()) for n, t in named}


def _learner(rank: int, port: int, sync_port: int, model_dir: str, modes: list, out: str) -> None:
    from asyncppo.learner import distributed as D
    from asyncppo.learner.gather import GatherAccounting, push_layer_groups
    from asyncppo.learner.models import load_actor, maybe_shard
    from asyncppo.sync.fanout import WeightFanout

    D.init_learner_group(rank, 2, "127.0.0.1", port, "gloo", timeout_s=300)
    cpu = torch.device("cpu")
    actor = maybe_shard(load_actor(model_dir, torch.float32, cpu), 2, cpu)
    results = []
    fanout = None
    if rank == 0:
        fanout = WeightFanout("127.0.0.1", sync_port, PREFIX, timeout_s=300, bucket_bytes=4 * MB)
        fanout.add(0)
        fanout.wait_joined([0], timeout_s=300)
    for version, (mode, budget_mb) in enumerate(modes, start=1):
        if rank > 0:  # the follower: what run_follower does on OP_GATHER, for either mode
            with PeakRSS() as m:
                D._receive_header()
                D.gather_full_state_dict(actor, rank)
            results.append(dict(mode=mode, budget_mb=budget_mb, rank=1, held=0, rss=m.delta))
            continue
        t0 = time.perf_counter()
        with PeakRSS() as m:
            D.broadcast_gather(0)
            if mode == "whole":
                state = D.gather_full_state_dict(actor, 0)
                sums = _checksums(state.items())
                fanout.push_async(state, version)  # snapshots (copies) the gathered tensors
                held = 2 * sum(t.numel() * t.element_size() for t in state.values())
                del state
            else:
                acc, sums = GatherAccounting(), {}
                push_layer_groups(fanout, actor, version, max(1, int(budget_mb * MB)), device=cpu, accounting=acc,
                                  on_group=lambda named: sums.update(_checksums(named)))
                held = acc.peak
            gathered_s = time.perf_counter() - t0
            fanout.wait()
        results.append(dict(mode=mode, budget_mb=budget_mb, rank=0, held=held, rss=m.delta,
                            gather_s=round(gathered_s, 3), push_s=round(time.perf_counter() - t0, 3), sums=sums))
    if fanout is not None:
        fanout.close()
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))
    D.destroy()


def _receiver(sync_port: int, n: int, out: str) -> None:
    from asyncppo.sync import WeightReceiver, make_sync_group
    from asyncppo.sync.fanout import member_prefix

    group = make_sync_group("127.0.0.1", sync_port, 1, 2, timeout_s=300, store_prefix=member_prefix(PREFIX, 0, 0))
    receiver = WeightReceiver(group)
    got = []
    for _ in range(n):
        sums: dict[str, float] = {}
        version, _ = receiver.receive(on_bucket=lambda named: sums.update(_checksums(named)))
        got.append((version, sums))
    group.close()
    torch.save(got, os.path.join(out, "receiver.pt"))


def _proc(index: int, port: int, sync_port: int, model_dir: str, modes: list, out: str) -> None:
    torch.set_num_threads(1)
    if index < 2:
        _learner(index, port, sync_port, model_dir, modes, out)
    else:
        _receiver(sync_port, len(modes), out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--intermediate", type=int, default=1024)
    ap.add_argument("--budget-mb", type=float, default=16.0)
    args = ap.parse_args()
    from asyncppo.data.tiny import build_tiny_model
    from asyncppo.sync import find_free_port

    tmp = tempfile.mkdtemp(prefix="bench-push-memory-")
    model_dir = build_tiny_model(os.path.join(tmp, "model"), hidden=args.hidden, layers=args.layers,
                                 heads=args.hidden // 64, intermediate=args.intermediate, seed=0)
    # layer groups first: a mode that leaves memory behind could only inflate the later (whole) numbers
    modes = [("layer_groups", 0.0), ("layer_groups", args.budget_mb), ("whole", None)]
    mp.spawn(_proc, args=(find_free_port(), find_free_port(), model_dir, modes, tmp), nprocs=3, join=True)
    rank0, rank1 = (torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in (0, 1))
    received = torch.load(os.path.join(tmp, "receiver.pt"), weights_only=False)
    model_bytes = sum(os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir)
                      if f.endswith(".safetensors"))
    print(f"model: hidden {args.hidden}, {args.layers} layers, {model_bytes / MB:.1f} MB of fp32 weights; 2 gloo "
          f"ranks (FSDP2), 1 receiver")
    print(f"{'mode':<30}{'rank0 held MB':>14}{'rank0 RSS+ MB':>15}{'rank1 RSS+ MB':>15}{'gather s':>10}{'push s':>9}")
    rows = []
    for r0, r1, (version, sums) in zip(rank0, rank1, received):
        ok = sums.keys() == r0["sums"].keys() and all(abs(sums[k] - r0["sums"][k]) <= 1e-9 * max(1.0, abs(sums[k]))
                                                      for k in sums)
        if not ok:
            raise SystemExit(f"mode {r0['mode']}: the receiver's checksums differ from rank 0's")
        label = r0["mode"] if r0["budget_mb"] is None else \
            f"{r0['mode']} (budget {r0['budget_mb']:g} MB)" if r0["budget_mb"] else f"{r0['mode']} (one group)"
        print(f"{label:<30}{r0['held'] / MB:>14.1f}{r0['rss'] / MB:>15.1f}{r1['rss'] / MB:>15.1f}"
              f"{r0['gather_s']:>10.2f}{r0['push_s']:>9.2f}")
        rows.append({k: v for k, v in r0.items() if k != "sums"} | {"rank1_rss": r1["rss"], "label": label})
    print(json.dumps({"model_mb": round(model_bytes / MB, 2), "rows": rows}))


if __name__ == "__main__":
    main()
