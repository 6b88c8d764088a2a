"""The driver's console: progress lines from metrics.jsonl, actor warnings/errors/tracebacks from the log files, and the
end-of-run summary table. Driven with files written here, as the learner and actors write them in a run."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

from asyncppo.launch.console import RunConsole, log_path, summary_table
from asyncppo.metrics.logger import MetricsLogger


def _append(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(text)


def _console(tmp_path, **kw):
    out = io.StringIO()
    clock = iter(range(1000)).__next__
    return RunConsole(str(tmp_path), stream=out, clock=lambda: float(clock()), **kw), out


def test_progress_lines_follow_metrics_and_match_the_learner_format(tmp_path):
    console, out = _console(tmp_path, total_steps=3)
    console.poll()
    assert out.getvalue() == ""  # nothing written yet: no file is fine
    record = {"reward/mean": 0.25, "staleness/mean": 1.0, "staleness/max": 1, "staleness/token_mean": 0.5,
              "actor/mismatch_kl": 0.0123, "actor/approx_kl": 0.0}
    _append(tmp_path / "metrics.jsonl", json.dumps({"step": 1, **record}) + "\n" + '{"step": 2, "rew')
    console.poll()
    lines = out.getvalue().splitlines()
    assert len(lines) == 1  # the second record is incomplete: it waits for its newline
    assert lines[0].startswith("step 1/3 |") and "reward 0.250" in lines[0] and "lagmax 1" in lines[0]
    # the off-policy KL stands with the lag it comes from, before the update's own KL
    assert " | toklag 0.50 | offkl 0.0123 | kl 0.0000" in lines[0]
    # the learner's own console line for the same record is the same apart from the elapsed time
    learner_line = MetricsLogger(str(tmp_path / "x"), jsonl=False, total_steps=3).format_line(1, {"step": 1, **record})
    assert lines[0].split(" | ")[2:] == learner_line.split(" | ")[2:]
    _append(tmp_path / "metrics.jsonl", 'ard/mean": 0.5}\n{"step": 3, "eval/test.jsonl/accuracy_greedy": 0.75}\n')
    console.poll()
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 1/3", "step 2/3", "step 3/3"]
    assert "test.jsonl/accuracy_greedy 0.750" in lines[2]
    assert [r["step"] for r in console.records] == [1, 2, 3]


def test_log_every_and_progress_off(tmp_path):
    console, out = _console(tmp_path, total_steps=5, log_every=2)
    _append(tmp_path / "metrics.jsonl", "".join(json.dumps({"step": s, "reward/mean": 0.1}) + "\n" for s in range(1, 6)))
    console.poll()
    assert [line.split(" |")[0] for line in out.getvalue().splitlines()] == ["step 2/5", "step 4/5", "step 5/5"]
    quiet, qout = _console(tmp_path, total_steps=5, progress=False)
    quiet.poll()
    assert qout.getvalue() == "" and len(quiet.records) == 5  # still read, for the summary


def test_actor_logs_show_warnings_errors_tracebacks_and_project_lines_only(tmp_path):
    console, out = _console(tmp_path)
    _append(log_path(str(tmp_path), "worker-0"), "\n".join([
        "INFO 11-22 some engine chatter",
        "[asyncppo] rollout worker 0: 100 prompts",
        "WARNING:asyncppo.rollout:worker 0: the reward function failed 1 time(s) so far",
        "WARNING:vllm.triton_utils.importing:Triton is installed, but doesn't include CPU backend. Disabling Triton.",
        "step 3/10 | 5s | reward 0.1",
        "Traceback (most recent call last):",
        '  File "x.py", line 1, in <module>',
        "ValueError: boom",
        "after the traceback",
        "\x1b[33mERROR\x1b[0m coloured",
    ]) + "\n")
    _append(log_path(str(tmp_path), "learner"), "[asyncppo] training started at step 1\n[asyncppo] done: {...}\n")
    console.poll()
    assert out.getvalue().splitlines() == [
        "[learner] [asyncppo] training started at step 1",
        "[worker-0] [asyncppo] rollout worker 0: 100 prompts",
        "[worker-0] WARNING:asyncppo.rollout:worker 0: the reward function failed 1 time(s) so far",
        "[worker-0] Traceback (most recent call last):",
        '[worker-0]   File "x.py", line 1, in <module>',
        "[worker-0] ValueError: boom",
        "[worker-0] ERROR coloured",
    ]
    console.poll()  # nothing new, nothing printed twice
    assert len(out.getvalue().splitlines()) == 7


def test_summary_table_values(tmp_path):
    records = [{"step": s, "reward/mean": 0.1 * s, "staleness/mean": 1.0, "staleness/max": s % 3,
                "util/rollout_busy": 0.5, "util/train_busy": 1.0, "samples_trained": 128 * s} for s in range(1, 21)]
    records.insert(0, {"step": 0, "eval/accuracy_greedy": 0.5})
    records.append({"step": 20, "eval/accuracy_greedy": 0.75})
    summary = {"steps": 20, "samples_trained": 2560, "buffer": {"dropped_stale": 3},
               "rejected": {"schema": 2, "oversized": 1, "type": 0}}
    table = summary_table(records, summary, 61.2)
    rows = dict(line.split(" | ", 1) for line in table.splitlines()[2:])
    rows = {k.strip(): v for k, v in rows.items()}
    assert rows["steps"] == "20"
    assert rows["samples trained"] == "2,560"
    assert rows["wall time"] == "61s"
    # first and last tenth (2 steps each): mean(0.1, 0.2) and mean(1.9, 2.0)
    assert rows["training reward"] == "0.150 (first 2 steps) -> 1.950 (last 2)"
    assert rows["eval/accuracy_greedy"] == "0.500 -> 0.750"
    assert rows["lag (mean / max)"] == "1.00 / 2"
    assert rows["busy (rollout / train)"] == "0.50 / 1.00"
    assert rows["groups dropped (stale)"] == "3"
    assert rows["messages rejected"] == "3 (oversized 1, schema 2)"
    assert "engine occupancy (without the last step / all)" not in rows and "hint:" not in table  # none reported


def test_summary_points_to_the_advisor_only_when_engines_lacked_tickets_while_the_learner_waited():
    records = [{"step": s, "reward/mean": 0.1, "util/train_busy": 0.7} for s in range(1, 11)]
    starved = {"rollout": {"occupancy": 0.63, "occupancy_steady": 0.69, "unfilled_ticket_s": 32.5,
                           "engine_step_s": 140.0}}
    table = summary_table(records, starved, 280.0, run_dir="/runs/a")
    rows = {k.strip(): v for k, v in (line.split(" | ", 1) for line in table.splitlines()[2:] if " | " in line)}
    assert rows["engine occupancy (without the last step / all)"] == "0.69 / 0.63"
    hint = table.splitlines()[-1]
    assert hint.startswith("hint: the engines ran 0.69 full") and "32 engine-s" in hint and "waited 30%" in hint
    assert "asyncppo advise /runs/a --gpus N --lookahead" in hint
    # each condition alone silences it: a full engine, slots free for another reason, a busy learner
    for change in ({"occupancy_steady": 0.9}, {"unfilled_ticket_s": 13.9}):
        assert "hint:" not in summary_table(records, {"rollout": {**starved["rollout"], **change}}, 1.0)
    busy = [{**r, "util/train_busy": 0.9} for r in records]
    assert "hint:" not in summary_table(busy, starved, 1.0)
    # an auto window (records carry tune/k, tune/j): the tuner set it, so the hint names its limits, not a number
    auto = [{**r, "tune/k": 4 if r["step"] < 6 else 6, "tune/j": 3} for r in records]
    hint = summary_table(auto, starved, 280.0, run_dir="/runs/a").splitlines()[-1]
    assert hint.startswith("hint: the engines ran 0.69 full") and "ended at k = 6, j = 3 (widest k 6)" in hint
    assert "rollout.max_staleness_cap" in hint and "asyncppo advise" not in hint


def test_a_multi_turn_run_whose_window_holds_episodes_at_their_tools_is_told_to_widen_it():
    """Episodes mostly at their environment: the hint is about the window, and it is given when the engines sat
    empty with every episode at its tool for a tenth of the time or more (17% here: 0.034 s of each 0.2 s step)
    while the learner waited; it names rollout.max_staleness, the episode counts and the advisor with the widths to
    try. The engines' occupancy does not decide it (a wide enough window still reads ~0.8 full behind a tool)."""
    starved = {"rollout": {"occupancy": 0.70, "occupancy_steady": 0.71, "unfilled_ticket_s": 2.5,
                           "engine_step_s": 6.7}}
    # the first quarter (a warm-up with few episodes at the tool) is left out of the means
    records = [{"step": s, "reward/mean": 0.1, "util/train_busy": 0.76, "time/step_s": 0.2,
                "episodes/env_wait_s": 0.0 if s <= 2 else 0.034,
                "episodes/at_env_mean": 10.0 if s <= 2 else 175.4,
                "episodes/in_engine_mean": 40.0 if s <= 2 else 29.6} for s in range(1, 9)]
    hint = summary_table(records, starved, 60.0, run_dir="/runs/b").splitlines()[-1]
    assert hint.startswith("hint: the engines sat empty 17% of the time with every episode at its environment "
                           "while the learner waited 24%"), hint
    assert "~175 episodes at their environment against ~30 in the engines" in hint
    assert "rollout.max_staleness" in hint and "asyncppo advise /runs/b --gpus N --staleness K" in hint
    assert "--lookahead" not in hint
    # a window wide enough: the engines ~0.7 full (a turn leaves them at every call) but empty only 5% of the time
    wide = [{**r, "episodes/env_wait_s": 0.01} for r in records]
    assert "hint:" not in summary_table(wide, starved, 60.0, run_dir="/runs/b")
    # episodes mostly in the engines: the tickets are held by decoding, so the advisor's hint as for one turn
    decoding = [{**r, "episodes/at_env_mean": 5.0, "episodes/in_engine_mean": 50.0} for r in records]
    assert "asyncppo advise /runs/b --gpus N --lookahead" in summary_table(decoding, starved, 60.0,
                                                                          run_dir="/runs/b").splitlines()[-1]


def test_redirect_output_captures_python_and_c_level_writes(tmp_path):
    code = (
        "import os, sys\n"
        "from asyncppo.launch.console import redirect_output\n"
        f"redirect_output({str(tmp_path)!r}, 'worker-7')\n"
        "print('python stdout')\n"
        "print('python stderr', file=sys.stderr)\n"
        "os.write(1, b'fd one\\n'); os.write(2, b'fd two\\n')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "" and proc.stderr == ""
    text = open(log_path(str(tmp_path), "worker-7"), encoding="utf-8").read()
    assert text.splitlines() == ["python stdout", "python stderr", "fd one", "fd two"]


def test_a_run_resumed_in_its_own_directory_prints_only_what_this_launch_adds(tmp_path):
    """``trainer.resume_from=<run dir>`` with the same output directory: the earlier launch's records count for the
    summary but are not printed again, nor are its log lines; the new launch's are."""
    earlier = [{"step": s, "reward/mean": 0.1 * s, "time/wall_s": 2.0 * s} for s in (1, 2, 3)]
    _append(tmp_path / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in earlier))
    _append(log_path(str(tmp_path), "learner"), "[asyncppo] training started at step 1\n[asyncppo] stopped at step 3\n")
    console, out = _console(tmp_path, total_steps=5)
    console.poll()
    assert out.getvalue() == "" and [r["step"] for r in console.records] == [1, 2, 3]
    _append(log_path(str(tmp_path), "learner"), "[asyncppo] training started at step 4 (resumed from x)\n")
    _append(tmp_path / "metrics.jsonl", json.dumps({"step": 4, "reward/mean": 0.4, "time/wall_s": 1.0}) + "\n")
    console.poll()
    lines = out.getvalue().splitlines()
    assert [line.split(" |")[0] for line in lines] == ["step 4/5", "[learner] [asyncppo] training started at step 4 "
                                                       "(resumed from x)"]
    assert [r["step"] for r in console.records] == [1, 2, 3, 4]
    assert " eta " not in lines[0]  # the resumed learner's clock started again: one point, no rate yet
