"""The pipeline's limit (report/limit.py) and the group file the two sides share (stream/group_file.py).

The limit is the slower side alone; efficiency is that limit over the pipeline's own time, checked against numbers
worked by hand. The group file must give the learner alone exactly the groups the engine alone generated.
"""

from __future__ import annotations

import math

import pytest
from test_stream_wire import assert_same, make_group

from asyncppo.report.limit import PipelineLimit
from asyncppo.stream.group_file import read_groups, write_groups


def test_limit_is_the_slower_side_and_efficiency_its_share_of_the_run():
    engine_bound = PipelineLimit(engine_s=30.0, learner_s=12.0, samples=2560, engine_occupancy=0.97)
    assert engine_bound.limit_s == 30.0 and engine_bound.slower_side == "engine"
    assert engine_bound.efficiency(40.0) == pytest.approx(0.75)  # 30 / 40
    assert engine_bound.efficiency(30.0) == pytest.approx(1.0)  # perfect overlap
    learner_bound = PipelineLimit(engine_s=9.5, learner_s=19.0, samples=2560)
    assert learner_bound.limit_s == 19.0 and learner_bound.slower_side == "learner"
    assert learner_bound.efficiency(36.2) == pytest.approx(19.0 / 36.2)
    assert math.isnan(learner_bound.engine_occupancy)
    d = engine_bound.as_dict()
    assert (d["limit_s"], d["slower_side"], d["samples"]) == (30.0, "engine", 2560)


@pytest.mark.parametrize("field, value", [("engine_s", 0.0), ("learner_s", -1.0), ("engine_s", math.nan)])
def test_limit_refuses_a_side_without_a_positive_time(field, value):
    kwargs = {"engine_s": 10.0, "learner_s": 5.0, "samples": 8, field: value}
    with pytest.raises(ValueError, match=field):
        PipelineLimit(**kwargs)


@pytest.mark.parametrize("bad", [0.0, -3.0, math.nan])
def test_efficiency_refuses_a_run_without_a_positive_time(bad):
    with pytest.raises(ValueError, match="run's time"):
        PipelineLimit(engine_s=10.0, learner_s=5.0, samples=8).efficiency(bad)


def test_group_file_round_trip_is_exact_and_a_truncated_file_names_the_offset(tmp_path):
    groups = [make_group(seed=s, n=4, T=40) for s in range(3)]
    path = str(tmp_path / "groups.bin")
    write_groups(path, groups)
    back = read_groups(path)
    assert len(back) == 3
    for a, b in zip(groups, back):
        assert_same(a, b)  # ids, log-probs and rewards bit for bit, ticket, prompt, versions
    data = open(path, "rb").read()
    open(path, "wb").write(data[:-5])
    with pytest.raises(ValueError, match=r"groups\.bin: frame at byte \d+ needs"):
        read_groups(path)


def test_learner_alone_trains_whole_batches_in_ticket_order_and_refuses_too_few_groups(tmp_path, monkeypatch):
    from test_learner import _cfg, _groups

    from asyncppo.data.tiny import build_tiny_model
    from asyncppo.learner import learner_alone

    model_dir = build_tiny_model(str(tmp_path / "tiny"), hidden=32, heads=1, intermediate=64, seed=3)
    cfg = _cfg()  # the schema's defaults with the derived clip ratios filled in
    groups = _groups(num_groups=7, n=4)
    for group, ticket in zip(groups, [5, 2, 0, 6, 3, 1, 4]):  # as they arrived: out of ticket order
        group.ticket = ticket
    taken, collate = [], learner_alone.collate_groups
    monkeypatch.setattr(learner_alone, "collate_groups", lambda gs, pad: taken.append([g.ticket for g in gs])
                        or collate(gs, pad))
    out = learner_alone.train_alone(cfg, model_dir, learner_alone.ticket_batches(groups, 2))
    assert taken == [[0, 1], [2, 3], [4, 5]]  # the staleness buffer's order; ticket 6 fills no batch
    assert (out["steps"], out["samples"], len(out["step_s"])) == (3, 24, 3)
    assert out["learner_s"] == pytest.approx(sum(out["step_s"])) and min(out["step_s"]) > 0
    with pytest.raises(ValueError, match="7 groups cannot fill 4 batches of rollout.rollout_batch_size=2"):
        learner_alone.ticket_batches(groups, 2, steps=4)
    with pytest.raises(ValueError, match="no batches"):
        learner_alone.train_alone(cfg, model_dir, [])


def test_a_runs_own_batches_come_back_step_by_step_from_its_ledger(tmp_path):
    """``trainer.save_trained_groups``: the ledger appends each step's groups; the replay gets exactly each step's
    groups in the order the step took them, and a step trained again after a resume counts as its last training."""
    from asyncppo.launch.membership import WorkerLedger
    from asyncppo.learner.learner_alone import trained_batches

    groups = [make_group(seed=s, n=2, T=12) for s in range(5)]
    for i, g in enumerate(groups):
        g.group_id, g.ticket, g.prompt_index = f"w0-{i}", i, i
    ledger = WorkerLedger(str(tmp_path), keep_groups=True)
    ledger.record_trained(1, [groups[2], groups[0]])  # out of ticket order, as a lookahead step may take them
    ledger.record_trained(2, [groups[1], groups[3]])
    ledger.record_trained(2, [groups[3], groups[4]])  # step 2 again, after a resume from the checkpoint at step 1
    batches = trained_batches(str(tmp_path))
    assert [[g.group_id for g in b] for b in batches] == [["w0-2", "w0-0"], ["w0-3", "w0-4"]]
    assert_same(batches[0][0], groups[2])  # the trajectories themselves, bit for bit

    plain = tmp_path / "plain"
    plain.mkdir()
    WorkerLedger(str(plain)).record_trained(1, groups[:2])  # the default keeps only the jsonl line
    assert not (plain / "trained_groups.bin").exists()
    with pytest.raises(FileNotFoundError, match="trainer.save_trained_groups=true"):
        trained_batches(str(plain))
    (plain / "trained_groups.bin").write_bytes(b"")  # kept for part of the run only: the step's groups are missing
    with pytest.raises(ValueError, match="step 1 trained groups not in trained_groups.bin"):
        trained_batches(str(plain))


def test_an_engine_replay_asks_each_sample_for_its_own_length_and_refuses_an_episode():
    """``replay_alone``'s requests: one per sample, tickets in order, each exactly its sample's token count with eos
    ignored; a multi-turn sample (environment tokens in its response) cannot be regenerated by length."""
    import numpy as np

    from asyncppo.rollout.engine import SamplingSpec
    from asyncppo.rollout.engine_alone import replay_requests

    groups = [make_group(seed=s, n=2, T=12) for s in range(3)]
    for i, g in zip([2, 0, 1], groups):
        g.group_id, g.ticket = f"w0-{i}", i
    run = SamplingSpec(n=2, max_tokens=12, temperature=0.7, top_k=5, seed=9, stop_token_ids=(1,))
    requests = replay_requests(groups, run)
    by_ticket = sorted(groups, key=lambda g: g.ticket)
    assert [key for key, _, _ in requests] == [f"w0-{t}/{j}" for t in range(3) for j in range(2)]
    assert [spec.max_tokens for _, _, spec in requests] == [s.num_tokens for g in by_ticket for s in g.samples]
    assert all(prompt == [int(t) for t in g.prompt_ids]
               for (_, prompt, _), g in zip(requests, [g for g in by_ticket for _ in range(2)]))
    assert {(spec.n, spec.ignore_eos, spec.temperature, spec.top_k, spec.seed, spec.stop_token_ids)
            for _, _, spec in requests} == {(1, True, 0.7, 5, None, ())}

    groups[1].samples[0].env_runs = np.array([[2, 3]], dtype=np.int64)
    with pytest.raises(ValueError, match="multi-turn episode"):
        replay_requests(groups, run)
