"""``asyncppo bench --quick`` end to end on the two cheapest benchmarks (the transport microbenchmark and the
shared-memory weight push at their quick sizes: real sockets, real process groups, ~25 s on 2 cores). The only
benchmark run inside the test suite: it checks the command writes a valid result file per benchmark and prints each
quick figure beside the committed one."""

from __future__ import annotations

import glob
import os
import subprocess
import sys

from asyncppo.bench.result import load

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_quick_reruns_the_two_cheapest_benchmarks_beside_the_committed_figures(tmp_path):
    env = dict(os.environ, PYTHONPATH=REPO)
    proc = subprocess.run([sys.executable, "-m", "asyncppo", "bench", "--quick", "--only", "transport,shm-push",
                           "--out", str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for name, headline, committed in (("transport", "rec/raw 8x128", load(f"{REPO}/docs/benchmarks/results/"
                                                                              "transport.json")),
                                      ("shm-push", "gloo/shm", load(f"{REPO}/docs/benchmarks/results/shm-push.json"))):
        files = glob.glob(str(tmp_path / "quick" / name / "*.json"))
        assert len(files) == 1, files
        fresh = load(files[0])  # validated: statistics and verdict agree with the figures
        assert fresh.source == "measured" and fresh.command == f"asyncppo bench --quick --only {name}"
        assert fresh.machine.cores == os.cpu_count() and isinstance(fresh.machine.load_after, float)
        fig = fresh.figure(headline)
        assert fig is not None and fig.n == 1 and fig.mean > 0
        row = next(line for line in proc.stdout.splitlines() if line.startswith(f"| {name} | {headline} |"))
        assert f"{committed.figure(headline).mean:.3g}" in row  # the committed figure beside the quick one
        assert row.rstrip().endswith(("| no |", "| **MOVED** |"))
        assert f"| {name} | {committed.verdict} | {fresh.verdict} |" in proc.stdout
