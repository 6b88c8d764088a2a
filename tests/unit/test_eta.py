"""The progress line's time left: the recent steps' training clock, a restart's new clock, and its format."""

from __future__ import annotations

import io
import json

from asyncppo.launch.console import RunConsole
from asyncppo.metrics.eta import StepRate, format_duration
from asyncppo.metrics.logger import MetricsLogger


def test_rate_is_the_recent_window_not_the_whole_run():
    rate = StepRate(window=4)
    assert rate.eta_s(10) is None  # no point yet
    rate.add(1, 30.0)  # a slow first step (the pipeline fills)
    assert rate.eta_s(10) is None  # one point is no rate
    for step in range(2, 7):
        rate.add(step, 30.0 + 2.0 * (step - 1))  # then 2 s a step
    # window of 4 steps: steps 2..6, 8 s over 4 steps; 4 steps left
    assert rate.seconds_per_step() == 2.0
    assert rate.eta_s(10) == 8.0
    assert rate.eta_s(6) == 0.0 and rate.eta_s(None) is None


def test_a_restarted_learner_starts_a_new_window():
    rate = StepRate(window=10)
    for step, wall in ((1, 1.0), (2, 2.0), (3, 3.0)):
        rate.add(step, wall)
    rate.add(3, 0.5)  # the learner restarted from step 2's checkpoint: step 3 again, a new clock
    assert rate.seconds_per_step() is None
    rate.add(4, 5.5)
    assert rate.seconds_per_step() == 5.0 and rate.eta_s(6) == 10.0
    rate.add(5, None)  # a record without the clock changes nothing
    rate.add(5, True)
    assert rate.eta_s(6) == 10.0


def test_format_duration():
    assert [format_duration(s) for s in (0, 44.6, 60, 245, 3599, 3600, 4321, 86399, 2 * 86400 + 3 * 3600 + 59)] == [
        "0s", "45s", "1m00s", "4m05s", "59m59s", "1h00m", "1h12m", "23h59m", "2d03h"]


def _records(walls):
    return [{"step": s, "time/wall_s": w, "reward/mean": 0.5} for s, w in enumerate(walls, start=1)]


def test_learner_and_driver_lines_show_the_same_eta_and_none_on_the_last_step(tmp_path):
    walls = [10.0, 13.0, 16.0, 19.0]  # 3 s a step
    out, driver_out = io.StringIO(), io.StringIO()
    console = RunConsole(str(tmp_path), total_steps=4, stream=driver_out, clock=lambda: 0.0)  # before the run, as
    logger = MetricsLogger(str(tmp_path), total_steps=4, stream=out)                      # the launcher makes it
    for record in _records(walls):
        logger.log(record["step"], {k: v for k, v in record.items() if k != "step"})
    logger.close()
    learner = out.getvalue().splitlines()
    console.poll()
    driver = driver_out.getvalue().splitlines()
    assert len(learner) == len(driver) == 4
    # step 1: no rate yet; step 2: 3 s a step x 2 left; step 3: x 1; step 4 is the last: no eta
    assert ["eta" in line.split(" | ")[2] for line in learner] == [False, True, True, False]
    assert learner[1].split(" | ")[2] == "eta 6s" and learner[2].split(" | ")[2] == "eta 3s"
    assert [line.split(" | ")[2:] for line in learner] == [line.split(" | ")[2:] for line in driver]
    assert json.loads(open(tmp_path / "metrics.jsonl").readline())["time/wall_s"] == 10.0
