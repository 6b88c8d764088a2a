"""The run report and the advisor on a real run: one short ``asyncppo launch`` (real vLLM CPU, ZeroMQ, gloo, Ray),
then its report must draw data in every panel, cope with keys an older or GRPO run lacks, overlay two runs, and
``asyncppo advise`` must turn its rates into a table and a plot."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from asyncppo.report.plots import PANELS, write_report

ASYNCPPO = [sys.executable, "-m", "asyncppo"]
BLUE = np.array([31, 119, 180]) / 255.0  # tab10 colour of the first run
ORANGE = np.array([255, 127, 14]) / 255.0  # second run


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("report") / "run")
    proc = subprocess.run(
        [*ASYNCPPO, "launch", f"trainer.output_dir={out}", "trainer.total_steps=8", "trainer.logger.wandb=false",
         "rollout.rollout_batch_size=4", "rollout.max_staleness=1", "trainer.eval_every=4"],
        capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # the launch draws its own report (on a thread while Ray stops) and waits for it before it exits
    assert f"[asyncppo] run report: {os.path.join(out, 'report.png')}" in proc.stdout, proc.stdout[-2000:]
    assert os.path.getsize(os.path.join(out, "report.png")) > 10_000
    return out


def _has_colour(img: np.ndarray, colour: np.ndarray, min_pixels: int = 30) -> bool:
    rgb = img[..., :3].astype(float)
    if rgb.max() > 1.0:
        rgb = rgb / 255.0
    return int((np.abs(rgb - colour).max(axis=-1) < 0.08).sum()) >= min_pixels


def _read(path: str) -> np.ndarray:
    import matplotlib.image

    return matplotlib.image.imread(path)


def _cells(img: np.ndarray, rows: int, cols: int):
    h, w = img.shape[0], img.shape[1]
    top = int(h * 0.03)  # the suptitle band
    ch, cw = (h - top) // rows, w // cols
    for i in range(rows):
        for j in range(cols):
            yield img[top + i * ch: top + (i + 1) * ch, j * cw: (j + 1) * cw]


def test_report_of_a_real_run_draws_every_panel(real_run, tmp_path):
    paths = write_report(real_run, out_dir=str(tmp_path))
    assert set(paths) == {name for name, *_ in PANELS} | {"report"}
    for name, *_ in PANELS:
        img = _read(paths[name])
        assert img[..., :3].std() > 0.05, f"{name} is blank"
        assert _has_colour(img, BLUE), f"panel {name} drew no data from the run"
    page = _read(paths["report"])
    rows = (len(PANELS) + 1) // 2
    cells = list(_cells(page, rows, 2))
    for (name, *_), cell in zip(PANELS, cells):
        assert _has_colour(cell, BLUE), f"panel {name} is missing from report.png"


def test_report_copes_with_missing_keys_and_overlays(real_run, tmp_path):
    """An 'older' GRPO-like run: no critic, no wall clock, no rollout accounting, no push metric, no eval, no
    summary. Its report still renders; the panels it cannot fill say so; overlaying it on the real run shows both."""
    old = tmp_path / "old"
    old.mkdir()
    dropped = ("critic/", "rollout/", "sync/", "eval/", "time/wall_s", "staleness/token_mean")
    with open(os.path.join(real_run, "metrics.jsonl")) as src, open(old / "metrics.jsonl", "w") as dst:
        for line in src:
            rec = {k: v for k, v in json.loads(line).items() if not k.startswith(dropped)}
            if len(rec) > 1:
                dst.write(json.dumps(rec) + "\n")
    with open(old / "metrics.jsonl", "a") as dst:
        dst.write('{"step": 99, "reward/me')  # a run killed mid-write
    paths = write_report(str(old), out_dir=str(tmp_path / "old_report"))
    assert not _has_colour(_read(paths["push"]), BLUE)  # nothing to draw: a message instead
    for name in ("reward_step", "reward_wall", "lag", "utilisation", "lengths"):
        assert _has_colour(_read(paths[name]), BLUE), name

    both = write_report(real_run, str(old), out_dir=str(tmp_path / "cmp"))
    img = _read(both["reward_step"])
    assert _has_colour(img, BLUE) and _has_colour(img, ORANGE)


def test_report_and_advise_cli(real_run, tmp_path):
    proc = subprocess.run([*ASYNCPPO, "report", real_run, "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert os.path.isfile(tmp_path / "report.png")
    png = str(tmp_path / "advise.png")
    proc = subprocess.run([*ASYNCPPO, "advise", real_run, "--gpus", "4", "--staleness", "0,1", "--lookahead", "0",
                           "--steps", "16", "--out", png], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "recommended:" in proc.stdout and "colocated" in proc.stdout
    # 3 splits x (k = 0; k = 1 with j = 0 and without a lookahead) + sync + head
    assert len([l for l in proc.stdout.splitlines() if " | " in l]) == 3 * 3 + 1 + 1
    assert _read(png)[..., :3].std() > 0.05


def test_measured_rates_of_a_real_run(real_run):
    from asyncppo.report.rates import measure

    rates = measure(real_run, skip=2)
    assert rates.gen.base_s >= 0 and rates.gen.per_seq_s >= 0 and rates.gen.base_s + rates.gen.per_seq_s > 0
    assert rates.train.per_token_s > 0 or rates.train.base_s > 0
    assert rates.batch_groups == 4 and rates.group_size == 8 and rates.max_staleness == 1
    assert rates.lookahead is None  # the run set no rollout.admission_lookahead
    # the builtin addition task answers in at most 4 tokens + eos: replayed groups come from the run itself
    assert 1 <= rates.lengths.mean <= 5 and rates.measured_samples_per_s > 0


def test_cli_errors_are_clear(tmp_path):
    proc = subprocess.run([*ASYNCPPO, "report", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no metrics.jsonl" in proc.stderr
    proc = subprocess.run([*ASYNCPPO, "advise", "--gpus", "8"], capture_output=True, text=True)
    assert proc.returncode == 2 and "exactly one of RUN_DIR or --workload" in proc.stderr
    proc = subprocess.run([*ASYNCPPO, "advise", "--workload", "7b-long", "--gpus", "8", "--staleness", "a"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--staleness" in proc.stderr
    proc = subprocess.run([*ASYNCPPO, "advise", "--workload", "7b-long", "--gpus", "8", "--lookahead", "-1"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--lookahead" in proc.stderr
    proc = subprocess.run([*ASYNCPPO, "advise", "--workload", "7b-long", "--gpus", "9", "--nodes", "2"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "multiple of --nodes" in proc.stderr
    shutil.rmtree(tmp_path, ignore_errors=True)
