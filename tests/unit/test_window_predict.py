"""The window tuner's prediction check (asyncppo/bench/window_predict.py), on run directories laid out as a window
sweep leaves them: the measured rate by hand, and predictions made by the tuner an auto run builds, fed the run's
own records."""

import json
import random

import pytest

from asyncppo.bench.window_predict import measured, predictions, seed_table
from asyncppo.config.loader import config_to_yaml, load_config


def _run(root, label, k, rng, steps=20, step_s=0.5):
    """A generation-bound fixed-window run of ``steps`` steps (B = 2 groups of n = 4): its config, records, lengths."""
    d = root / label
    d.mkdir(parents=True)
    cfg = load_config(["rollout.rollout_batch_size=2", "rollout.num_return_sequences_in_group=4",
                       f"rollout.max_staleness={k}", "rollout.max_num_seqs=64"])
    (d / "config.yaml").write_text(config_to_yaml(cfg))
    records, groups = [], []
    for step in range(1, steps + 1):
        running = rng.uniform(10, 60)
        records.append({"step": step, "rollout/decode_step_s": 0.002 + 0.0004 * running,
                        "rollout/running_mean": running, "response_length/mean": 30.0, "time/step_s": step_s,
                        "time/wait_s": 0.0, "actor/mismatch_kl": 0.0, "reward/mean": 0.5})
        groups += [" ".join(str(max(2, min(400, int(rng.lognormvariate(3.0, 1.0))))) for _ in range(4))
                   for _ in range(2)]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (d / "summary.json").write_text(json.dumps({"rollout": {"group_lengths": groups}}))
    return d


def test_measured_is_trained_samples_over_learner_time_past_the_warm_up(tmp_path):
    run = _run(tmp_path, "k1", 1, random.Random(0), steps=20, step_s=0.5)
    # steps 9..20: 12 steps of 2 x 4 samples in 12 x 0.5 s
    assert measured(str(run), warmup=8) == pytest.approx(12 * 8 / 6.0)


def test_predictions_come_from_the_tuner_an_auto_run_builds_and_a_sweep_reads_per_window(tmp_path):
    rng = random.Random(1)
    for k in (1, 4):
        _run(tmp_path / "seed-0", f"k{k}", k, rng)
    (tmp_path / "seed-0" / "auto").mkdir()  # not a fixed window: left out
    pred = predictions(str(tmp_path / "seed-0" / "k1"), [1, 4], lookahead=16)
    assert set(pred) == {1, 4} and all(v > 0 for v in pred.values())
    assert pred[4] > pred[1]  # generation-bound: the wider window is predicted faster
    rows = seed_table(str(tmp_path / "seed-0"), lookahead=16)
    assert [r["k"] for r in rows] == [1, 4] and all(r["narrowest"] == 1 for r in rows)
    assert rows[0]["from_narrowest"] == pytest.approx(pred[1]) and rows[1]["from_narrowest"] == pytest.approx(pred[4])
    assert rows[0]["speedup_measured"] == 1.0 and rows[1]["speedup_predicted"] == pytest.approx(pred[4] / pred[1])


def test_a_reservoir_sample_of_lengths_is_handed_with_the_last_step_and_a_short_run_is_refused(tmp_path):
    from asyncppo.bench.window_predict import _read

    run = _run(tmp_path, "k1", 1, random.Random(2), steps=20)
    summary = json.loads((run / "summary.json").read_text())
    summary["rollout"]["group_lengths"] = summary["rollout"]["group_lengths"][:30]  # not 20 steps x 2 in order
    (run / "summary.json").write_text(json.dumps(summary))
    _, train, groups = _read(str(run))
    assert len(groups) == len(train) == 20 and groups[:-1] == [[]] * 19 and len(groups[-1]) == 30
    assert predictions(str(run), [1, 2], lookahead=16)[2] > 0
    short = _run(tmp_path, "k2", 2, random.Random(3), steps=8)
    with pytest.raises(ValueError, match="none past the 8 warm-up steps"):
        measured(str(short), warmup=8)
