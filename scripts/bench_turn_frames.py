"""What a multi-turn episode costs on the learner's receive path: frame bytes and decode + door time per message,
single-turn and multi-turn side by side (8 samples of 512 response tokens; the multi-turn ones have 2 environment
segments of 40 and 50 tokens and 3 turn rewards). Pure CPU, seconds.

    PYTHONPATH=$PWD python scripts/bench_turn_frames.py
"""

from __future__ import annotations

import timeit

import numpy as np

from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.validate import ContentLimits, check_content
from asyncppo.stream.wire import decode_group, encode_group

LIMITS = ContentLimits(vocab_size=1000, max_prompt_len=512, max_response_len=1024, max_samples=8)


def make_group(rng: np.random.Generator, turns: bool) -> TrajectoryGroup:
    samples = []
    for _ in range(8):
        lps = -rng.random(512).astype(np.float32)
        extra = {}
        if turns:
            lps[100:140] = 0.0
            lps[300:350] = 0.0
            extra = dict(env_runs=np.array([[100, 40], [300, 50]]), turn_rewards=np.array([0.0, 0.5, 1.0]))
        samples.append(Sample(rng.integers(0, 1000, 512).astype(np.int32), lps, 1.5, "stop", 3, 3, **extra))
    return TrajectoryGroup("0-0", 0, rng.integers(0, 1000, 128).astype(np.int32), samples)


def main(number: int = 5000) -> None:
    rng = np.random.default_rng(0)
    for turns in (False, True):
        frame = encode_group(make_group(rng, turns))
        best = min(timeit.repeat(lambda: check_content(decode_group(frame), LIMITS, 5), number=number, repeat=5))
        print(f"{'multi-turn ' if turns else 'single-turn'}  {len(frame)} bytes  decode + door "
              f"{best / number * 1e6:.1f} us/message")


if __name__ == "__main__":
    main()
