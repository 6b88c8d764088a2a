"""Every registered benchmark's options are the ones its runner reads, and the launch benchmarks hand ``run_once``
every field it reads. The tool-latency benchmark once crashed at its first launch (``args.lookahead`` missing)
after ``run_once`` learned the admission lookahead: the options are read here from the runners' own source, so a
new option there (or a typo in the registry) fails in this test, not in a user's hour-long benchmark."""

from __future__ import annotations

import dataclasses
import importlib.util
import inspect
import re

import pytest

from asyncppo.bench.launches import Launch, run_once
from asyncppo.bench.registry import BENCHMARKS


def _source(module: str) -> str:
    """A runner module's text, read without importing it (runners import torch, vLLM, TRL)."""
    with open(importlib.util.find_spec(module).origin, encoding="utf-8") as f:
        return f.read()


def _read_options(module: str) -> set[str]:
    """``opts["KEY"]`` anywhere in the module, and ``args.KEY`` where it wraps the options in a namespace."""
    text = _source(module)
    keys = set(re.findall(r'opts\["([a-z_]+)"\]', text))
    if "SimpleNamespace(**opts" in text:
        keys |= set(re.findall(r"\bargs\.([a-z_]+)", text)) - {"seed"}
    return keys


@pytest.mark.parametrize("bench", BENCHMARKS, ids=lambda b: b.name)
def test_a_benchmark_defines_every_option_its_runner_reads_and_nothing_else(bench):
    module = bench.runner.split(":")[0]
    read = _read_options(module)
    assert read, f"{module}: no options read (the pattern sees nothing)"
    missing = sorted(read - set(bench.options))
    unused = sorted(set(bench.options) - read)
    assert not missing, f"{bench.name}: {module} reads {missing}, which the registry does not define"
    assert not unused, f"{bench.name}: options {unused} are never read by {module}"


def test_run_once_reads_only_fields_a_launch_has():
    read = set(re.findall(r"\blaunch\.([a-z_]+)", inspect.getsource(run_once)))
    assert {"staleness", "lookahead", "eval_at_start", "steps", "replay"} <= read  # the pattern sees what it should
    missing = sorted(read - {f.name for f in dataclasses.fields(Launch)})
    assert not missing, f"run_once reads {missing}, which Launch lacks"
    assert (Launch(steps=1, staleness=1).lookahead, Launch(steps=1, staleness=1).eval_at_start) == (1, False)
