"""The in-run window tuner behind ``rollout.max_staleness=auto`` / ``rollout.admission_lookahead=auto``.

Why here: it predicts with the advisor's own model (:func:`asyncppo.pipeline.simulator.simulate`) on rates fitted by
the advisor's own fit (:mod:`asyncppo.pipeline.fit`) from the metrics the learner already logs, so ``asyncppo
advise`` and the tuner never disagree about a run. Pure: the learner loop feeds it records and applies what it
returns to the admission controller (whose ``set_window`` keeps the bound exact while the window moves).

The rule, every ``every`` steps: measured drift (``actor/mismatch_kl``, mean over the last ``every`` steps) above
``budget`` shrinks the window at once by one step, whatever the throughput. Otherwise each neighbour one step away
(``k +- 1``, ``j +- 1`` for the knobs that are auto, within ``[sync_every - 1, cap]``) is simulated on the rates of
the last ``history`` steps; a raise must predict more than ``margin`` more samples/s, a lowering at most
``margin / 4`` fewer (staleness is never free), and the same move must win ``patience`` evaluations in a row. The
gap between the two thresholds is the hysteresis: after a raise that gained ``margin``, lowering back would lose
about as much, so noisy rates do not make it oscillate. Pinned knobs never move.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Optional

from asyncppo.pipeline.fit import engine_speed, learner_speed
from asyncppo.pipeline.lengths import EmpiricalGroups
from asyncppo.pipeline.model import EngineSpeed, Setup, TrainSpeed
from asyncppo.pipeline.simulator import simulate


@dataclass(frozen=True)
class Move:
    k: int
    j: int
    reason: str


class WindowTuner:
    def __init__(self, *, k: int, j: int, cap: int, tune_k: bool, tune_j: bool, batch_groups: int, group_size: int,
                 sync_every: int = 1, engines: int = 1, train_ranks: int = 1, max_num_seqs: int = 256,
                 admission_unit: str = "group", budget: Optional[float] = None, every: int = 5, margin: float = 0.05,
                 patience: int = 2, history: int = 30, sim_steps: int = 30, tie_j: bool = False):
        self.k, self.j, self.cap, self.tie_j = k, j, cap, tie_j
        self.tune_k, self.tune_j, self.budget = tune_k, tune_j, budget
        self.B, self.n, self.sync_every = batch_groups, group_size, sync_every
        self.engines, self.ranks, self.max_num_seqs, self.unit = engines, train_ranks, max_num_seqs, admission_unit
        self.every, self.margin, self.patience, self.sim_steps = every, margin, patience, sim_steps
        self.records: collections.deque = collections.deque(maxlen=history)
        self.groups: collections.deque = collections.deque(maxlen=256)  # recent whole groups' lengths
        self.steps = 0
        self._streak: tuple[Optional[tuple[int, int]], int] = (None, 0)
        self.k_range = [k, k]
        self.j_range = [j, j]

    def observe(self, record: dict, group_lengths: list[list[int]]) -> Optional[Move]:
        """Take one step's metrics and its groups' response lengths; a :class:`Move` when the window changes."""
        self.records.append(record)
        self.groups.extend(tuple(g) for g in group_lengths if g)
        self.steps += 1
        if self.steps % self.every or not (self.tune_k or self.tune_j):
            return None
        move = self._decide()
        if move is not None:
            self.k, self.j = move.k, move.j
            self.k_range = [min(self.k_range[0], move.k), max(self.k_range[1], move.k)]
            self.j_range = [min(self.j_range[0], move.j), max(self.j_range[1], move.j)]
        return move

    # ------------------------------------------------------------------------------------------------------------
    def _floor(self) -> int:
        return max(0, self.sync_every - 1)

    def _valid(self, k: int, j: int) -> bool:
        return self._floor() <= j <= k <= self.cap and k >= self._floor()

    def _neighbours(self) -> list[tuple[int, int]]:
        """Windows one step away that the auto knobs allow (``tie_j``: ``j`` follows ``k``, as an unset lookahead)."""
        k, j = self.k, self.j
        if self.tie_j:
            out = [(k + 1, k + 1), (k - 1, k - 1)] if self.tune_k else []
        else:
            out = [(k + 1, j), (k - 1, j)] if self.tune_k else []
            out += [(k, j + 1), (k, j - 1)] if self.tune_j else []
        return [c for c in dict.fromkeys(out) if self._valid(*c) and c != (k, j)]

    def drift(self) -> Optional[float]:
        xs = [float(r["actor/mismatch_kl"]) for r in list(self.records)[-self.every:]
              if isinstance(r.get("actor/mismatch_kl"), (int, float))]
        return sum(xs) / len(xs) if xs else None

    def _decide(self) -> Optional[Move]:
        drift = self.drift()
        if self.budget is not None and drift is not None and drift > self.budget:
            self._streak = (None, 0)
            for c in ((self.k - 1, self.k - 1 if self.tie_j else self.j) if self.tune_k else None,
                      (self.k, self.j - 1) if self.tune_j and not self.tie_j else None):
                if c is not None and self._valid(*c):
                    return Move(*c, f"drift over budget (mismatch_kl {drift:.3g} > {self.budget:.3g})")
            return None
        try:
            base = self.predict(self.k, self.j)
        except ValueError:  # not enough measured yet
            return None
        best, best_gain = None, 0.0
        for c in self._neighbours():
            if self.budget is not None and drift is not None and drift > 0.8 * self.budget and c[0] > self.k:
                continue  # close to the budget: never widen
            gain = self.predict(*c).samples_per_s / max(base.samples_per_s, 1e-12) - 1.0
            wider = c[0] + c[1] > self.k + self.j
            if (gain > self.margin if wider else gain > -self.margin / 4) and (best is None or gain > best_gain):
                best, best_gain = c, gain
        streak = (best, self._streak[1] + 1 if best is not None and best == self._streak[0] else 1)
        self._streak = streak if best is not None else (None, 0)
        if best is None or streak[1] < self.patience:
            return None
        self._streak = (None, 0)
        if best[0] + best[1] < self.k + self.j:
            why = f"no predicted loss narrower ({best_gain:+.1%})"
        elif base.occupancy < 0.9:
            why = f"engine idle (occupancy {base.occupancy:.2f}, {best_gain:+.1%} predicted)"
        else:
            why = f"learner waiting (train busy {base.train_busy:.2f}, {best_gain:+.1%} predicted)"
        return Move(best[0], best[1], why)

    def predict(self, k: int, j: int):
        """The model's result for window ``(k, j)`` on the rates of the recent steps (ValueError: too few)."""
        recs = list(self.records)
        if len(recs) < 3 or not self.groups:
            raise ValueError("too few steps measured")
        notes: list[str] = []
        base, per_seq = engine_speed(recs, self.B, self.n, self.max_num_seqs, notes)
        t_base, t_tok = learner_speed(recs, self.B, self.n, 1.0, notes)
        setup = Setup(engines=self.engines, train_ranks=self.ranks, batch_groups=self.B, group_size=self.n,
                      max_staleness=k, lookahead=j, sync_every=self.sync_every, admission_unit=self.unit,
                      steps=self.sim_steps, warmup_steps=min(8, self.sim_steps // 3))
        return simulate(setup, EngineSpeed(base_s=base, per_seq_s=per_seq, max_num_seqs=self.max_num_seqs),
                        TrainSpeed(base_s=t_base, per_token_s=t_tok * self.ranks), EmpiricalGroups(tuple(self.groups)))
