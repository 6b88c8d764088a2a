"""The learner loop's own decisions, without sockets or models: when weights are pushed and announced, what a resume
and an env run push before training, the admission version after every step, and the error that names late workers."""

from types import SimpleNamespace

import pytest

from asyncppo.learner.loop import LearnerLoop


class _Record:
    def __init__(self, version):
        self.version_min, self.ticket = version, 0

    def token_lag_sum(self, learner_version):
        return learner_version - self.version_min, 1

    def sample_version_mins(self):
        return [self.version_min]


class _Buffer:
    def __init__(self, deliver=True):
        self.deliver = deliver

    def take(self, n, version, timeout_s):
        return [_Record(version) for _ in range(n)] if self.deliver else []

    def stats(self):
        return {}

    def missing(self, n):
        return list(range(n))


class _Recorder:
    """Every call to the wiring and the workload, in order."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *a, **kw: self.calls.append((name, a, kw))


class _Workload:
    streamed, record_kind = False, "trajectory"

    def __init__(self, pushes_initial_weights=False):
        self.pushes_initial_weights = pushes_initial_weights
        self.pushed = []

    def start_step(self):
        pass

    def keep(self, records):
        return records

    def update(self, records, version):
        return {}, None

    def push(self, version):
        self.pushed.append(version)

    def step_metrics(self, *args):
        return {}

    def late_error(self, buffer, n, got, version):
        return TimeoutError(f"late at version {version} ({got}/{n})")


def _loop(workload, sync_every=2, total_steps=5, timeout_s=60.0, max_staleness=1, coalesce_pushes=False,
          admission_lookahead=None, sync_auto=False):
    cfg = SimpleNamespace(rollout=SimpleNamespace(rollout_batch_size=2, sync_every=sync_every,
                                                  max_staleness=max_staleness, coalesce_pushes=coalesce_pushes,
                                                  admission_lookahead=admission_lookahead, sync_auto=sync_auto),
                          trainer=SimpleNamespace(total_steps=total_steps), cluster=SimpleNamespace(timeout_s=timeout_s, hang_timeout_s=None,
                                                                   push_timeout_s=None))
    loop = LearnerLoop(cfg, workload, num_workers=1, output_dir="")
    wiring = SimpleNamespace(control=_Recorder(), admission=_Recorder(), admission_server=_Recorder(),
                             fanout=SimpleNamespace(wait=lambda: None, retire_late=lambda deadline_s: [],
                                                    retire_overdue=lambda deadline_s: [],
                                                    behind=lambda: False))
    return loop, wiring


def test_weights_are_pushed_every_sync_every_versions_but_not_after_the_last_step():
    work = _Workload()
    loop, wiring = _loop(work, sync_every=2, total_steps=5)
    for step in range(1, 6):
        loop._train_step(step, wiring, _Buffer())
    assert work.pushed == [2, 4]
    assert [a[0] for name, a, kw in wiring.admission.calls if name == "set_version"] == [1, 2, 3, 4, 5]
    announced = [kw["weights_version"] for name, a, kw in wiring.control.calls if name == "publish"]
    assert announced == [0, 2, 2, 2, 4, 4, 4]  # each push is announced before it, then every step's version
    assert [name for name, a, kw in wiring.admission_server.calls] == ["stop"]  # no generation after the last step


def test_a_resume_pushes_the_checkpoint_and_an_env_run_pushes_version_zero_before_training():
    resumed = _Workload()
    loop, wiring = _loop(resumed)
    loop._announce_start(wiring, 3)
    assert resumed.pushed == [3] and loop.pushed_version == 3
    fresh = _Workload()
    loop, wiring = _loop(fresh)
    loop._announce_start(wiring, 0)
    assert fresh.pushed == [] and wiring.control.calls == [("publish", (), {"version": 0, "weights_version": 0})]
    env = _Workload(pushes_initial_weights=True)
    loop, wiring = _loop(env)
    loop._announce_start(wiring, 0)
    assert env.pushed == [0]


def test_no_records_within_the_timeout_raises_the_workloads_error():
    loop, wiring = _loop(_Workload(), timeout_s=0.0)
    with pytest.raises(TimeoutError, match="late at version 0"):
        loop._take(_Buffer(deliver=False), 2)


def test_a_batch_stalled_partly_in_still_raises_at_the_timeout():
    """One record of two arrives, then nothing: the deadline counts from that record, not from every pass (it was
    pushed on at every pass once the batch was partly in, and a stalled batch waited forever)."""
    import threading
    import time

    class _OnceBuffer(_Buffer):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def take(self, n, version, timeout_s):
            self.calls += 1
            time.sleep(0.01)
            return [_Record(version)] if self.calls == 1 else []

    loop, wiring = _loop(_Workload(), timeout_s=0.3)
    raised = []

    def take():
        try:
            loop._take(_OnceBuffer(), 2)
        except TimeoutError as e:
            raised.append(e)

    th = threading.Thread(target=take, daemon=True)
    th.start()
    th.join(5.0)
    assert not th.is_alive() and raised and "late at version 0" in str(raised[0])


def test_skipped_groups_arriving_count_as_progress():
    """Dynamic sampling skips 20 groups in a row, one every 20 ms, for 0.4 s against a 0.15 s timeout: groups do
    arrive, so the learner waits on (only a stream that brings nothing is late)."""
    import time

    class _Skipping(_Workload):
        kept_after = 20

        def keep(self, records):
            self.kept_after -= len(records)
            return records if self.kept_after < 0 else []

    class _Trickle(_Buffer):
        def take(self, n, version, timeout_s):
            time.sleep(0.02)
            return [_Record(version)]

    loop, wiring = _loop(_Skipping(), timeout_s=0.15)
    assert len(loop._take(_Trickle(), 2)) == 2


class _SlowFanout:
    """Pushes that the engines take ``durations[i]`` learner steps to load (0: done before the next step)."""

    def __init__(self, durations):
        self.durations, self.done_at, self.step = list(durations), [], 0

    def start(self):
        self.done_at.append(self.step + self.durations[len(self.done_at) % len(self.durations)])

    def pushing(self):
        return any(t > self.step for t in self.done_at)

    def retire_late(self, deadline_s):  # the learner waits until every queued push is taken
        self.step = max([self.step, *self.done_at])
        return []

    def retire_overdue(self, deadline_s):  # no push is ever overdue here
        return []

    def behind(self):
        return False


def _coalescing_loop(steps, k, durations, lookahead=None):
    """A loop with ``coalesce_pushes`` whose pushes take ``durations`` steps to load (see :class:`_SlowFanout`)."""
    work, fanout = _Workload(), _SlowFanout(durations)
    loop, wiring = _loop(work, sync_every=1, total_steps=steps, max_staleness=k, coalesce_pushes=True,
                         admission_lookahead=lookahead)
    wiring.fanout = fanout
    pushes = work.push
    work.push = lambda version: (fanout.start(), pushes(version))
    return work, fanout, loop, wiring


class _ServableOnly(_Buffer):
    """A buffer that checks, at every take at version v, that weights >= v - ``bound`` were pushed."""

    def __init__(self, loop, bound):
        super().__init__()
        self.loop, self.bound = loop, bound

    def take(self, n, version, timeout_s):
        assert self.loop.pushed_version >= version - self.bound, (version, self.loop.pushed_version, self.bound)
        return super().take(n, version, timeout_s)


@pytest.mark.parametrize("seed", range(40))
def test_coalesced_pushes_always_leave_the_next_batch_servable_and_go_out_in_order(seed):
    """Whatever the load times: at every take at version v, weights >= v - k were pushed (so every ticket of the
    batch can be generated: no wait on weights the learner holds back); pushes go out in increasing order; k = 0
    never skips; a skipped push goes out at the first step its predecessor is done."""
    import random

    rng = random.Random(seed)
    k, steps = rng.choice([0, 1, 2, 4]), 30
    work, fanout, loop, wiring = _coalescing_loop(steps, k, [rng.choice([0, 0, 1, 2, 5]) for _ in range(7)])
    for step in range(1, steps + 1):
        fanout.step = step
        free = not fanout.pushing()
        owed = loop._push_owed
        loop._train_step(step, wiring, _ServableOnly(loop, k))
        if owed and free and step < steps:
            assert work.pushed[-1] == loop.version  # the owed push went out as soon as the previous was done
    assert work.pushed == sorted(set(work.pushed)) and len(work.pushed) + loop.pushes_coalesced == steps - 1
    if k == 0:
        assert loop.pushes_coalesced == 0 and work.pushed == list(range(1, steps))


def test_coalescing_skips_while_a_push_is_in_flight_and_the_bound_allows():
    work = _Workload()
    fanout = _SlowFanout([10])  # the first push takes 10 steps to load
    loop, wiring = _loop(work, sync_every=1, total_steps=8, max_staleness=2, coalesce_pushes=True)
    wiring.fanout = fanout
    pushes = work.push
    work.push = lambda version: (fanout.start(), pushes(version))
    for step in range(1, 9):
        fanout.step = step
        loop._train_step(step, wiring, _Buffer())
    # v1 pushed; v2, v3 skipped (pushed 1 >= v - 2); v4 must go out (1 < 4 - 2): the learner waits for v1, pushes v4
    assert work.pushed[:2] == [1, 4] and loop.pushes_coalesced >= 2


@pytest.mark.parametrize("seed", range(10))
def test_coalescing_under_a_lookahead_keeps_the_lookaheads_tickets_servable(seed):
    """With ``admission_lookahead = j < k`` the next batch's tickets need weights ``>= v - j``, not ``v - k``: a skip
    that only honoured ``k`` would leave those tickets waiting for weights the learner holds back."""
    import random

    rng = random.Random(seed)
    k, steps = 4, 20
    j = rng.choice([0, 1, 2])
    work, fanout, loop, wiring = _coalescing_loop(steps, k, [rng.choice([0, 1, 2, 5]) for _ in range(5)], j)
    for step in range(1, steps + 1):
        fanout.step = step
        loop._train_step(step, wiring, _ServableOnly(loop, j))
    assert work.pushed == sorted(set(work.pushed))
    if j == 0:
        assert loop.pushes_coalesced == 0


class _Timed(_Workload):
    """Steps of ``step_s`` seconds, and engine loads of ``load_s`` reported in every step's record (as the workers'
    ``sync/push_s``), each drawn per step from the given choices."""

    def __init__(self, rng, step_s, load_s):
        super().__init__()
        self.rng, self.step_s, self.load_s = rng, step_s, load_s

    def step_metrics(self, *args):
        return {"time/step_s": self.rng.choice(self.step_s), "sync/push_s": self.rng.choice(self.load_s)}


def test_an_auto_cadence_pushes_every_third_step_where_loads_take_a_third_of_a_step():
    """Loads of 0.03 s against steps of 0.1 s: a push every step would keep the engines loading 30% of the time, so
    the cadence is ceil(0.03 / (0.1 x 0.1)) = 3 once the first step's load is measured (the first push goes out at
    step 1, nothing measured yet); the lookahead k = j = 4 allows it."""
    import random

    work = _Timed(random.Random(0), [0.1], [0.03])
    loop, wiring = _loop(work, sync_every=1, total_steps=12, max_staleness=4, sync_auto=True)
    every = [loop._train_step(step, wiring, _Buffer())["sync/every"] for step in range(1, 13)]
    assert every == [1] + [3] * 11
    assert work.pushed == [1, 4, 7, 10]  # none after the last step (no evaluation on the engines)
    assert loop._cadence.range == [1, 3]


@pytest.mark.parametrize("seed", range(30))
def test_an_auto_cadence_never_holds_back_weights_the_next_batch_needs(seed):
    """Random step and load times, random lookahead j <= k: at every take at version v the pushed weights are
    >= v - j (every ticket of the batch can be generated), pushes go out in order, and the cadence stays within
    [1, max(1, j)]; with j = 0 every step pushes."""
    import random

    rng = random.Random(seed)
    k = rng.choice([0, 1, 2, 4, 8])
    j = rng.randint(0, k)
    work = _Timed(rng, [0.01, 0.05, 0.2, 1.0], [0.0, 0.005, 0.02, 0.1, 0.5])
    loop, wiring = _loop(work, sync_every=1, total_steps=40, max_staleness=k, admission_lookahead=j,
                         sync_auto=True)
    every = [loop._train_step(step, wiring, _ServableOnly(loop, j))["sync/every"] for step in range(1, 41)]
    assert work.pushed == sorted(set(work.pushed))
    assert all(1 <= s <= max(1, j) for s in every), every
    if j == 0:
        assert work.pushed == list(range(1, 40))


def test_a_fixed_cadence_logs_no_auto_cadence():
    loop, wiring = _loop(_Workload(), sync_every=2, total_steps=3)
    assert "sync/every" not in loop._train_step(1, wiring, _Buffer()) and loop._cadence is None
