"""The rollout worker's loop against a real learner side, without Ray: ZeroMQ stream, control and admission
sockets, a gloo weight-sync group, and the transformers engine in continuous mode (the vLLM engine has its own
step-level tests; one vLLM engine per process is the safe pattern, and the session already holds one).

What the worker must do, checked here:
* keep generating groups continuously and stream each as it finishes, with its ticket;
* load a weight push *while sequences are in flight* and carry on with them, so that some sample's tokens come
  from two versions: version_spans record the swap and version_min/max are the first/last span;
* stop cleanly when the learner says so.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from asyncppo.config import load_config
from asyncppo.rollout.worker import RolloutWorker
from asyncppo.staleness import AdmissionController, AdmissionServer
from asyncppo.stream.channels import ControlPublisher, TrajectoryReceiver
from asyncppo.stream.endpoints import Endpoints
from asyncppo.sync import WeightSender, find_free_port, make_sync_group


@pytest.mark.parametrize("inflight", ["keep", "recompute"])
def test_worker_streams_continuously_and_updates_weights_in_flight(random_model_dir, inflight):
    """The untrained model rarely says eos, so its sequences run for many steps: a push is sure to meet some."""
    from transformers import AutoModelForCausalLM

    B, k = 4, 3
    cfg = load_config([
        "rollout.engine=hf", f"rollout.rollout_batch_size={B}", "rollout.num_return_sequences_in_group=4",
        f"rollout.max_staleness={k}", "rollout.max_num_seqs=16", f"rollout.inflight_update={inflight}",
        "rollout.response_length=32", "cluster.timeout_s=60",
    ])
    receiver = TrajectoryReceiver("tcp://127.0.0.1:0")
    control = ControlPublisher("tcp://127.0.0.1:0")
    ctrl = AdmissionController(B, k)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0")
    port = find_free_port()
    ep = Endpoints(receiver.address, control.address, server.address, "127.0.0.1", port, 2, "gloo")
    worker = RolloutWorker(cfg, 0, 1, ep, random_model_dir)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(worker.run()), daemon=True)
    thread.start()
    group = make_sync_group("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
    sender = WeightSender(group)
    groups = []
    try:
        control.publish(version=0, weights_version=0)

        def collect(n_groups: int, deadline_s: float = 60.0) -> None:
            end = time.monotonic() + deadline_s
            while len(groups) < n_groups and time.monotonic() < end:
                g = receiver.recv(timeout_ms=100)
                if g is not None:
                    groups.append(g)
            assert len(groups) >= n_groups, f"only {len(groups)} groups arrived"

        end = time.monotonic() + 60
        while not (getattr(worker, "engine", None) is not None and worker.engine.num_unfinished_seqs() >= 8):
            assert time.monotonic() < end, "the worker never filled its engine"
            time.sleep(0.005)
        ctrl.set_version(1)
        control.publish(version=1, weights_version=1)
        sender.push(model.state_dict(), 1)
        collect(3 * B)
        control.publish(version=1, weights_version=1, stop=True)
        thread.join(30)
        assert not thread.is_alive()
    finally:
        control.publish(version=1, weights_version=1, stop=True)
        thread.join(30)
        for c in (server, control, receiver, group):
            c.close()
    samples = [s for g in groups for s in g.samples]
    assert result["weight_loads"] == 1 and result["inflight_updates"] == 1
    spanning = [s for s in samples if s.version_min == 0 and s.version_max == 1]
    assert spanning, "no sample lived through the in-flight update"
    for s in spanning:
        spans = s.version_spans
        assert spans[0].tolist() == [0, 0] and spans[-1, 1] == 1 and 0 < spans[1, 0] < s.num_tokens
        versions = s.token_versions()
        assert versions[0] == 0 and versions[-1] == 1 and (versions[1:] >= versions[:-1]).all()
    # groups admitted after the swap were generated entirely by the new weights
    tickets = sorted(g.ticket for g in groups)
    assert len(set(tickets)) == len(tickets)
    assert any(s.version_min == 1 for s in samples)
    assert {g.timings["inflight_updates"] for g in groups} >= {0.0, 1.0}


@pytest.mark.parametrize("unit", ["group", "slot"])
def test_admission_unit_decides_how_full_the_engine_runs(random_model_dir, unit):
    """6 slots, groups of 4, tickets plentiful: admitting whole groups can only ever fill 4 slots (a second group
    needs 8), so occupancy is at most 4/6; admitting per free slot puts a second group in with 2 free slots and the
    engine queues its other 2 samples, so all 6 slots decode. The untrained model rarely says eos, so sequences
    run to the response length and the engine is never short of work."""
    cfg = load_config([
        "rollout.engine=hf", "rollout.rollout_batch_size=2", "rollout.num_return_sequences_in_group=4",
        "rollout.max_staleness=8", "rollout.max_num_seqs=6", f"rollout.admission_unit={unit}",
        "rollout.response_length=12", "cluster.timeout_s=60",
    ])
    receiver = TrajectoryReceiver("tcp://127.0.0.1:0")
    control = ControlPublisher("tcp://127.0.0.1:0")
    server = AdmissionServer(AdmissionController(2, 8), "tcp://127.0.0.1:0")
    port = find_free_port()
    ep = Endpoints(receiver.address, control.address, server.address, "127.0.0.1", port, 2, "gloo")
    worker = RolloutWorker(cfg, 0, 1, ep, random_model_dir)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    group = make_sync_group("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)  # the worker joins it
    groups = []
    try:
        control.publish(version=0, weights_version=0)
        end = time.monotonic() + 60
        while len(groups) < 8 and time.monotonic() < end:  # 18 tickets: never short of them
            g = receiver.recv(timeout_ms=100)
            if g is not None:
                groups.append(g)
    finally:
        control.publish(version=0, weights_version=0, stop=True)
        thread.join(30)
        for c in (server, control, receiver, group):
            c.close()
    assert len(groups) == 8 and not thread.is_alive()
    steps = sum(g.timings["decode_steps"] for g in groups)
    occupancy = sum(g.timings["running_seq_sum"] for g in groups) / steps / 6
    if unit == "group":
        assert occupancy <= 4 / 6 + 1e-9
    else:
        assert occupancy >= 0.9, occupancy


def test_an_empty_engine_counts_its_idle_seconds_by_what_it_waits_for(random_model_dir):
    """k = 0, B = 2: the worker generates its two groups and then holds no ticket (the window is full until the
    learner's version moves): ~1 s waiting for a ticket. Then the version moves but the weights the new tickets need
    are not pushed for ~1 s: waiting for weights. Each wait is reported by the groups sent after it.

    The window's 2 groups x 2 samples fill at most 4 of the engine's 8 slots, so every decode step leaves at least
    half of them free for want of a ticket: the unfilled seconds are between half the engine's step time and all of
    it, and none are put on the weights (the held tickets' weights were loaded when they started)."""
    from transformers import AutoModelForCausalLM

    cfg = load_config([
        "rollout.engine=hf", "rollout.rollout_batch_size=2", "rollout.num_return_sequences_in_group=2",
        "rollout.max_staleness=0", "rollout.max_num_seqs=8", "rollout.response_length=6", "cluster.timeout_s=60",
    ])
    receiver = TrajectoryReceiver("tcp://127.0.0.1:0")
    control = ControlPublisher("tcp://127.0.0.1:0")
    ctrl = AdmissionController(2, 0)
    server = AdmissionServer(ctrl, "tcp://127.0.0.1:0")
    port = find_free_port()
    ep = Endpoints(receiver.address, control.address, server.address, "127.0.0.1", port, 2, "gloo")
    worker = RolloutWorker(cfg, 0, 1, ep, random_model_dir)
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    group = make_sync_group("127.0.0.1", port, rank=0, world_size=2, timeout_s=60)
    sender = WeightSender(group)
    model = AutoModelForCausalLM.from_pretrained(random_model_dir, dtype=torch.float32)

    def collect(n: int) -> list:
        got, end = [], time.monotonic() + 60
        while len(got) < n and time.monotonic() < end:
            g = receiver.recv(timeout_ms=100)
            if g is not None:
                got.append(g)
        assert len(got) == n, f"only {len(got)} of {n} groups arrived"
        return got

    try:
        control.publish(version=0, weights_version=0)
        first = collect(2)
        time.sleep(1.0)  # the engine is empty and the window (k = 0) is full: it waits for a ticket
        ctrl.set_version(1)  # tickets 2, 3 need weights 1, which are not announced yet
        control.publish(version=1, weights_version=0)
        time.sleep(1.0)
        control.publish(version=1, weights_version=1)
        sender.push(model.state_dict(), 1)
        second = collect(2)
    finally:
        control.publish(version=1, weights_version=1, stop=True)
        thread.join(30)
        for c in (server, control, receiver, group):
            c.close()
    assert not thread.is_alive()
    waited = {why: sum(g.timings[f"idle_{why}_s"] for g in second) for why in ("ticket", "weights")}
    assert 0.7 < waited["ticket"] < 2.0 and 0.7 < waited["weights"] < 2.0, waited
    assert sum(g.timings["idle_weights_s"] for g in first) < 0.3  # its weights were there from the start
    busy = sum(g.timings["engine_busy_s"] for g in first + second)
    # the loop's own time between steps leaves out the two waits of ~1 s (an empty engine is not between steps)
    gap = sum(g.timings["engine_gap_s"] for g in first + second)
    assert 0 < gap < 0.5, gap
    unfilled = sum(g.timings["unfilled_ticket_s"] for g in first + second)
    assert busy > 0 and 0.5 * busy - 1e-9 <= unfilled <= busy + 1e-9, (unfilled, busy)
    assert sum(g.timings["unfilled_weights_s"] for g in first + second) == 0.0
    assert {s.version_min for g in second for s in g.samples} == {1}
