"""Run one registered benchmark: resolve its options, run each seed, aggregate, compute the verdict, write the JSON.

Everything a result file claims is produced here from what the runner measured: the seeds' figures become
:class:`~asyncppo.bench.result.Figure` s (mean, spread), the verdict comes from the registry's target, and the machine
and the commit are read before and after the run. A seed whose runner fails is recorded as failed (its figures
missing, so an every-seed target cannot be met) and the others still run: a long benchmark loses nothing to one
bad seed, and the file says what happened.
"""

from __future__ import annotations

import datetime
import importlib
import math
import os
import shlex
import shutil
import sys
import time
import traceback

from asyncppo.bench.machine import REPO, git_state, load_average, machine_before
from asyncppo.bench.registry import Benchmark
from asyncppo.bench.result import Figure, Result

RESULTS_DIR = os.path.join(REPO, "bench-results")  # every run (not committed)
RECORD_DIR = os.path.join(REPO, "docs", "benchmarks", "results")  # the committed latest result of each benchmark


class OptionError(ValueError):
    """A command-line option the benchmark does not have, or a value of the wrong type."""


def _typed(key: str, text: str, default):
    """``text`` read as the type of the option's default (lists: comma-separated items of the first item's type)."""
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return text.lower() in ("true", "1", "yes")
        if isinstance(default, list):
            kind = type(default[0]) if default else str
            return [kind(x) for x in text.split(",") if x.strip()]
        return type(default)(text)
    except ValueError:
        like = (",".join(map(str, default)) or "a,b") if isinstance(default, list) else repr(default)
        what = "comma-separated items" if isinstance(default, list) else type(default).__name__
        raise OptionError(f"{key}={text!r}: expected {what} like {like}") from None


def resolve_options(bench: Benchmark, tokens: list[str], base: dict | None = None) -> dict:
    """The benchmark's options: its defaults, then ``base`` (the quick run's changes), then ``KEY=VALUE`` tokens for
    its own options; any other token is a Hydra override appended to ``overrides`` (for the benchmarks that launch
    or compose a config) and refused by name elsewhere."""
    opts = {k: (list(v) if isinstance(v, list) else v) for k, v in bench.options.items()}
    opts.update(base or {})
    for token in tokens:
        key, eq, value = token.partition("=")
        if eq and key in opts and key != "overrides":
            opts[key] = _typed(key, value, bench.options[key])
        elif bench.takes_overrides:
            opts["overrides"].append(token)
        else:
            raise OptionError(f"{token!r}: {bench.name} has no option {key!r} (options: {', '.join(opts)})")
    return opts


def _clean(obj):
    """``obj`` with non-finite floats as None and tuples as lists: what strict JSON can hold."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return repr(obj)


def runner_of(bench: Benchmark):
    module, _, func = bench.runner.partition(":")
    return getattr(importlib.import_module(module), func)


def stamp() -> str:
    return datetime.datetime.now().strftime("%Y%m%d-%H%M%S")


def run_benchmark(bench: Benchmark, opts: dict, seeds: list, *, out_dir: str = RESULTS_DIR,
                  record_dir: str | None = None, argv: list[str] | None = None) -> tuple[Result, str]:
    """Run ``bench`` at each seed with ``opts``; write ``out_dir/<name>/<time>.json`` (and ``record_dir/<name>.json``
    when given). Returns the result and the path written."""
    runner = runner_of(bench)
    when = stamp()
    base = os.path.join(out_dir, bench.name)
    work_root = os.path.join(base, f"work-{when}")
    machine = machine_before()
    git = git_state()
    outcomes, errors, started = {}, {}, time.perf_counter()
    for seed in seeds:
        work = os.path.join(work_root, f"seed-{seed}")
        os.makedirs(work, exist_ok=True)
        print(f"[bench] {bench.name}: seed {seed} (work in {work})", flush=True)
        try:
            outcomes[str(seed)] = runner(opts, seed, work)
        except Exception as exc:  # noqa: BLE001 - a failed seed is recorded, the others still run
            errors[str(seed)] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
    machine.load_after = load_average()
    names = list(dict.fromkeys(n for o in outcomes.values() for n in o["figures"]))
    units = {n: u for o in outcomes.values() for n, u in o.get("units", {}).items()}
    figures = [Figure.of(n, {str(s): outcomes.get(str(s), {}).get("figures", {}).get(n) for s in seeds},
                         unit=units.get(n, "")) for n in names]
    command = shlex.join(["asyncppo", "bench", *(argv if argv is not None else [bench.name])])
    result = Result.build(
        name=bench.name, question=bench.question, command=command, config=_clean(opts), seeds=list(seeds), git=git,
        machine=machine, figures=figures, target=bench.target, date=datetime.datetime.now().isoformat(timespec="seconds"),
        headline=bench.headline if bench.headline in names else "",
        details=_clean({"seeds": {s: o.get("detail", {}) for s, o in outcomes.items()}, "errors": errors,
                        "wall_s": time.perf_counter() - started, "python": sys.version.split()[0]}))
    os.makedirs(base, exist_ok=True)
    path = os.path.join(base, f"{when}.json")
    result.save(path)
    if record_dir:
        os.makedirs(record_dir, exist_ok=True)
        shutil.copyfile(path, os.path.join(record_dir, f"{bench.name}.json"))
    return result, path
