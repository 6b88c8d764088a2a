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
