"""Multi-turn episodes on the wire and at the door: the environment-segment run-lengths and turn rewards round-trip
exactly, single-turn frames are unchanged, and every broken mask is refused by reason (decoder: ``schema`` /
``malformed``; door: ``turns`` / ``nonfinite``)."""

import struct

import msgpack
import numpy as np
import pytest

from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.turns import model_token_mask, turn_reward_positions
from asyncppo.stream.validate import ContentLimits, GroupValidator
from asyncppo.stream.wire import WireError, decode_group, encode_group

LIMITS = ContentLimits(vocab_size=64, max_prompt_len=16, max_response_len=32, max_samples=4)

# prompt | model a (3) | env (2) | model b (2) | env (3) | model c (2): tokens 0-2 model, 3-4 env, 5-6 model,
# 7-9 env, 10-11 model
RUNS = np.array([[3, 2], [7, 3]], dtype=np.int64)
MODEL_POS = [0, 1, 2, 5, 6, 10, 11]
ENV_POS = [3, 4, 7, 8, 9]


def episode(**over) -> Sample:
    """A hand-built 3-turn episode; weights moved from version 4 to 5 while the first environment reply was
    written, so turn 2 and 3 carry version 5 (the environment tokens keep the version of the model token before)."""
    lps = np.zeros(12, np.float32)
    lps[MODEL_POS] = -np.arange(1, 8, dtype=np.float32) / 4
    fields = dict(response_ids=np.arange(20, 32, dtype=np.int32), behavior_logprobs=lps, reward=1.5,
                  finish_reason="stop", version_min=4, version_max=5,
                  version_spans=np.array([[0, 4], [5, 5]], dtype=np.int64), env_runs=RUNS.copy(),
                  turn_rewards=np.array([0.0, 0.5, 1.0]))
    fields.update(over)
    return Sample(**fields)


def single(T=4, version=5) -> Sample:
    return Sample(np.arange(1, T + 1, dtype=np.int32), -np.ones(T, np.float32), 0.0, "length", version, version)


def group(samples, gid="0-0") -> TrajectoryGroup:
    return TrajectoryGroup(gid, 0, np.array([1, 2, 3], np.int32), samples, ticket=-1, timings={"gen_s": 0.1})


def test_a_three_turn_episode_round_trips_exactly_and_single_turn_frames_are_unchanged():
    plain = group([single(), single(3)])
    plain_frame = encode_group(plain)
    g = group([episode(), single()])
    frame = encode_group(g)
    # a single-turn frame has the 13-field header and ends right after the version spans
    hlen = struct.unpack_from("<I", plain_frame, 4)[0]
    assert len(msgpack.unpackb(plain_frame[8:8 + hlen])) == 13
    assert decode_group(plain_frame).columns.turns is None
    assert encode_group(decode_group(plain_frame)) == plain_frame
    hlen = struct.unpack_from("<I", frame, 4)[0]
    assert msgpack.unpackb(frame[8:8 + hlen])[-1] == 1
    # the cost: a table of 8 bytes per sample, 16 per segment, 8 per turn reward (the header's extra msgpack byte
    # falls into its alignment padding here)
    assert len(frame) - len(encode_group(group([episode(env_runs=None, turn_rewards=None), single()]))) \
        == 8 * 2 + 16 * 2 + 8 * 3
    d = decode_group(frame)
    turns = d.columns.turns
    assert turns.run_offsets == [0, 2, 2] and turns.reward_offsets == [0, 3, 3]
    np.testing.assert_array_equal(turns.env_runs, RUNS)
    mask = model_token_mask(turns, d.columns.offsets)
    assert np.flatnonzero(~mask).tolist() == ENV_POS and mask[12:].all()
    assert turn_reward_positions(turns, d.columns.offsets).tolist() == [2, 6, 11]
    s0, s1 = d.samples
    np.testing.assert_array_equal(s0.env_runs, RUNS)
    np.testing.assert_array_equal(s0.turn_rewards, [0.0, 0.5, 1.0])
    assert s1.env_runs is None and s1.turn_rewards is None
    # per-token versions survive: the environment tokens carry the version of the model token before them
    assert s0.token_versions().tolist() == [4] * 5 + [5] * 7
    assert encode_group(d) == frame  # re-encoding the decoded (materialised) group gives the same bytes
    assert GroupValidator(LIMITS, lambda: 5).check(d) is None


def test_a_response_may_open_with_an_environment_segment_and_needs_a_model_token():
    """An agent's branch: the rewritten conversation opens the response (tokens 0-2, the version the engine held,
    4), then model turns at versions 4 and 5. The opening ends no model turn (two turns, two rewards, on the last
    token of each), the sample's first span may start on it, and the door accepts it; a later span starting on an
    environment token, and a sample that is all environment tokens, are refused."""
    from asyncppo.stream.turns import TurnColumns, check_turns

    lps = np.array([0, 0, 0, -0.5, -0.25, 0, 0, -1.0, -0.75], np.float32)
    opened = Sample(np.arange(20, 29, dtype=np.int32), lps, 1.5, "stop", 4, 5,
                    version_spans=np.array([[0, 4], [7, 5]], dtype=np.int64),
                    env_runs=np.array([[0, 3], [5, 2]], dtype=np.int64), turn_rewards=np.array([0.5, 1.0]))
    d = decode_group(encode_group(group([opened, single()])))
    turns = d.columns.turns
    assert np.flatnonzero(~model_token_mask(turns, d.columns.offsets)).tolist() == [0, 1, 2, 5, 6]
    assert turn_reward_positions(turns, d.columns.offsets).tolist() == [4, 8]
    assert d.samples[0].token_versions().tolist() == [4] * 7 + [5] * 2
    assert GroupValidator(LIMITS, lambda: 5).check(d) is None
    inside = Sample(**{**vars(opened), "version_spans": np.array([[0, 4], [5, 5]], dtype=np.int64)})
    problem = GroupValidator(LIMITS, lambda: 5).check(group([inside]))
    assert problem is not None and "version span starts on an environment token" in str(problem)
    all_env = TurnColumns(np.array([[0, 4]], np.int64), [0, 1], np.zeros(0), [0, 0])
    assert "has no model token" in check_turns(all_env, [4])
    assert check_turns(TurnColumns(np.array([[0, 3]], np.int64), [0, 1], np.zeros(0), [0, 0]), [4]) is None


def test_the_header_field_is_only_there_when_a_sample_has_turn_data():
    only_rewards = group([episode(env_runs=None, turn_rewards=np.array([1.5]))])
    d = decode_group(encode_group(only_rewards))
    assert d.columns.turns is not None and d.columns.turns.env_runs.shape == (0, 2)
    assert GroupValidator(LIMITS, lambda: 5).check(d) is None


def _frame_with_runs(runs, rewards=(0.0, 0.5, 1.0)) -> bytes:
    """Encode a valid episode, then overwrite its segment rows and rewards in place (same frame length)."""
    frame = bytearray(encode_group(group([episode()])))
    tail = 16 * 2 + 8 * 3
    struct.pack_into("<4q3d", frame, len(frame) - tail, *np.asarray(runs).ravel().tolist(), *rewards)
    return bytes(frame)


@pytest.mark.parametrize("runs, words", [
    ([[0, 2], [7, 3]], "3 turn rewards for 2 model turns"),  # an opening segment ends no model turn
    ([[3, 0], [7, 3]], "length 0"),
    ([[3, 2], [10, 3]], "past the response"),
    ([[3, 2], [5, 3]], "overlaps or touches"),
    ([[3, 5], [7, 3]], "overlaps or touches"),
    ([[3, 2], [7, 5]], "2 model turns"),  # ends at the end: two model turns, three rewards
    ([[-1, 2], [7, 3]], "before the first response token"),
])
def test_the_decoder_refuses_broken_segments_by_name(runs, words):
    with pytest.raises(WireError) as e:
        decode_group(_frame_with_runs(runs))
    assert e.value.reason == "schema" and words in str(e.value)


def test_the_decoder_refuses_a_bad_turns_field_and_a_short_region():
    frame = encode_group(group([episode()]))
    hlen = struct.unpack_from("<I", frame, 4)[0]
    header = msgpack.unpackb(frame[8:8 + hlen])
    for bad in (2, True, "1"):
        h2 = msgpack.packb(header[:-1] + [bad])
        forged = frame[:4] + struct.pack("<I", len(h2)) + h2 + frame[8 + hlen:]
        with pytest.raises(WireError) as e:
            decode_group(forged)
        assert e.value.reason in ("schema", "malformed")
    for cut in (1, 8, 24):
        with pytest.raises(WireError) as e:
            decode_group(frame[:-cut])
        assert e.value.reason == "malformed"
    # a single-turn frame that claims turns has no region at all
    plain = encode_group(group([single()]))
    hlen = struct.unpack_from("<I", plain, 4)[0]
    h2 = msgpack.packb(msgpack.unpackb(plain[8:8 + hlen]) + [1])
    forged = plain[:4] + struct.pack("<I", len(h2)) + h2 + plain[8 + hlen:]
    with pytest.raises(WireError):
        decode_group(forged)


def test_the_sender_names_a_broken_episode():
    with pytest.raises(WireError, match="touches"):
        encode_group(group([episode(env_runs=np.array([[3, 2], [5, 1]]))]))
    with pytest.raises(WireError, match="env_runs must be an integer"):
        encode_group(group([episode(env_runs=np.array([[3.0, 2.0]]))]))


def _door_reason(sample, version=5):
    door = GroupValidator(LIMITS, lambda: version)
    err = door.check(group([sample]))
    assert door.num_rejected == (err is not None)
    return None if err is None else (err.reason, str(err))


def test_the_door_refuses_hostile_masks_by_reason():
    assert _door_reason(episode()) is None
    lps = episode().behavior_logprobs.copy()
    lps[8] = -0.25  # an environment token with a log-prob: it would enter the ratio as if sampled
    assert _door_reason(episode(behavior_logprobs=lps))[0] == "turns"
    # a version span starting on an environment token (the reply would carry a version it was not written under)
    reason, text = _door_reason(episode(version_spans=np.array([[0, 4], [4, 5]])))
    assert reason == "turns" and "environment token" in text
    reason, text = _door_reason(episode(reward=1.0))  # the reward is not the sum of the turn rewards
    assert reason == "turns" and "sum of its turn rewards" in text
    assert _door_reason(episode(turn_rewards=np.array([0.0, np.nan, 1.0])))[0] == "nonfinite"
    assert _door_reason(episode(turn_rewards=np.array([1.5])))[0] == "turns"  # 1 reward for 3 turns
    assert _door_reason(episode(env_runs=np.array([[0, 2]]), turn_rewards=None))[0] == "turns"
    assert _door_reason(episode(env_runs=np.array([[3, 10]]), turn_rewards=None))[0] == "turns"
