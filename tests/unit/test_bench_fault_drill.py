"""The fault-drill benchmark reads scripts/fault_drill.py's printed table back into figures: checked against the
drill's own ``table()``, so a change of the drill's output format fails here, not after a 5-minute drill."""

from __future__ import annotations

import importlib.util
import os

from asyncppo.bench.fault_drill import SCRIPT, parse_table


def test_the_drills_own_table_parses_back_with_the_unrecovered_and_undetected_as_none():
    spec = importlib.util.spec_from_file_location("fault_drill_script", SCRIPT)
    drill = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(drill)  # defines functions only; main() is not called
    rows = [{"fault": "SIGKILL worker", "detected_s": 0.2, "recovered_s": 17.2, "steps_lost": 0, "redrawn_groups": 2},
            {"fault": "SIGKILL learner", "detected_s": 0.2, "recovered_s": 11.5, "steps_lost": 3,
             "redrawn_groups": 12},
            {"fault": "dropped connection", "detected_s": None, "recovered_s": None, "steps_lost": 0,
             "redrawn_groups": 0}]
    text = "some log line | with a bar\n" + drill.table(rows) + "\nchecks: all held"
    back = parse_table(text)
    assert [r["fault"] for r in back] == ["SIGKILL worker", "SIGKILL learner", "dropped connection"]
    assert [(r["detected_s"], r["recovered_s"], r["steps_lost"]) for r in back] == \
        [(0.2, 17.2, 0.0), (0.2, 11.5, 3.0), (None, None, 0.0)]
    assert back[1]["samples_redrawn"] == 12 * drill.GROUP
    assert os.path.basename(SCRIPT) == "fault_drill.py"
