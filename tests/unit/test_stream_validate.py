"""Content validation at the learner's door (stream/validate.py) and the rate-limited rejection summary."""

import logging

import numpy as np
import pytest

from asyncppo.staleness import AdmissionController
from asyncppo.stream.records import Sample, TrajectoryGroup
from asyncppo.stream.validate import CONTENT_REASONS, ContentLimits, GroupValidator, RejectionSummary
from asyncppo.stream.wire import decode_group, encode_group

LIMITS = ContentLimits(vocab_size=16, max_prompt_len=6, max_response_len=5, max_samples=2, num_workers=2,
                       logprob_tolerance=0.01)


def group(gid="0-0", worker=0, ticket=0, prompt=(1, 2, 3), ids=((4, 5), (6,)), lps=((-0.5, -0.1), (-1.0,)),
          rewards=(1.0, 0.0), version=0, timings=None):
    samples = [Sample(np.array(i, np.int32), np.array(lp, np.float32), r, "stop", version, version)
               for i, lp, r in zip(ids, lps, rewards)]
    g = TrajectoryGroup(gid, worker, np.array(prompt, np.int32), samples, ticket=ticket, timings=timings or {})
    return decode_group(encode_group(g))  # what the learner sees: a columnar group off the wire


class Ledger:
    """The admission server's ledger contract, over a real AdmissionController: ticket -> (worker, min_version)."""

    def __init__(self, ctrl):
        self.ctrl, self.grants = ctrl, {}

    def grant(self, worker):
        t = self.ctrl.try_acquire()
        self.grants[t.index] = (worker, t.min_version)
        return t

    def claim(self, index, worker_id, version_min):
        g = self.grants.get(index)
        if g is None:
            return "ticket"
        if g[0] != worker_id:
            return "worker"
        if version_min < g[1]:
            return "version"
        del self.grants[index]
        return None

    def forfeit(self, index, worker_id):
        if self.grants.get(index, (None,))[0] != worker_id:
            return False
        del self.grants[index]
        return self.ctrl.release(index)


@pytest.mark.parametrize("kwargs, reason", [
    (dict(rewards=(float("nan"), 0.0)), "nonfinite"),
    (dict(rewards=(float("inf"), 0.0)), "nonfinite"),
    (dict(lps=((-0.5, float("nan")), (-1.0,))), "nonfinite"),
    (dict(lps=((-0.5, -float("inf")), (-1.0,))), "nonfinite"),
    (dict(timings={"gen_s": float("nan")}), "nonfinite"),
    (dict(lps=((-0.5, 0.02), (-1.0,))), "logprob"),  # 0.02 > tolerance 0.01
    (dict(ids=((4, 16), (6,))), "token_id"),  # vocab is [0, 16)
    (dict(prompt=(1, -1, 3)), "token_id"),
    (dict(prompt=tuple(range(7))), "length"),  # 7 > max_prompt_len 6
    (dict(prompt=()), "length"),
    (dict(ids=((1,) * 6, (6,)), lps=((-0.1,) * 6, (-1.0,))), "length"),  # 6 > max_response_len 5
    (dict(ids=((4,), (5,), (6,)), lps=((-1.0,),) * 3, rewards=(0.0,) * 3), "length"),  # 3 samples > 2
    (dict(version=3), "version"),  # newer than the learner (version 2)
    (dict(worker=2), "worker"),  # num_workers = 2
])
def test_each_content_rule_refuses_and_counts(kwargs, reason):
    v = GroupValidator(LIMITS, lambda: 2)
    err = v.check(group(**kwargs))
    assert err is not None and err.reason == reason, err
    assert v.rejected[reason] == 1 and v.num_rejected == 1 and v.accepted == 0


def test_valid_group_passes_and_tolerance_is_inclusive():
    v = GroupValidator(LIMITS, lambda: 0)
    assert v.check(group(lps=((-0.5, 0.01), (0.0,)))) is None  # exactly the tolerance, and exactly 0
    assert v.check(group(gid="0-1", ids=((15, 0), (6,)), prompt=tuple(range(6)))) is None  # edges of every range
    assert v.accepted == 2 and v.num_rejected == 0
    assert set(v.rejected) == set(CONTENT_REASONS)


def test_tickets_are_claimed_once_by_their_holder_and_refused_groups_give_them_back():
    ctrl = AdmissionController(batch_groups=4, max_staleness=0)
    ledger = Ledger(ctrl)
    t0, t1, t2 = ledger.grant(0), ledger.grant(1), ledger.grant(0)
    v = GroupValidator(LIMITS, lambda: 0, ledger=ledger)
    assert v.check(group("0-0", worker=0, ticket=t0.index)) is None
    assert v.check(group("0-0", worker=0, ticket=t0.index)).reason == "duplicate"  # a replay
    assert v.check(group("0-9", worker=0, ticket=t0.index)).reason == "ticket"  # same ticket, new id
    assert v.check(group("0-1", worker=0, ticket=t1.index)).reason == "worker"  # worker 1's ticket
    assert v.check(group("0-2", worker=0, ticket=-1)).reason == "ticket"  # never admission-controlled
    assert v.check(group("0-3", worker=0, ticket=99)).reason == "ticket"  # never granted
    assert v.forfeited == 0 and ctrl.stats()["released"] == 0  # none of these touched anyone's ticket
    # worker 0's own ticket with a NaN reward: refused, and the ticket goes back to the pool to be regenerated
    assert v.check(group("0-4", worker=0, ticket=t2.index, rewards=(float("nan"), 0.0))).reason == "nonfinite"
    assert v.forfeited == 1 and ctrl.stats()["released"] == 1 and not ctrl.is_outstanding(t2.index)
    # worker 1's ticket is still claimable by worker 1
    assert v.check(group("1-0", worker=1, ticket=t1.index)) is None
    assert (v.accepted, v.num_rejected) == (2, 6)
    assert v.rejected == {**{r: 0 for r in CONTENT_REASONS}, "duplicate": 1, "ticket": 3, "worker": 1,
                          "nonfinite": 1}


def test_version_below_the_tickets_min_version_is_refused():
    ctrl = AdmissionController(batch_groups=1, max_staleness=0, start_version=3)
    ledger = Ledger(ctrl)
    t = ledger.grant(0)
    assert t.min_version == 3
    v = GroupValidator(LIMITS, lambda: 3, ledger=ledger)
    assert v.check(group("0-0", ticket=t.index, version=2)).reason == "version"
    assert v.forfeited == 1  # its own ticket: back to the pool


def test_limits_reject_nonsense():
    with pytest.raises(ValueError, match="vocab_size"):
        ContentLimits(vocab_size=0, max_prompt_len=1, max_response_len=1, max_samples=1)
    with pytest.raises(ValueError, match="logprob_tolerance"):
        ContentLimits(vocab_size=2, max_prompt_len=1, max_response_len=1, max_samples=1, logprob_tolerance=-1)


def test_summary_is_one_line_per_interval_with_counts_by_reason(caplog):
    now = [100.0]
    counts = {"malformed": 0, "oversized": 0}
    content = {"nonfinite": 0}
    s = RejectionSummary({"stream": lambda: counts, "content": lambda: content}, interval_s=10.0,
                         logger=logging.getLogger("test.summary"), clock=lambda: now[0])
    counts["malformed"] += 500
    content["nonfinite"] += 3
    assert s.poll() is None  # interval not over: nothing logged however many arrive
    now[0] += 10.0
    with caplog.at_level(logging.WARNING, logger="test.summary"):
        line = s.poll()
    assert line == "rejected 503 message(s) in the last 10s: content/nonfinite=3, stream/malformed=500"
    assert [r.getMessage() for r in caplog.records] == [line]
    now[0] += 10.0
    assert s.poll() is None  # nothing new: silence
    counts["oversized"] += 1
    now[0] += 30.0
    assert s.poll() == "rejected 1 message(s) in the last 40s: stream/oversized=1"
    assert s.lines == 2
