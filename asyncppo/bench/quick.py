"""``asyncppo bench --quick``: the cheap benchmarks rerun at reduced size, printed beside the committed figures.

For a skeptic on a fresh machine: one command that reruns what fits in well under an hour on 2 cores (the registry
entries with a ``quick`` setting) and says, figure by figure, whether this machine's number lies within the spread
the committed result recorded. A figure is flagged ``moved`` when it falls outside the committed range widened by
``max(std, tolerance x |mean|)``: with one committed seed the std is 0 and the benchmark's tolerance (a share of the
value; larger for figures known to swing with the box's load) sets the band alone. The quick run's own JSON is
written like any other run's, under ``<out>/quick/<name>/``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from asyncppo.bench.driver import RECORD_DIR, RESULTS_DIR, resolve_options, run_benchmark
from asyncppo.bench.registry import BENCHMARKS, Benchmark
from asyncppo.bench.render import number, spread
from asyncppo.bench.result import Figure, Result, load


@dataclass
class Row:
    bench: str
    figure: str
    committed: Optional[Figure]
    value: Optional[float]
    band: Optional[tuple[float, float]]
    headline: bool

    @property
    def moved(self) -> Optional[bool]:
        if self.band is None or self.value is None:
            return None
        return not self.band[0] <= self.value <= self.band[1]


def band(fig: Figure, tolerance: float) -> Optional[tuple[float, float]]:
    """The range a fresh value may fall in without being flagged (None: nothing committed to compare with)."""
    if fig.n == 0:
        return None
    slack = max(fig.std or 0.0, tolerance * abs(fig.mean))
    return fig.min - slack, fig.max + slack


def compare(bench: Benchmark, fresh: Result, committed: Optional[Result]) -> list[Row]:
    """One row per figure of the fresh run that has a value, the headline first."""
    rows = []
    for fig in fresh.figures:
        value = fig.mean if fig.n else None
        old = committed.figure(fig.name) if committed else None
        rows.append(Row(bench.name, fig.name, old, value, band(old, bench.tolerance) if old else None,
                        fig.name == bench.headline))
    rows.sort(key=lambda r: not r.headline)
    return rows


def table(rows: list[Row], verdicts: dict[str, tuple[str, str]]) -> str:
    """The headline of each benchmark, then every other figure that moved; the verdicts side by side."""
    out = ["| benchmark | figure | committed | quick run | moved beyond the spread? |", "|---|---|---|---|---|"]
    for r in rows:
        if not r.headline and not r.moved:
            continue
        committed = spread(r.committed) if r.committed else "no committed figure"
        flag = {None: "-", True: "**MOVED**", False: "no"}[r.moved]
        out.append(f"| {r.bench} | {r.figure} | {committed} | {number(r.value)} | {flag} |")
    out += ["", "| benchmark | committed verdict | quick verdict |", "|---|---|---|"]
    out += [f"| {name} | {old} | {new} |" for name, (old, new) in verdicts.items()]
    return "\n".join(out)


def run_quick(only: list[str], out_dir: str = RESULTS_DIR, results_dir: str = RECORD_DIR) -> tuple[str, int]:
    """Run the quick entries (``only`` restricts them by name); the printed comparison and the number of failed
    seeds."""
    quick = [b for b in BENCHMARKS if b.quick is not None and (not only or b.name in only)]
    missing = sorted(set(only) - {b.name for b in quick})
    if missing:
        raise ValueError(f"not in the quick table: {', '.join(missing)} (quick: "
                         f"{', '.join(b.name for b in BENCHMARKS if b.quick is not None)})")
    rows, verdicts, failed = [], {}, 0
    for b in quick:
        print(f"[quick] {b.name}: {b.quick_expected or b.expected}", flush=True)
        opts = resolve_options(b, [], base=b.quick)
        fresh, path = run_benchmark(b, opts, list(b.quick_seeds), out_dir=os.path.join(out_dir, "quick"),
                                    argv=["--quick", "--only", b.name])
        failed += len(fresh.details.get("errors", {}))
        committed_path = os.path.join(results_dir, f"{b.name}.json")
        committed = load(committed_path) if os.path.exists(committed_path) else None
        rows += compare(b, fresh, committed)
        verdicts[b.name] = (committed.verdict if committed else "no committed result", fresh.verdict)
        print(f"[quick] {b.name}: written {path}", flush=True)
    return table(rows, verdicts), failed
