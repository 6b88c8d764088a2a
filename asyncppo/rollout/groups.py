"""Turning a finished engine group into the stream record: score every sample, stamp its versions, attach timings.

Why the engine meter rides on the groups: the learner computes throughput, busy fractions, engine occupancy and
push latency from what the groups it trains say about the engine. Each group carries what the engine did since the
previous group was sent (busy seconds, decode steps, running sequences summed over those steps, in-flight weight
loads, push latencies), so summing over any set of groups gives exact totals and nothing is counted twice.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from asyncppo.data.rewards import score_safely
from asyncppo.rollout.engine import FinishedGroup, SamplingSpec
from asyncppo.stream.records import Sample, TrajectoryGroup, spans_from_token_versions
from asyncppo.stream.routing import RoutingColumn

log = logging.getLogger("asyncppo.rollout")

#: The reference answer travels with a group for the record only (the reward was computed here; the learner never
#: reads it), so a long one (a code task's tests) is cut: whole, it could pass the wire's header limit
#: (stream/framing.py MAX_HEADER_BYTES), and the learner would refuse the group unread and wait for its ticket.
ANSWER_CHARS = 4096


@dataclass
class InFlight:
    """A group the worker admitted and the engine is generating."""

    row: Any  # the dataset row: prompt_ids, answer, index
    ticket: Any  # the admission ticket
    admitted_at: float  # unix time
    version: int  # the engine's weight version when admitted


def group_spec(cfg, worker_id: int, seq: int) -> SamplingSpec:
    """What worker ``worker_id`` asks of its engine for draw ``seq``: ``n`` samples, seeds distinct for every sample
    of the run and every worker (vLLM seeds sample j with seed + j), so a draw sampled again samples alike."""
    ro, s = cfg.rollout, cfg.rollout.sampling
    n = ro.num_return_sequences_in_group
    seed = None if s.seed is None else s.seed + 1_000_003 * worker_id + seq * n
    return SamplingSpec(n=n, max_tokens=ro.response_length, temperature=s.temperature, top_p=s.top_p,
                        top_k=s.top_k, seed=seed)


class GroupBuilder:
    def __init__(self, engine, reward_fn, worker_id: int, stats: dict):
        self.engine = engine
        self.reward_fn = reward_fn
        self.worker_id = worker_id
        self.stats = stats
        self._score = score_safely

    def _report_failure(self, err) -> None:
        """Say so when the reward function fails: the first time with its error, then at 10, 100, 1000, ...
        failures (the sample scores 0.0 and is counted in ``reward/failed_frac``; the run goes on)."""
        count = self.stats["reward_failures"] + 1
        if count == 1 or (count >= 10 and str(count).rstrip("0") == "1"):
            log.warning("worker %d: the reward function failed %d time(s) so far (the samples score 0.0); "
                        "last error: %s", self.worker_id, count, err)

    def _reward(self, c, flight: InFlight) -> tuple[float, bool, Any]:
        """(reward, failed, error) of one completion: the reward function over its decoded text."""
        return self._score(self.reward_fn, self.engine.decode(c.token_ids), flight.row.answer)

    def _turn_fields(self, c) -> dict:
        """Extra :class:`Sample` fields of a completion (multi-turn episodes: envs/episode_groups.py)."""
        return {}

    def build(self, done: FinishedGroup, flight: InFlight, meter) -> TrajectoryGroup:
        t0 = time.perf_counter()
        samples = []
        for c in done.completions:
            reward, failed, err = self._reward(c, flight)
            if failed:
                self._report_failure(err)
            versions = c.versions if c.versions is not None else np.full(len(c.token_ids), flight.version)
            spans = spans_from_token_versions(np.asarray(versions, dtype=np.int64), default_version=flight.version)
            self.stats["reward_failures"] += int(failed)
            self.stats["gen_tokens"] += len(c.token_ids)
            samples.append(
                Sample(
                    response_ids=np.asarray(c.token_ids, dtype=np.int32),
                    behavior_logprobs=np.asarray(c.logprobs, dtype=np.float32),
                    reward=float(reward),
                    finish_reason=c.finish_reason,
                    version_min=int(spans[0, 1]),
                    version_max=int(spans[-1, 1]),
                    reward_failed=bool(failed),
                    version_spans=spans,
                    **self._turn_fields(c),
                )
            )
        self.stats["samples"] += len(samples)
        reward_s = time.perf_counter() - t0
        engine = meter.take()
        timings = {
            **engine,
            "gen_s": engine["engine_busy_s"],
            "reward_s": reward_s,
            "busy_s": engine["engine_busy_s"] + reward_s,
            "created_at": time.time(),
            "latency_s": time.time() - flight.admitted_at,  # admission -> sent
        }
        return TrajectoryGroup(
            group_id=done.key,
            worker_id=self.worker_id,
            prompt_ids=np.asarray(flight.row.prompt_ids, dtype=np.int32),
            samples=samples,
            prompt_index=int(flight.row.index),
            ticket=int(flight.ticket.index),
            answer=str(flight.row.answer)[:ANSWER_CHARS],
            timings=timings,
            routing=self._routing(done),
        )

    def _routing(self, done: FinishedGroup):
        """The engine's expert choices for every position of the group (MoE engines built to capture them)."""
        experts = getattr(self.engine, "num_experts", 0)
        records = [c.routed_experts for c in done.completions]
        if not experts or any(r is None for r in records):
            return None
        return RoutingColumn.from_samples(records, experts)
