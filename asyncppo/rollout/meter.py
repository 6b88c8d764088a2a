"""What a rollout engine did between two groups sent: busy and idle seconds, decode steps, occupancy, pushes; and
what its worker's clients did (sockets re-created: :class:`LinkCounters`).

The meter rides on the groups (rollout/groups.py): each group's timings carry what the engine did since the previous
group was sent, so sums over any set of groups are exact totals (the learner's throughput, busy fractions, engine
occupancy and push latency are computed from them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from asyncppo.stream.redial import RECONNECT_KEYS


@dataclass
class EngineMeter:
    """What the engine did since the last group was sent; handed to the learner in that group's timings."""

    busy_s: float = 0.0  # time inside engine.step()
    steps: int = 0
    running_sum: int = 0  # sequences decoding, summed over steps (occupancy = running_sum / steps / max_num_seqs)
    inflight_updates: int = 0  # weight loads that happened with sequences in flight
    push_s: list[float] = field(default_factory=list)  # announcement seen -> weights loaded, per load
    # weights received and loaded, per load: the engine decodes nothing meanwhile (push_s also holds the wait for
    # the loop to see the announcement, and a drain's decoding under inflight_update=off): the push cadence's input
    load_s: list[float] = field(default_factory=list)
    # seconds the engine sat empty, by what it waited for: "ticket" (admission's window full: the learner is
    # behind) or "weights" (a held ticket needs a push not yet loaded); RolloutWorker._waits_for names it
    idle_s: dict[str, float] = field(default_factory=lambda: {"ticket": 0.0, "weights": 0.0})
    # a running engine's free slots, as engine seconds: each continuous step adds its time x the share of
    # max_num_seqs left free, by the same causes (an engine 3/4 full for 2 s counts 0.5 s)
    unfilled_s: dict[str, float] = field(default_factory=lambda: {"ticket": 0.0, "weights": 0.0})
    # the worker's own time between two decode steps while its engine held sequences (admission, groups scored,
    # built and sent, control messages; weight loads and waits left out): what the engine loses to the loop, which
    # the advisor adds to its decode-step time
    gap_s: float = 0.0

    def take(self) -> dict[str, float]:
        out = {"engine_busy_s": self.busy_s, "engine_gap_s": self.gap_s, "decode_steps": float(self.steps),
               "running_seq_sum": float(self.running_sum), "inflight_updates": float(self.inflight_updates),
               "push_count": float(len(self.push_s)), "push_s_max": max(self.push_s, default=0.0),
               "push_s_sum": sum(self.push_s), "load_s_max": max(self.load_s, default=0.0),
               **{f"idle_{why}_s": sec for why, sec in self.idle_s.items()},
               **{f"unfilled_{why}_s": sec for why, sec in self.unfilled_s.items()}}
        self.busy_s, self.gap_s, self.steps, self.running_sum, self.inflight_updates = 0.0, 0.0, 0, 0, 0
        self.push_s, self.load_s = [], []
        self.idle_s, self.unfilled_s = dict.fromkeys(self.idle_s, 0.0), dict.fromkeys(self.unfilled_s, 0.0)
        return out


class LinkCounters:
    """Sockets the worker's admission client and control subscriber re-created (``reconnects``,
    :mod:`asyncppo.stream.redial`) since the last record sent, under :data:`~asyncppo.stream.redial.RECONNECT_KEYS`;
    the worker adds them to each group's (or segment's) timings, so the learner's per-step sums over workers are
    exact. Reads the clients the worker holds at each call: when a restarted learner made it open new ones, the old
    ones' last counts are still taken, and the new ones count from zero. What comes after the last record sent is
    not reported."""

    _CLIENTS = dict(zip(RECONNECT_KEYS, ("admission", "control")))

    def __init__(self, worker):
        self._worker = worker
        self._last: dict[str, tuple[object, int]] = {}  # key -> (the client read last, its count then)

    def take(self) -> dict[str, float]:
        out = {}
        for key, attr in self._CLIENTS.items():
            client = getattr(self._worker, attr, None)
            now = int(getattr(client, "reconnects", 0))
            old, seen = self._last.get(key, (client, 0))
            # a replaced client: what the old one counted since the last take, plus all of the new one's
            out[key] = float(now - seen if old is client else getattr(old, "reconnects", seen) - seen + now)
            self._last[key] = (client, now)
        return out
