"""Throughput of the trajectory stream against raw ZeroMQ on the same socket type.

For each record size, a sender *process* pushes N messages to a receiver in this process over loopback TCP:

* ``record``: ``TrajectorySender.send`` (encode + send) -> ``TrajectoryReceiver.recv`` (recv + validate + decode);
* ``raw``: a PUSH socket sending pre-built ``bytes`` of exactly the same length -> a PULL socket ``recv`` (the
  limit: no encoding, no validation, no Python objects). Both raw receive modes (copy / zero-copy) are tried
  and the faster one is reported.

Runs are interleaved and repeated; the median is printed, with the ratio record/raw.

    .venv/bin/python scripts/bench_transport.py [--messages 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import statistics
import sys
import time

import numpy as np
import zmq

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from asyncppo.stream.channels import TrajectoryReceiver, TrajectorySender  # noqa: E402
from asyncppo.stream.records import Sample, TrajectoryGroup  # noqa: E402
from asyncppo.stream.wire import encode_group  # noqa: E402

END = b"END"


def make_group(n_samples: int, resp_len: int, prompt_len: int, seed: int) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    samples = [
        Sample(
            response_ids=rng.integers(0, 150_000, resp_len, dtype=np.int32),
            behavior_logprobs=-rng.exponential(1.0, resp_len).astype(np.float32),
            reward=float(rng.random()),
            finish_reason="length",
            version_min=7,
            version_max=7,
        )
        for _ in range(n_samples)
    ]
    return TrajectoryGroup(
        group_id=f"0-{seed}",
        worker_id=0,
        prompt_ids=rng.integers(0, 150_000, prompt_len, dtype=np.int32),
        samples=samples,
        prompt_index=seed,
        ticket=seed,
        answer="42",
        timings={"gen_s": 1.25, "reward_s": 0.01, "created_at": time.time()},
    )


def _sender(address: str, mode: str, shape: tuple, n: int, hwm: int) -> None:
    groups = [make_group(*shape, seed=i) for i in range(8)]
    if mode == "record":
        tx = TrajectorySender(address, hwm=hwm, context=zmq.Context())
        for i in range(n):
            tx.send(groups[i % 8])
        tx.send_encoded(END)
        tx.close(linger_ms=-1)
    else:
        payloads = [bytes(len(encode_group(g))) for g in groups]
        ctx = zmq.Context()
        s = ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.SNDHWM, hwm)
        s.connect(address)
        for i in range(n):
            s.send(payloads[i % 8], copy=False)
        s.send(END)
        s.close(linger=-1)


def run_once(mode: str, shape: tuple, n: int, hwm: int = 64) -> tuple[float, float]:
    """Returns (messages/s, MB/s) measured at the receiver from the first message to the last."""
    ctx = zmq.Context()
    if mode == "record":
        rx = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=hwm, context=ctx)
        address = rx.address
    else:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.bind("tcp://127.0.0.1:*")
        address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    proc = mp.get_context("spawn").Process(target=_sender, args=(address, mode, shape, n, hwm))
    proc.start()
    count = nbytes = 0
    t0 = None
    if mode == "record":
        while True:
            g = rx.recv()
            if t0 is None:
                t0 = time.perf_counter()
            count += 1
            if count == n:
                break
        # the END frame is not a valid group: it is rejected and counted as malformed
        while rx.rejected["malformed"] == 0:
            rx.recv(timeout_ms=10)
        nbytes = n * len(encode_group(make_group(*shape, seed=0)))
        rx.close()
    else:
        copy = mode == "raw-copy"
        while True:
            m = sock.recv(copy=copy)
            if t0 is None:
                t0 = time.perf_counter()
            if len(m) == len(END):
                break
            count += 1
            nbytes += len(m)
        sock.close()
    dt = time.perf_counter() - t0
    proc.join()
    ctx.term()
    # the first message started the clock, so count n-1 intervals
    return (count - 1) / dt, nbytes * (count - 1) / count / dt / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the END marker is (correctly) rejected as malformed

    print(f"groups of {args.samples} samples, prompt {args.prompt_len} tokens, int32 ids + float32 logprobs; "
          f"{args.messages} messages x {args.repeats} repeats (median), PUSH/PULL over tcp loopback, "
          f"sender in a separate process; {os.cpu_count()} CPUs")
    header = f"{'resp tokens':>11} {'msg bytes':>10} | {'raw msg/s':>10} {'raw MB/s':>9} | {'rec msg/s':>10} {'rec MB/s':>9} | {'record/raw':>10}"
    print(header)
    print("-" * len(header))
    for T in args.lengths:
        shape = (args.samples, T, args.prompt_len)
        size = len(encode_group(make_group(*shape, seed=0)))
        res: dict[str, list] = {"raw-copy": [], "raw-zerocopy": [], "record": []}
        for _ in range(args.repeats):
            for mode in res:
                res[mode].append(run_once(mode, shape, args.messages))
        med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for m, v in res.items()}
        raw = max(med["raw-copy"], med["raw-zerocopy"])
        rec = med["record"]
        print(f"{T:>11} {size:>10} | {raw[0]:>10.0f} {raw[1]:>9.0f} | {rec[0]:>10.0f} {rec[1]:>9.0f} | {rec[0] / raw[0]:>10.2f}")


if __name__ == "__main__":
    main()
