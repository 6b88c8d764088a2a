"""The engine-alone driver of the pipeline's limit (rollout/engine_alone.py) on the real vLLM CPU engine.

What makes it the limit's engine side: vLLM's own scheduler decodes ``max_num_seqs`` sequences at every step for as
long as there are that many unfinished, even when a group of ``n`` does not fit the slots left (the worker's
admission waits for room for a whole group). Read from the scheduler itself, not from the driver's bookkeeping.
"""

from __future__ import annotations

from vllm_required import require_vllm

from asyncppo.rollout.engine import SamplingSpec
from asyncppo.rollout.engine_alone import keep_full

N_SAMPLES, NUM_GROUPS = 5, 120  # 5 does not divide the 256 slots: whole-group admission would leave one idle


def test_keep_full_decodes_every_slot_at_every_step_until_the_prompts_run_out(vllm_engine, prompts, monkeypatch):
    require_vllm()
    engine = vllm_engine
    scheduler = engine.llm.llm_engine.engine_core.engine_core.scheduler  # in-process engine core
    scheduled, unfinished = [], []
    schedule, step = scheduler.schedule, engine.step

    def counting_schedule(*a, **kw):
        out = schedule(*a, **kw)
        scheduled.append(len(out.num_scheduled_tokens))  # requests (sequences) run in this step
        return out

    def counting_step():
        unfinished.append(engine.num_unfinished_seqs())
        return step()

    monkeypatch.setattr(scheduler, "schedule", counting_schedule)
    monkeypatch.setattr(engine, "step", counting_step)

    def groups():  # lengths 3..8 tokens exactly, so sequences finish at staggered steps
        for i in range(NUM_GROUPS):
            yield (f"alone-{i}", prompts[i % len(prompts)],
                   SamplingSpec(n=N_SAMPLES, max_tokens=3 + i % 6, temperature=1.0, seed=i, ignore_eos=True))

    run = keep_full(engine, groups(), NUM_GROUPS, on_finished=lambda done: done)
    slots = engine.max_num_seqs
    assert sorted(g.key for g in run.finished) == sorted(f"alone-{i}" for i in range(NUM_GROUPS))
    assert all(len(g.completions) == N_SAMPLES and all(c.num_tokens == 3 + int(g.key.split("-")[1]) % 6
                                                       for c in g.completions) for g in run.finished)
    assert len(scheduled) == len(unfinished) == run.steps and engine.num_unfinished_seqs() == 0
    full = [s for s, u in zip(scheduled, unfinished) if u >= slots]
    # 600 sequences of 5.5 tokens on average over 256 slots: about 12 full steps before the tail
    assert len(full) >= 8, (scheduled, unfinished)
    assert full == [slots] * len(full), (scheduled, unfinished)
    assert run.occupancy == sum(min(u, slots) for u in unfinished) / run.steps / slots
    assert run.occupancy >= len(full) / run.steps and run.wall_s >= run.step_s > 0  # the tail is all it loses


def _group(ticket: int, prompt, lengths: list[int]):
    import numpy as np

    from asyncppo.stream.records import Sample, TrajectoryGroup

    samples = [Sample(response_ids=np.full(n, 7, dtype=np.int32), behavior_logprobs=np.zeros(n, dtype=np.float32),
                      reward=0.0, finish_reason="stop", version_min=0, version_max=0) for n in lengths]
    return TrajectoryGroup(f"0-{ticket}", 0, np.asarray(prompt, dtype=np.int32), samples, ticket=ticket)


def test_a_replay_generates_every_sample_again_at_exactly_its_own_length_in_ticket_order(vllm_engine, prompts):
    """The engine side of the limit on a run's own work (``replay_alone``): one request per trained sample, asking
    for that sample's token count with eos ignored. Read back from what vLLM generated, not from the requests."""
    require_vllm()
    from asyncppo.rollout.engine_alone import replay_requests

    # tickets out of order, lengths spread (1 token up to 60) and distinct within a group
    tickets = [5, 0, 3, 1, 4, 2]
    groups = [_group(t, prompts[t % len(prompts)], [1 + (7 * t + 11 * j) % 60 for j in range(4)]) for t in tickets]
    run_spec = SamplingSpec(n=4, max_tokens=64, temperature=1.0, top_p=0.9, seed=123, stop_token_ids=(2,))
    requests = replay_requests(groups, run_spec)

    by_ticket = sorted(groups, key=lambda g: g.ticket)
    assert [key for key, _, _ in requests] == [f"{g.group_id}/{j}" for g in by_ticket for j in range(4)]
    assert all(spec.n == 1 and spec.ignore_eos and spec.top_p == 0.9 and spec.seed is None
               and spec.stop_token_ids == () for _, _, spec in requests)
    expected = {f"{g.group_id}/{j}": s.num_tokens for g in groups for j, s in enumerate(g.samples)}
    run = keep_full(vllm_engine, iter(requests), len(requests),
                    on_finished=lambda done: (done.key, sum(c.num_tokens for c in done.completions)))
    assert dict(run.finished) == expected and len(run.finished) == 24
    assert sum(n for _, n in run.finished) == sum(expected.values())
