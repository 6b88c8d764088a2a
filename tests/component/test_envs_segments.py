"""Transition segments: built from a real gymnasium vector env, through the wire and real ZeroMQ, and through the
real admission controller and staleness buffer with per-step versions."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from asyncppo.config import load_config
from asyncppo.models.actor_critic import ActorCritic
from asyncppo.envs.segments import SegmentBuilder
from asyncppo.envs.spaces import EnvError, describe_env, make_vector_env
from asyncppo.stream.errors import WireError
from asyncppo.stream.segments import EnvSegment, decode_segment, encode_segment, segment_decoder


def _cartpole_segment(max_steps=9, N=3, T=20, versions=None):
    cfg = load_config(["env=cartpole", f"env.max_episode_steps={max_steps}", f"env.num_envs={N}",
                       f"env.segment_length={T}", "env.num_minibatches=1"])
    desc = describe_env(cfg.env)
    env = make_vector_env(cfg.env, N)
    torch.manual_seed(0)
    policy = ActorCritic(desc.policy_spec(cfg))
    b = SegmentBuilder(desc, N, T, worker_id=2)
    obs, _ = env.reset(seed=1)
    b.start(obs)
    finals = {}
    for t in range(T):
        a, lp = policy.act(b.obs)
        obs, r, term, trunc, info = env.step(a)
        for i in np.flatnonzero(trunc & ~term):
            finals[i * T + t] = np.asarray(info["final_obs"][i], np.float32)
        b.record(a, lp, r, term, trunc, obs, info, versions[t] if versions else 0)
    seg = b.finish(ticket=7, segment_id="2-0")
    env.close()
    return desc, seg, finals


def test_builder_records_truncations_with_their_final_observation():
    desc, seg, finals = _cartpole_segment(max_steps=9)
    # a 9-step limit in 20 steps truncates every env that did not fall first; CartPole terminates by falling
    assert seg.truncated.any()
    assert sorted(finals) == seg.final_index.tolist()
    for k, flat in enumerate(seg.final_index.tolist()):
        assert np.array_equal(seg.final_obs[k], finals[flat])
        n, t = divmod(flat, seg.num_steps)
        assert seg.truncated[n, t] and not seg.terminated[n, t]
        if t + 1 < seg.num_steps:  # the env was reset: the next observation is another episode's first
            assert not np.array_equal(seg.obs[n, t + 1], seg.final_obs[k])
    # every episode that ended is counted, with its length (CartPole: reward 1 per step, so return == length)
    ends = int((seg.terminated | seg.truncated).sum())
    assert seg.episode_returns.shape == (ends,)
    assert np.array_equal(seg.episode_returns, seg.episode_lengths.astype(np.float64))
    assert seg.episode_lengths.max() <= 9


def test_wire_round_trip_is_exact_and_checked_against_the_spaces():
    versions = [3] * 8 + [4] * 12
    desc, seg, _ = _cartpole_segment(versions=versions)
    frame = encode_segment(seg)
    back = decode_segment(frame, spec=desc.segment_spec)
    for name in ("obs", "actions", "logprobs", "rewards", "terminated", "truncated", "versions", "bootstrap_obs",
                 "final_index", "final_obs", "episode_returns", "episode_lengths"):
        assert np.array_equal(getattr(back, name), getattr(seg, name)), name
    assert (back.ticket, back.worker_id, back.segment_id) == (7, 2, "2-0")
    assert (back.version_min, back.version_max) == (3, 4)
    # the staleness buffer's view: one row per env, one "token" per step
    assert [tuple(r) for r in back.samples] == [(20, 3, 4)] * 3
    assert back.token_lag_sum(5) == (3 * (8 * 2 + 12 * 1), 60)
    # another environment's learner (4 actions expected) refuses it
    from asyncppo.stream.segments import SegmentSpec

    with pytest.raises(WireError, match="observation shape"):
        decode_segment(frame, spec=SegmentSpec((3,), (), "<i8", 2))
    with pytest.raises(WireError, match="actions"):
        decode_segment(frame, spec=SegmentSpec((4,), (2,), "<f4", None))


def _mutated(seg: EnvSegment, **changes) -> EnvSegment:
    fields = {k: getattr(seg, k) for k in EnvSegment.__dataclass_fields__}
    fields.update(changes)
    return EnvSegment(**fields)


def test_bad_segments_get_clear_errors():
    desc, seg, _ = _cartpole_segment()
    obs = seg.obs.copy()
    obs[1, 5, 2] = np.nan
    with pytest.raises(WireError, match="obs has a NaN or infinite value at env 1, step 5"):
        encode_segment(_mutated(seg, obs=obs))
    with pytest.raises(WireError, match="versions"):
        encode_segment(_mutated(seg, versions=np.arange(20, 0, -1, dtype=np.int64)))
    with pytest.raises(WireError, match="final_index"):
        encode_segment(_mutated(seg, final_index=seg.final_index[:-1].copy(), final_obs=seg.final_obs[:-1].copy()))
    bad_actions = seg.actions.copy()
    bad_actions[0, 0] = 5
    frame = encode_segment(_mutated(seg, actions=bad_actions))  # the sender does not know the space; the learner does
    with pytest.raises(WireError, match=r"discrete actions must be in \[0, 2\)"):
        decode_segment(frame, spec=desc.segment_spec)
    good = encode_segment(seg)
    for broken, reason in ((good[:-8], "malformed"), (b"APPO" + good[4:], "malformed"), (b"", "malformed"),
                           (good[:12] + b"\xff" * (len(good) - 12), "malformed")):
        with pytest.raises(WireError) as err:
            decode_segment(broken, spec=desc.segment_spec)
        assert err.value.reason == reason
    # a hostile frame with NaN written over the encoded observations is refused by the decoder too
    raw = bytearray(good)
    start = raw.index(seg.obs.tobytes()[:64])
    raw[start:start + 4] = np.float32(np.nan).tobytes()
    with pytest.raises(WireError, match="NaN"):
        decode_segment(bytes(raw), spec=desc.segment_spec)


def test_builder_refuses_a_nan_observation_from_the_env():
    desc, seg, _ = _cartpole_segment(T=4)
    b = SegmentBuilder(desc, 3, 4, worker_id=1)
    b.start(np.zeros((3, 4), np.float32))
    nan_obs = np.zeros((3, 4), np.float32)
    nan_obs[2, 1] = np.nan
    with pytest.raises(EnvError, match=r"NaN or infinite observation \(worker 1, vector env index \[2\]"):
        b.record(np.zeros(3, np.int64), np.zeros(3, np.float32), np.ones(3), np.zeros(3, bool), np.zeros(3, bool),
                 nan_obs, {}, 0)


def test_receiver_counts_bad_segments_and_delivers_good_ones():
    from asyncppo.stream.channels import TrajectoryReceiver, TrajectorySender

    desc, seg, _ = _cartpole_segment()
    rx = TrajectoryReceiver("tcp://127.0.0.1:0", decode=segment_decoder(desc.segment_spec))
    tx = TrajectorySender(rx.address)
    try:
        good = encode_segment(seg)
        for frame in (b"garbage", good[:-8], good):
            assert tx.send_encoded(frame, timeout_s=5)
        got = rx.recv(timeout_ms=5000)
        assert got is not None and np.array_equal(got.obs, seg.obs)
        assert rx.rejected["malformed"] == 2
    finally:
        tx.close()
        rx.close()


def test_mixed_version_segments_obey_the_staleness_bound():
    """Two simulated workers load weights *between env steps* (so segments span versions), through the real
    admission controller and ticket-ordered buffer: every trained step has lag <= k, and nothing is dropped."""
    from asyncppo.staleness import AdmissionController, StalenessBuffer

    _, template, _ = _cartpole_segment(T=6)
    rng = random.Random(0)
    for k, B in ((0, 1), (1, 2), (2, 1), (3, 2)):
        adm = AdmissionController(B, k)
        buf = StalenessBuffer(k, capacity_groups=64, on_take=lambda g: adm.consumed(g.ticket), order=adm)
        learner_v, pushed = 0, 0
        workers = [{"v": 0, "ticket": None, "steps": []} for _ in range(2)]
        worst, trained = 0, 0
        while learner_v < 30:
            w = rng.choice(workers)
            if w["ticket"] is None:
                w["ticket"] = adm.try_acquire()
                if w["ticket"] is None:
                    pass
                elif w["ticket"].min_version > w["v"]:  # must hold new enough weights first
                    assert w["ticket"].min_version <= pushed
                    w["v"] = pushed
            elif rng.random() < 0.3 and w["v"] < pushed:
                w["v"] = rng.randint(w["v"] + 1, pushed)  # weights load between two env steps
            else:
                w["steps"].append(w["v"])
                if len(w["steps"]) == template.num_steps:
                    buf.put(_mutated(template, versions=np.array(w["steps"], np.int64), ticket=w["ticket"].index))
                    w["ticket"], w["steps"] = None, []
            batch = buf.take(B, learner_v, timeout_s=0)
            if batch:
                for s in batch:
                    worst = max(worst, learner_v - int(s.versions.min()))
                    trained += 1
                learner_v += 1
                adm.set_version(learner_v)
                pushed = learner_v
        assert worst <= k, (k, worst)
        assert buf.stats()["dropped_stale"] == 0
        assert trained == 30 * B
        if k > 0:
            assert worst >= 1  # the bound is reached, not trivially met


def test_segment_door_claims_tickets_once_and_frees_the_workers_allowance():
    """With one ticket allowed per worker connection, the second ticket is granted only after the first segment
    was claimed at the learner's door; a duplicate, a segment from the wrong worker, or one older than its ticket
    allows are refused and counted."""
    from asyncppo.stream.validate import SegmentDoor
    from asyncppo.staleness import AdmissionClient, AdmissionController, AdmissionServer

    _, seg, _ = _cartpole_segment(T=4)
    controller = AdmissionController(batch_groups=1, max_staleness=2)
    server = AdmissionServer(controller, "tcp://127.0.0.1:0", max_tickets_per_peer=1)
    client = AdmissionClient(server.address, worker_id=2)
    door = SegmentDoor(server, lambda: 0)
    try:
        first = client.acquire(timeout_s=5)
        assert first is not None and first.index == 0
        assert client.acquire(timeout_s=0.5) is None  # the connection holds its one ticket: parked
        ok = _mutated(seg, ticket=0, segment_id="2-0")
        assert door.check(_mutated(seg, ticket=0, worker_id=1, segment_id="1-0")) == "worker"
        assert door.check(ok) is None
        assert door.check(ok) == "duplicate"
        assert door.check(_mutated(seg, ticket=0, versions=np.full(4, 3, np.int64), segment_id="2-x")) == "version"
        second = client.acquire(timeout_s=5)  # claimed: the allowance is free again
        assert second is not None and second.index == 1
        assert door.num_rejected == 3 and dict(door.rejected) == {"worker": 1, "duplicate": 1, "version": 1}
    finally:
        client.close()
        server.close()
