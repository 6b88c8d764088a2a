"""The benchmark scripts that launch through ``run_once`` of scripts/bench_async_vs_sync.py give it every option
it reads. scripts/bench_tool_latency.py once crashed at its first launch (``args.lookahead`` missing) after
``run_once`` learned the admission lookahead: read from ``run_once``'s own source, so a new option there fails
here, not in a user's hour-long benchmark."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import sys

import pytest

_SCRIPTS = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, _SCRIPTS)
    try:
        yield importlib.import_module("bench_async_vs_sync"), importlib.import_module("bench_tool_latency")
    finally:
        while _SCRIPTS in sys.path:  # the scripts put their own folder there too
            sys.path.remove(_SCRIPTS)


def test_bench_tool_latency_gives_run_once_every_option_it_reads(scripts):
    bench, latency = scripts
    source = inspect.getsource(bench.run_once)
    read = set(re.findall(r"\bargs\.([a-z_]+)", source))
    assert {"staleness", "lookahead", "eval_at_start", "steps"} <= read  # the pattern sees what it should
    args = latency.parser().parse_args([])
    args.preset = []  # set per launch by the script's main
    missing = sorted(name for name in read if not hasattr(args, name))
    assert not missing, f"bench_tool_latency.py lacks {missing} that run_once reads"
    assert (args.lookahead, args.eval_at_start) == (1, False)
