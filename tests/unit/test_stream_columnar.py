"""One trajectory form: a group decoded from the wire reaches the padded batch without Sample objects, the batch
equals the one built sample by sample, and per-token lag metrics read the batch's token versions."""

from __future__ import annotations

import numpy as np
import torch

from asyncppo.learner.batch import collate_groups
from asyncppo.metrics import batch_token_lag_stats, token_lag_stats
from asyncppo.staleness.buffer import StalenessBuffer
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.wire import decode_group, encode_group


def _groups(seed: int = 0) -> list[TrajectoryGroup]:
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(4):
        samples = []
        for j in range(3):
            T = int(rng.integers(0, 9)) if (g, j) != (0, 0) else 0
            v0 = int(rng.integers(0, 4))
            if T >= 3 and j == 1:  # a weight swap mid-generation: two versions
                spans = np.array([[0, v0], [T // 2, v0 + 2]], dtype=np.int64)
                v1 = v0 + 2
            else:
                spans, v1 = None, v0
            samples.append(Sample(rng.integers(0, 50, T).astype(np.int32), -rng.random(T).astype(np.float32),
                                  float(rng.normal()), "stop", v0, v1, bool(j == 2), spans))
        prompt = rng.integers(0, 50, int(rng.integers(1, 6))).astype(np.int32)
        groups.append(TrajectoryGroup(f"g{g}", 0, prompt, samples, ticket=g))
    return groups


def _reference_batch(groups, pad):
    """The batch as it was built before: row by row from Sample objects."""
    rows = [(gi, g, s) for gi, g in enumerate(groups) for s in g.samples]
    P = max(int(g.prompt_ids.shape[0]) for g in groups)
    T = max(1, max(s.num_tokens for _, _, s in rows))
    B = len(rows)
    ids = np.full((B, P + T), pad, np.int64)
    att = np.zeros((B, P + T), np.int64)
    mask = np.zeros((B, T), np.float32)
    beh = np.zeros((B, T), np.float32)
    tv = np.zeros((B, T), np.int64)
    for i, (_, g, s) in enumerate(rows):
        n_p, n_r = int(g.prompt_ids.shape[0]), s.num_tokens
        ids[i, P - n_p : P] = g.prompt_ids
        att[i, P - n_p : P + n_r] = 1
        ids[i, P : P + n_r] = s.response_ids
        beh[i, :n_r] = s.behavior_logprobs
        mask[i, :n_r] = 1
        tv[i, :n_r] = s.token_versions()
    scores = np.array([s.reward for _, _, s in rows], np.float32)
    return dict(input_ids=ids, attention_mask=att, response_mask=mask, behavior_logprobs=beh, token_versions=tv,
                scores=scores, group_index=np.array([gi for gi, _, _ in rows]),
                version_min=np.array([s.version_min for _, _, s in rows]), prompt_len=P)


def test_columnar_batch_equals_the_sample_by_sample_batch_and_builds_no_samples():
    groups = _groups()
    decoded = [decode_group(encode_group(g)) for g in groups]
    batch = collate_groups(decoded, pad_token_id=7)
    assert all(g.columns is not None for g in decoded)  # no Sample object was materialised
    want = _reference_batch(groups, 7)
    assert batch.prompt_len == want.pop("prompt_len")
    for name, arr in want.items():
        assert torch.equal(getattr(batch, name), torch.from_numpy(arr)), name
    assert torch.equal(batch.position_ids, (batch.attention_mask.cumsum(1) - 1).clamp(min=0))
    same = collate_groups(groups, pad_token_id=7)  # groups of Sample objects take the same path
    assert torch.equal(same.input_ids, batch.input_ids) and torch.equal(same.token_versions, batch.token_versions)


def test_per_token_lag_from_the_batch_matches_the_spans():
    groups = [decode_group(encode_group(g)) for g in _groups(1)]
    batch = collate_groups(groups, pad_token_id=0)
    v = 9
    stats = batch_token_lag_stats(v, batch.token_versions, batch.response_mask)
    assert stats["staleness/token_mean"] == token_lag_stats(v, groups)["staleness/token_mean"]
    versions = np.concatenate([g.as_columns().token_versions() for g in groups])
    assert stats["staleness/token_min"] == v - versions.max()
    assert stats["staleness/token_max"] == v - versions.min()
    assert batch_token_lag_stats(v, batch.token_versions.numpy(), batch.response_mask.numpy()) == stats


def test_buffer_keeps_decoded_groups_columnar():
    buf = StalenessBuffer(max_staleness=1, capacity_groups=8, response_length=8)
    for g in _groups(2):
        buf.put(decode_group(encode_group(g)))
    out = buf.take(1, learner_version=2, timeout_s=5.0)  # stale groups are dropped on the way
    stats = buf.stats()
    assert [g.group_id for g in out] == ["g0"] and stats["dropped_stale"] == 3  # version_min 1, 0, 0, 0
    assert out[0].columns is not None and stats["dropped_tokens"] > 0 and stats["lag_max"] == 1
