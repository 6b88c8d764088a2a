"""``asyncppo bench transport``: throughput of the trajectory stream against raw ZeroMQ on the same socket type.

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

Runs are interleaved and repeated; the median is the figure, and ratios are taken against ``raw``. Why measure
against raw ZeroMQ: the stream's own cost is what the record format adds on top of the socket, and only a
same-socket baseline separates the two.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import statistics
import time

import numpy as np
import zmq

from asyncppo.stream.channels import TrajectoryReceiver, TrajectorySender
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.wire import encode_group

END = b"END"


def make_group(n_samples: int, resp_len: int, prompt_len: int, seed: int) -> TrajectoryGroup:
    """A group of random ids and log-probs of the given shape (the content does not change the cost)."""
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


def run(opts: dict, seed: int, work: str) -> dict:
    """Every shape of ``opts["shapes"]``, all modes interleaved ``opts["repeats"]`` times; the figures are the
    median rates and their ratios per shape (``rec/raw 8x128`` is the record format's share of the raw socket)."""
    logging.disable(logging.WARNING)  # the END marker is (correctly) rejected as malformed
    figures, units, rows = {}, {}, []
    for spec in opts["shapes"]:
        n_samples, T = (int(x) for x in spec.lower().split("x"))
        shape = (n_samples, T, opts["prompt_len"])
        size = len(encode_group(make_group(*shape, seed=seed)))
        n = max(opts["min_messages"], min(opts["messages"], opts["max_mb_per_run"] * 10**6 // size))
        res: dict[str, list] = {m: [] for m in MODES}
        for _ in range(opts["repeats"]):
            for mode in MODES:
                res[mode].append(run_once(mode, shape, n))
        med = {m: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v)) for m, v in res.items()}
        raw = max(med["raw-copy"], med["raw-zerocopy"])
        join, rec, full = med["raw+join"], med["record"], med["record+samples"]
        row = {"shape": spec, "bytes": size, "messages": n, "raw_msg_s": raw[0], "raw_mb_s": raw[1],
               "join/raw": join[0] / raw[0], "rec_msg_s": rec[0], "rec_mb_s": rec[1], "rec/raw": rec[0] / raw[0],
               "+samples/raw": full[0] / raw[0], "rec/join": rec[0] / join[0]}
        rows.append(row)
        for key, unit in (("rec/raw", "ratio"), ("+samples/raw", "ratio"), ("rec/join", "ratio"),
                          ("join/raw", "ratio"), ("rec_msg_s", "messages/s"), ("raw_msg_s", "messages/s")):
            figures[f"{key} {spec}"], units[f"{key} {spec}"] = row[key], unit
        print(f"[transport] {spec}: {size} bytes, raw {raw[0]:.0f} msg/s, rec/raw {row['rec/raw']:.2f}, "
              f"+samples/raw {row['+samples/raw']:.2f}, rec/join {row['rec/join']:.2f}", flush=True)
    return {"figures": figures, "units": units, "detail": {"rows": rows}}
