"""Throughput of the trajectory stream against raw ZeroMQ on the same socket type.

For each record shape (samples per group x response tokens), a sender *process* pushes N messages to a receiver
in this process over loopback TCP. Every mode uses PUSH/PULL, the same HWM, the same number of messages and
frames of exactly the same length:

* ``raw``: the sender pushes pre-built ``bytes`` -> the receiver ``recv``s them (the socket limit: no framing,
  no validation, no Python objects). Both receive modes (copy / zero-copy) run; the faster one is reported.
* ``raw+join``: the sender builds each frame from the group's arrays (``b"".join`` of prompt, responses,
  log-probs, padded to the same length), the minimum any transport of these arrays must do -> zero-copy ``recv``.
* ``record``: ``TrajectorySender.send`` (encode + send) -> ``TrajectoryReceiver.recv`` (recv + validate + decode
  to a columnar ``TrajectoryGroup``).
* ``record+samples``: as ``record``, and the receiver also touches ``group.samples`` (builds the ``Sample``
  objects), which the learner does later anyway: the honest upper bound on the receive cost.

Runs are interleaved and repeated; the median is printed, with ratios against ``raw``.

    .venv/bin/python scripts/bench_transport.py [--messages 2000] [--repeats 3] [--shapes 8x128 16x8192 ...]
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
    ctx = zmq.Context()
    if mode.startswith("record"):
        tx = TrajectorySender(address, hwm=hwm, context=ctx)
        for i in range(n):
            tx.send(groups[i % 8])
        tx.send_encoded(END)
        tx.close(linger_ms=-1)
        return
    sizes = [len(encode_group(g)) for g in groups]
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, hwm)
    s.connect(address)
    if mode == "raw+join":
        pads = [bytes(size - g.prompt_ids.nbytes - 8 * g.num_response_tokens) for g, size in zip(groups, sizes)]
        for i in range(n):
            g = groups[i % 8]
            s.send(b"".join([g.prompt_ids, *[x.response_ids for x in g.samples],
                             *[x.behavior_logprobs for x in g.samples], pads[i % 8]]), copy=False)
    else:
        payloads = [bytes(size) for size in sizes]
        for i in range(n):
            s.send(payloads[i % 8], copy=False)
    s.send(END)
    s.close(linger=-1)


def run_once(mode: str, shape: tuple, n: int, hwm: int = 64) -> tuple[float, float]:
    """Returns (messages/s, MB/s) measured at the receiver from the first message to the last."""
    ctx = zmq.Context()
    if mode.startswith("record"):
        rx = TrajectoryReceiver("tcp://127.0.0.1:0", hwm=hwm, context=ctx)
        address = rx.address
    else:
        sock = ctx.socket(zmq.PULL)
        sock.setsockopt(zmq.RCVHWM, hwm)
        sock.bind("tcp://127.0.0.1:*")
        address = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
    proc = mp.get_context("spawn").Process(
        target=_sender, args=(address, "raw" if mode.startswith("raw-") else mode, shape, n, hwm))
    proc.start()
    count = nbytes = 0
    t0 = None
    if mode.startswith("record"):
        touch = mode == "record+samples"
        while True:
            g = rx.recv()
            if t0 is None:
                t0 = time.perf_counter()
            if touch:
                g.samples
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


MODES = ("raw-copy", "raw-zerocopy", "raw+join", "record", "record+samples")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--max-mb-per-run", type=int, default=1024, help="fewer messages for big shapes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=["8x128", "8x512", "8x2048", "16x2048", "16x8192"],
                    help="SAMPLESxRESPONSE_TOKENS per group")
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    logging.disable(logging.WARNING)  # the END marker is (correctly) rejected as malformed

    print(f"prompt {args.prompt_len} tokens, int32 ids + float32 logprobs; up to {args.messages} messages "
          f"(at most {args.max_mb_per_run} MB) per run x {args.repeats} repeats (median), PUSH/PULL over tcp "
          f"loopback, HWM 64, sender in a separate process; {os.cpu_count()} CPUs")
    header = (f"{'shape':>8} {'msg bytes':>9} | {'raw msg/s':>9} {'raw MB/s':>8} | {'join/raw':>8} | "
              f"{'rec msg/s':>9} {'rec MB/s':>8} | {'rec/raw':>7} {'+samples/raw':>12} | {'rec/join':>8}")
    print(header)
    print("-" * len(header))
    for spec in args.shapes:
        n_samples, T = (int(x) for x in spec.lower().split("x"))
        shape = (n_samples, T, args.prompt_len)
        size = len(encode_group(make_group(*shape, seed=0)))
        n = max(100, min(args.messages, args.max_mb_per_run * 10**6 // size))
        res: dict[str, list] = {m: [] for m in MODES}
        for _ in range(args.repeats):
            for mode in MODES:
                res[mode].append(run_once(mode, shape, n))
        med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for m, v in res.items()}
        raw = max(med["raw-copy"], med["raw-zerocopy"])
        join, rec, full = med["raw+join"], med["record"], med["record+samples"]
        print(f"{spec:>8} {size:>9} | {raw[0]:>9.0f} {raw[1]:>8.0f} | {join[0] / raw[0]:>8.2f} | "
              f"{rec[0]:>9.0f} {rec[1]:>8.0f} | {rec[0] / raw[0]:>7.2f} {full[0] / raw[0]:>12.2f} | "
              f"{rec[0] / join[0]:>8.2f}", flush=True)


if __name__ == "__main__":
    main()
