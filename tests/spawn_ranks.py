"""Start the ranks of a multi-process test (torch.multiprocessing.spawn) so that a rank killed by a signal says
where it was, and such a death is retried once.

Why. The 2-rank learner tests run FSDP2 over gloo on CPU, a combination the product uses only in tests (on CPU the
learner does not shard: learner/models.py). Once in some twenty full suites a rank has died with SIGABRT
("terminate called without an active exception", from C++ inside torch) while loading a model between two phases,
and no isolated rerun (over 20 in a row) reproduced it. A rank that raises, or an assertion that fails, is never
retried: only a death by signal is, with a warning that CI's log keeps, and each rank has ``faulthandler`` on so
the Python stacks of all its threads at the signal are printed.
"""

from __future__ import annotations

import faulthandler
import warnings
from typing import Callable

import torch.multiprocessing as mp


def _rank_main(rank: int, fn: Callable, *args) -> None:
    faulthandler.enable(all_threads=True)
    fn(rank, *args)


def spawn_ranks(fn: Callable, make_args: Callable[[], tuple], nprocs: int) -> None:
    """``mp.spawn(fn, args=make_args(), nprocs=nprocs)``; ``make_args`` is called again for the one retry (fresh
    ports)."""
    try:
        mp.spawn(_rank_main, args=(fn, *make_args()), nprocs=nprocs, join=True)
    except mp.ProcessExitedException as exc:
        if not exc.signal_name:
            raise
        warnings.warn(f"rank {exc.error_index} died with {exc.signal_name} (its stacks are printed above); "
                      "retrying the ranks once", RuntimeWarning)
        mp.spawn(_rank_main, args=(fn, *make_args()), nprocs=nprocs, join=True)
