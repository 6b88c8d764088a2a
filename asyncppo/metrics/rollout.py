"""Rollout-side accounting from the groups a learner step trains: token-weighted lag, engine occupancy, in-flight
weight updates, push latency and response lengths.

The rollout workers attach to every group what their engine did since the previous group was sent
(:mod:`asyncppo.rollout.groups`), so these are exact sums over the groups of a step, not samples of a gauge.
"""

from __future__ import annotations

import random
import statistics
from typing import Iterable

from asyncppo.stream.redial import RECONNECT_KEYS


def token_lag_stats(learner_version: int, groups: Iterable) -> dict[str, float]:
    """``staleness/token_mean``: lag ``learner_version - token_version`` averaged over every response token (a
    sample that lived through a weight swap counts its newer tokens as fresher), beside the per-sample lag."""
    total, count = 0, 0
    for g in groups:
        s, c = g.token_lag_sum(learner_version)
        total += s
        count += c
    return {"staleness/token_mean": total / count if count else 0.0}


def batch_token_lag_stats(learner_version: int, token_versions, response_mask) -> dict[str, float]:
    """``staleness/token_min`` / ``token_mean`` / ``token_max``: lag ``learner_version - token_version`` over every
    response token of a batch, from its per-token versions (``TrainBatch.token_versions``, ``[B, T]``) and its
    ``response_mask``. ``token_mean`` equals :func:`token_lag_stats` of the batch's groups (the same integer sum
    and count); min and max show what the per-sample lag hides, the freshest and the stalest token trained on.

    Works on torch tensors or numpy arrays (anything with ``> 0`` and boolean indexing); sums stay integer."""
    if token_versions is None:
        return {}
    valid = response_mask > 0
    lags = learner_version - token_versions[valid]
    count = int(lags.shape[0])
    if count == 0:
        return {"staleness/token_min": 0.0, "staleness/token_mean": 0.0, "staleness/token_max": 0.0}
    return {
        "staleness/token_min": float(lags.min()),
        "staleness/token_mean": int(lags.sum()) / count,
        "staleness/token_max": float(lags.max()),
    }


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def episode_metrics(groups: list) -> dict[str, float]:
    """Multi-turn metrics of a step's groups (docs/environments.md); empty when no sample has turns.

    From the records: turns per episode (model turns: one turn reward each) and the fraction of response tokens
    the environment wrote (its runs). From the worker's counters in the groups' timings (deltas since the previous
    group, so the sums are exact): tool calls and tool errors read in the model's turns, environment seconds per
    call, episodes truncated by the token budget, groups dropped by an environment fault, environment faults (in
    all and by kind)."""
    columns = [c for c in (g.turn_columns() for g in groups) if c is not None]
    turns = [k for c in columns for k in c.reward_counts() if k]
    if not turns:
        return {}
    env_tokens = sum(int(c.env_runs[:, 1].sum()) for c in columns)
    tokens = sum(n for g in groups for n in g.sample_lengths())

    def total(key: str) -> float:
        return float(sum(g.timings.get(key, 0.0) for g in groups))

    calls = total("env_calls")
    return {
        "episodes/turns_mean": float(statistics.fmean(turns)), "episodes/turns_max": float(max(turns)),
        "episodes/env_token_frac": env_tokens / tokens if tokens else 0.0,
        "episodes/tool_calls": total("tool_calls"), "episodes/tool_errors": total("tool_errors"),
        "episodes/env_s_per_step": total("env_s") / calls if calls else 0.0,
        "episodes/truncated": total("episodes_truncated"), "episodes/dropped_groups": total("episodes_dropped"),
        "episodes/env_faults": total("env_faults"),
        # an agent's history rewrites: branches started, and the model tokens of the branches they dropped
        "episodes/branches": total("episode_branches"), "episodes/branch_tokens_dropped": total("branch_tokens_dropped"),
        # by kind (raised, timeout, malformed, nonfinite_reward: the worker names them, envs/env_runner.py)
        **{f"episodes/{key}": total(key) for key in sorted({k for g in groups for k in g.timings
                                                             if k.startswith("env_faults_")})},
        # seconds the engine sat empty while episodes waited for their environments (latency not hidden)
        "episodes/env_wait_s": total("env_wait_s"),
        # where the worker's episodes were, time-weighted means over the step's share of worker time: at their
        # environment, in the engine (decoding or queued), groups in flight, tickets granted but not yet started
        **({f"episodes/{key[:-4]}_mean": total(key) / total("spread_s")
            for key in ("at_env_sum", "in_engine_sum", "groups_sum", "tickets_waiting_sum")}
           if total("spread_s") > 0 else {}),
    }


#: The engine's waits, as the worker's timings name them (rollout/meter.py, EngineMeter): seconds an empty engine
#: waited ("idle") and a running engine's free slots in engine seconds ("unfilled", step time x free share of
#: max_num_seqs), each by what was missing: a ticket, or the weights a held ticket needs. Reported with the groups
#: sent after them.
WAIT_KEYS = tuple(f"{kind}_{why}_s" for kind in ("idle", "unfilled") for why in ("ticket", "weights"))


class EngineTotals:
    """Per-step rollout metrics plus run totals (for the summary: occupancy, push p50/p99, lengths)."""

    def __init__(self, max_num_seqs: int):
        self.max_num_seqs = max(1, int(max_num_seqs))
        self.steps = 0.0
        self.running_sum = 0.0
        self._before_last = (0.0, 0.0)  # (steps, running_sum) before the last add(): occupancy_steady
        self.busy_s = 0.0  # inside the engines' step calls
        self.gap_s = 0.0  # the workers' loops between two steps of an engine holding sequences
        self.inflight_updates = 0
        self.waits = dict.fromkeys(WAIT_KEYS, 0.0)
        self.push_s: list[float] = []
        self.weight_loads = 0  # every load of every engine (a group's timings may count several)
        self.trained_tokens = 0
        self.lengths: list[int] = []
        # A uniform sample of whole groups' response lengths (reservoir, fixed seed): the advisor replays them, since
        # a group finishes with its longest sample and lengths within a group are correlated.
        self.group_lengths: list[list[int]] = []
        self._groups_seen = 0
        self._rng = random.Random(0)

    def add(self, groups: list) -> dict[str, float]:
        steps = sum(g.timings.get("decode_steps", 0.0) for g in groups)
        running = sum(g.timings.get("running_seq_sum", 0.0) for g in groups)
        inflight = int(sum(g.timings.get("inflight_updates", 0.0) for g in groups))
        pushes = [g.timings["push_s_max"] for g in groups if g.timings.get("push_count", 0.0) > 0]
        loads = [g.timings["load_s_max"] for g in groups if g.timings.get("push_count", 0.0) > 0
                 and isinstance(g.timings.get("load_s_max"), (int, float))]
        self.weight_loads += int(sum(g.timings.get("push_count", 0.0) for g in groups))
        lengths = [n for g in groups for n in g.sample_lengths()]
        self._before_last = (self.steps, self.running_sum)
        self.steps += steps
        self.running_sum += running
        self.inflight_updates += inflight
        self.push_s += pushes
        self.trained_tokens += sum(lengths)
        self.lengths += lengths
        for g in groups:
            self._keep_group(g.sample_lengths())
        busy = sum(g.timings.get("engine_busy_s", 0.0) for g in groups)
        self.busy_s += busy
        gap = sum(g.timings.get("engine_gap_s", 0.0) for g in groups)
        self.gap_s += gap
        waits = {key: sum(g.timings.get(key, 0.0) for g in groups) for key in WAIT_KEYS}
        for key, seconds in waits.items():
            self.waits[key] += seconds
        return {
            **episode_metrics(groups),
            "rollout/occupancy": running / (steps * self.max_num_seqs) if steps else 0.0,
            # engine seconds per decode step and sequences per step: the advisor's generation-speed curve
            "rollout/decode_step_s": busy / steps if steps else 0.0,
            "rollout/running_mean": running / steps if steps else 0.0,
            # the worker's own seconds between two decode steps (admission, groups sent, control): the advisor adds
            # them to each step, since the engine does not step meanwhile
            "rollout/step_gap_s": gap / steps if steps else 0.0,
            "rollout/inflight_updates": float(inflight),
            **{f"rollout/{key}": seconds for key, seconds in waits.items()},  # WAIT_KEYS
            # sockets the workers' admission clients / control subscribers re-created (stream/redial.py)
            **{f"rollout/{key}": float(sum(g.timings.get(key, 0.0) for g in groups)) for key in RECONNECT_KEYS},
            "sync/push_s": max(pushes, default=0.0),
            # the slowest engine's load alone (received and loaded, no decoding meanwhile): learner/push_cadence.py
            "sync/load_s": max(loads, default=0.0),
            "response_length/max": float(max(lengths, default=0)),
            "response_length/p99": _percentile([float(x) for x in lengths], 0.99),
        }

    def _keep_group(self, lengths: list[int], capacity: int = 512) -> None:
        self._groups_seen += 1
        if len(self.group_lengths) < capacity:
            self.group_lengths.append(lengths)
        else:
            j = self._rng.randrange(self._groups_seen)
            if j < capacity:
                self.group_lengths[j] = lengths

    def summary(self) -> dict[str, float]:
        lengths = [float(x) for x in self.lengths]
        return {
            "occupancy": self.running_sum / (self.steps * self.max_num_seqs) if self.steps else 0.0,
            # the same without the last step's groups: the run's drain (its last stragglers decoding nearly alone,
            # since nothing past the last slot is granted) rides on them, and a short run's figure is mostly that
            # drain's (docs/staleness.md, "What to watch"); None for a run of one step (nothing before its last)
            "occupancy_steady": (self._before_last[1] / (self._before_last[0] * self.max_num_seqs)
                                 if self._before_last[0] else None),
            # every decoding sequence makes one token a step: tokens a second while stepping, the figure to set
            # beside the engine alone's (asyncppo/bench/limit.py: gen_tokens / step_s)
            "engine_step_s": self.busy_s,
            "engine_gap_s": self.gap_s,
            "running_mean": self.running_sum / self.steps if self.steps else 0.0,
            "decode_tokens_per_s": self.running_sum / self.busy_s if self.busy_s else 0.0,
            "inflight_updates": self.inflight_updates,
            **self.waits,
            "push_s_p50": _percentile(self.push_s, 0.5),
            "push_s_p99": _percentile(self.push_s, 0.99),
            "pushes_measured": len(self.push_s),
            "weight_loads": self.weight_loads,
            "response_length_mean": statistics.fmean(lengths) if lengths else 0.0,
            "response_length_p99": _percentile(lengths, 0.99),
            "trained_tokens": self.trained_tokens,
            # one string per sampled group, e.g. "3 4 3 3": compact in summary.json, read by asyncppo.report.rates
            "group_lengths": [" ".join(map(str, g)) for g in self.group_lengths],
        }
