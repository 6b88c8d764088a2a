"""The engine alone at full speed: one side of the pipeline's limit (docs/benchmarks.md, "The limit").

The limit of a two-sided pipeline is its slower side working alone at full speed. For the rollout side that is the
run's own engine (rollout/engines.py: ``worker_engine``) generating the run's ``N`` groups with every one of its
``max_num_seqs`` slots decoding at every step, no learner, no tickets, no weight loads. :func:`keep_full` is that
driver: it keeps a backlog of waiting sequences, so a slot freed in one step is refilled by the engine's own
scheduler in the next (vLLM fans a group out into ``n`` requests, so the refill is per slot, not per group).
:func:`generate_alone` runs it on the run's prompts, scores each group as a worker does and returns the stream
records, which the learner alone (learner/learner_alone.py) then trains.

:func:`replay_alone` is the same engine on a finished run's own work: the policy a run learns writes other lengths
than the starting one (on ``data=long`` 5-22% longer workings at some seeds), so the limit's engine, generating the
starting policy's answers, measures less work than the run did. Replayed, every sample of the run is generated
again from its own prompt with exactly its own number of tokens (``ignore_eos``, ``max_tokens`` = its length): a
decode step's cost follows the sequences' count and context lengths, not which tokens they hold, so this is the
engine side's time on the run's own work, as ``learner_alone.trained_batches`` is the learner side's.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

from asyncppo.data.datasets import build_prompt_dataset
from asyncppo.data.position import resume_draws
from asyncppo.data.rewards import resolve_reward_fn
from asyncppo.rollout.engine import FinishedGroup, SamplingSpec, warm_up, warm_up_prompt
from asyncppo.rollout.engines import worker_engine
from asyncppo.rollout.groups import GroupBuilder, InFlight, group_spec
from asyncppo.rollout.meter import EngineMeter
from asyncppo.staleness.controller import Ticket
from asyncppo.stream.group_ids import group_key


@dataclass
class FullRun:
    """What :func:`keep_full` did. ``running_sum``: sequences decoding, summed over steps, counted as the worker
    counts them (``min(unfinished, max_num_seqs)`` before each step)."""

    max_num_seqs: int
    steps: int = 0
    running_sum: int = 0
    step_s: float = 0.0  # inside engine.step()
    wall_s: float = 0.0  # first group added -> last group finished and built
    finished: list = field(default_factory=list)  # what ``on_finished`` returned, in finishing order

    @property
    def occupancy(self) -> float:
        return self.running_sum / max(self.steps, 1) / self.max_num_seqs


def keep_full(engine, groups: Iterator[tuple[str, list, SamplingSpec]], num_groups: int,
              on_finished: Callable[[FinishedGroup], object], backlog: int | None = None) -> FullRun:
    """Generate ``num_groups`` groups of ``groups`` (key, prompt ids, spec) on ``engine``, adding groups while fewer
    than ``max_num_seqs + backlog`` sequences are unfinished (default backlog: ``max_num_seqs``, so that even a step
    that frees every slot finds enough waiting to refill them all); ``on_finished`` turns each finished group into
    the record kept."""
    run = FullRun(max_num_seqs=int(engine.max_num_seqs))
    backlog = run.max_num_seqs if backlog is None else int(backlog)
    added, t0 = 0, time.perf_counter()
    while len(run.finished) < num_groups:
        while added < num_groups and engine.num_unfinished_seqs() < run.max_num_seqs + backlog:
            key, prompt_ids, spec = next(groups)
            engine.add_group(key, prompt_ids, spec)
            added += 1
        unfinished = engine.num_unfinished_seqs()
        if unfinished == 0:
            raise RuntimeError(f"engine alone: nothing unfinished after {added} of {num_groups} groups were added "
                               f"and {len(run.finished)} finished (a group the engine never returned?)")
        t_step = time.perf_counter()
        done = engine.step()
        run.step_s += time.perf_counter() - t_step
        run.steps += 1
        run.running_sum += min(unfinished, run.max_num_seqs)
        run.finished.extend(on_finished(group) for group in done)
    run.wall_s = time.perf_counter() - t0
    return run


def generate_alone(cfg, model_path: str, num_groups: int) -> tuple[FullRun, dict]:
    """Worker 0's engine, prompts, sampling and reward, kept full for ``num_groups`` groups; each finished group is
    built into the stream record a worker would send (ticket = admission order). Returns the run (its ``finished``:
    the records) and the worker-style stats (tokens generated, reward failures)."""
    from transformers import AutoTokenizer  # heavy: transformers

    ro = cfg.rollout
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    dataset = build_prompt_dataset(cfg, model_path, split="train", tokenizer=tokenizer)
    draws = resume_draws(dataset.iterate(seed=cfg.data.seed, shuffle=cfg.data.shuffle))
    engine = worker_engine(cfg, model_path, 0)
    try:
        warm_up(engine, warm_up_prompt(tokenizer, ro.prompt_length))  # start-up, left out as the worker leaves it
        stats = {"groups_sent": 0, "samples": 0, "reward_failures": 0, "gen_tokens": 0}
        reward_fn = resolve_reward_fn(ro.reward_fn, task=cfg.data.task if not cfg.data.train_files else None)
        builder, meter = GroupBuilder(engine, reward_fn, 0, stats), EngineMeter()
        flights: dict[str, InFlight] = {}

        def next_group():
            for ticket, (seq, row) in enumerate(draws):
                key = group_key(0, 0, seq)
                flights[key] = InFlight(row=row, ticket=Ticket(ticket, 0), admitted_at=time.time(), version=0)
                yield key, row.prompt_ids, group_spec(cfg, 0, seq)

        run = keep_full(engine, next_group(), num_groups,
                        lambda done: builder.build(done, flights.pop(done.key), meter))
        return run, stats
    finally:
        engine.close()


def replay_requests(groups: list, sampling: SamplingSpec) -> list[tuple[str, list, SamplingSpec]]:
    """One engine request per sample of ``groups``, in ticket order (the order a run admitted them), each asking
    for exactly that sample's number of tokens with the run's ``sampling`` otherwise: ``(key, prompt ids, spec)``
    for :func:`keep_full`."""
    requests = []
    for g in sorted(groups, key=lambda g: g.ticket):
        prompt = [int(t) for t in g.prompt_ids]
        for j, s in enumerate(g.samples):
            length = s.num_tokens
            if length < 1:
                raise ValueError(f"engine replay: group {g.group_id!r} sample {j} has no response tokens")
            if s.env_runs is not None:  # the environment wrote part of it: no engine generates that by length
                raise ValueError(f"engine replay: group {g.group_id!r} is a multi-turn episode; only single-turn "
                                 "groups can be replayed at their lengths")
            spec = dataclasses.replace(sampling, n=1, max_tokens=length, ignore_eos=True, seed=None,
                                       stop_token_ids=())
            requests.append((f"{g.group_id}/{j}", prompt, spec))
    return requests


def replay_alone(cfg, model_path: str, groups: list) -> FullRun:
    """Worker 0's engine, kept full, generating every sample of ``groups`` (a finished run's trained groups) again
    at exactly its own length (module docstring). Each :attr:`FullRun.finished` entry is a sample's token count."""
    from transformers import AutoTokenizer  # heavy: transformers

    requests = replay_requests(groups, group_spec(cfg, 0, 0))
    tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=cfg.model.trust_remote_code)
    engine = worker_engine(cfg, model_path, 0)
    try:
        warm_up(engine, warm_up_prompt(tokenizer, cfg.rollout.prompt_length))
        return keep_full(engine, iter(requests), len(requests),
                         lambda done: sum(c.num_tokens for c in done.completions))
    finally:
        engine.close()
