"""The in-run window tuner behind ``rollout.max_staleness=auto`` / ``rollout.admission_lookahead=auto``.

Why here: it predicts with the advisor's own model (:func:`asyncppo.pipeline.simulator.simulate`) on rates fitted by
the advisor's own fit (:mod:`asyncppo.pipeline.fit`) from the metrics the learner already logs, so ``asyncppo
advise`` and the tuner never disagree about a run. Pure: the learner loop feeds it records and applies what it
returns to the admission controller (whose ``set_window`` keeps the bound exact while the window moves).

The rule, every ``every`` steps: measured drift (``actor/mismatch_kl``, mean over the last ``every`` steps) above
``budget`` shrinks the window at once by one step, whatever the throughput. Otherwise each neighbour one step away
(``k +- 1``, ``j +- 1`` for the knobs that are auto, within ``[sync_every - 1, cap]``) is simulated on the rates of
the last ``history`` steps; a raise must predict more than ``margin`` more samples/s, a lowering at most
``margin / 4`` fewer (staleness is never free) provided it predicts a mean token lag at least :data:`LAG_CUT` lower
(on ``data=long`` at ``k = 12, j = 3`` the model predicts ``k = 11``, ``10``, ``9`` within 1% of the rate and with no
less lag, the lookahead holding it: without this the window walked down ``12 -> 9`` over a 60-step run, waiting
for its stragglers as ``k = 8`` does: 37.9 s of waits against 30.9 s at ``k = 12``), and no throughput move is
made before ``patience`` evaluations at
the current window, unless its gain clears the need by ``sure`` margins (a clear case: a run started far from its
best window climbs one step per evaluation, not one per ``patience``; measured on ``data=reverse``, where decisions
are rationed by the decision process's share of the wall time, the old rule climbed 1 -> 4 in 200 steps while the
best window was 8-12). Every move is one step, except a clear climb's rungs (below). Pinned knobs never move.

Why it also looks twice as far: on a gentle slope each single step predicts less than ``margin`` while the window
two or three steps away predicts much more (``data=reverse`` at ``k = 4``: +3.6% a step, +10% measured at ``k = 8``),
so a rule that judged neighbours alone stopped at ``k = 4``. Each evaluation also predicts the window ``far``
(``k`` doubled, at least ``k + 2``, at most the cap; ``j`` moved as much where it is auto); when that clears the
band for a widening, the tuner takes one step toward it, provided that step is itself no predicted loss (beyond
``margin / 4``) and no narrower window predicts a real gain; otherwise the next evaluation would undo it. Where the
whole doubling gains less than ``margin`` it stays: the climb stops where widening stops paying.

Why a clear climb moves a whole rung (``leap``): a step per decision is slow for a run that starts far below its
best window, and a short run never gets there. Measured on the guess game behind a 200 ms tool (60 steps, started
at ``k = 1``, best fixed windows 8-16): decisions came every 5-10 steps, the window climbed 1 -> 7 in six moves, and
the run's learner time was 1.65x the best fixed window's. So where the window twice as wide clears its need by
``sure`` margins and predicts more than ``margin`` beyond the next step's own gain (the rest of the rung pays on its
own: a far window that gains little past the step would add lag for nothing), the move goes to that window:
1 -> 3 -> 6 -> 12 -> 16 (the cap). A wider window strands no ticket, so the bound is exact through a leap;
no leap is made while the drift measured is over half the budget (an assumption: about twice the lag, about twice
the drift; the drift rule then narrows one step per evaluation, and a leap's drift shows only steps later). Near
the best window no gain is that clear, and the moves are single steps again, under the hysteresis below.

Why a leap goes on up the rungs (``rungs_up``): one rung a decision still left the guess game's climb
1 -> 3 -> 6 -> 12 spread over the run, each rung a decision and a cool-down later, and the decision at ``k = 6`` cost
4.5-5.5 s of a 60-step run (1.66x the best fixed window's learner time, no better than single steps). So a leap
predicts the rung above the one it takes, and the one above that, for as long as each predicts more than ``margin``
beyond the rung below it (the gate the first rung's "rest of the rung" passed, judged on one evaluation: the first
rung alone needed ``sure`` margins, and a rung whose quick seeds leave it within ``sure`` margins of its gate is
judged on all ``seeds``), and moves to the highest: a climb that used to take three decisions takes one, and it
stops where doubling stops paying. Each rung costs the quick seeds, and only a decision that already leaps pays for
them. The drift rule scales with it: a rung ``k_up`` is climbed only while the drift measured, times ``k_up / k``
(lag, and so drift, about proportional to the window), stays within the budget (the first rung's "half the budget"
is the doubling's case). A climb ends where it stops paying or at the cap, so the decision after it is no longer a
climb's: it comes after the plain share's cool-down (``settled`` in the reply; tuner_host.py).

What a decision costs (it shares the box with the run; tuner_host.py rations it to a tenth of the wall time): the
current window over ``seeds`` seeds, then each neighbour and the far window over the first ``quick_seeds`` of them,
completed to all ``seeds`` only when the quick gain lies within ``sure`` margins of its need (never, for a wider
neighbour, where the far window, judged first, is a clear leap: that neighbour has only to show it is no loss, and a
climb's decision at k = 7 on the guess game fell from 44 simulations to 35: with the simulator's fast paths,
1.9 to 1.2 s of CPU; a climb's top rung then costs up to ``1 + log2`` of its span in ``j`` more predictions,
:meth:`_narrowest_lookahead`); and a wider window is
not simulated at all when the current window's predicted learner share ``b`` leaves no room for the gain it needs
(``1 / b - 1 <= need``: no window makes the learner busier than always). A simulation runs ``sim_steps`` steps, 8
of them warm-up, but measures at most ``sim_groups`` groups beyond that (never fewer than 8 steps): a prediction's
noise comes from the groups it samples, not the steps, and a large batch (the default task's 128 prompts) would
otherwise simulate 30 steps of 1,024 sequences, which made its decisions cost 7-8.5 s on 2 cores.

Why it does not oscillate on noisy rates (tests/unit/test_window_tuner.py). Two sources of noise, two remedies:
- the simulator samples lengths from a heavy-tailed reservoir, so one seed's prediction moves by several percent
  between two windows that are equally good. Every window is predicted as the mean over ``seeds`` seeds, the *same*
  seeds for the current window and each neighbour (common random numbers): the comparison sees the windows'
  difference, not the sampler's;
- the rates themselves: each evaluation re-fits the last ``history`` steps, and where the decode time hardly
  depends on the running sequences the line fit flips between a fixed-cost and a proportional engine (fit.py's
  fallback), which moves the predicted gain of a neighbour by 10-15% from one evaluation to the next. The gain a
  move is judged by is an exponential average over the evaluations since the window last moved (weight ``smooth``
  on the newest), reset on every move;
- a move against the direction of the last one must clear a wider band: a lowering after a raise must predict no
  loss at all (``gain > 0``, not ``> -margin / 4``), a raise after a lowering ``2 * margin``. The raise was made
  because the model predicted ``margin`` more; undoing it on a smaller signal would be noise. Drift over the budget
  is exempt (it shrinks at once, whatever came before, and clears the direction).

Weight pushes are simulated as the run makes them (:func:`asyncppo.pipeline.fit.push_rates`, which the advisor
reads too): the engines pause for the median load measured (``sync/load_s``) at every push, and under
``rollout.sync_every=auto`` the pushes come at the median cadence the learner logged (``sync/every``), capped at a
candidate's lookahead as the learner caps it. Before, every window was simulated with a push at every version and
no pause, so the lag a narrowing buys was predicted against versions the engines never held.
"""

from __future__ import annotations

import collections
import dataclasses
from dataclasses import dataclass
from typing import Optional

from asyncppo.pipeline.fit import cadence_at, engine_speed, episode_rates, learner_speed, push_rates
from asyncppo.pipeline.lengths import EmpiricalGroups
from asyncppo.pipeline.model import EngineSpeed, Result, Setup, TrainSpeed
from asyncppo.pipeline.opening import OPEN_READS, opening
from asyncppo.pipeline.simulator import simulate


#: Learner steps a simulation runs before it measures (fewer when it runs fewer than three times as many in all):
#: the pipeline's start, when the window is still filling, is not its steady rate.
SIM_WARMUP = 8
#: A narrower window is moved to only where it predicts a mean token lag at least this share below the window in
#: force (on the same seeds): narrowing is for lag, and one that buys none is a move for nothing (module docstring).
LAG_CUT = 0.05
_AVERAGED = ("samples_per_s", "tokens_per_s", "step_s", "rollout_busy", "train_busy", "occupancy", "lag_mean",
             "token_lag_mean", "idle_gpu_frac")  # the fields of a prediction the reasons and callers read


@dataclass(frozen=True)
class Move:
    k: int
    j: int
    reason: str
    # the predicted gain in samples/s that justified it (0 for a drift move; for a step toward the window twice as
    # wide, that window's gain: the step itself need only be no predicted loss; for a leap, the highest rung's own)
    gain: float = 0.0


class WindowTuner:
    def __init__(self, *, k: int, j: int, cap: int, tune_k: bool, tune_j: bool, batch_groups: int, group_size: int,
                 sync_every: int = 1, sync_auto: bool = False, engines: int = 1, train_ranks: int = 1,
                 max_num_seqs: int = 256, admission_unit: str = "group", budget: Optional[float] = None,
                 every: int = 5, margin: float = 0.05,
                 patience: int = 2, history: int = 30, sim_steps: int = 30, tie_j: bool = False, seeds: int = 5,
                 smooth: float = 0.3, quick_seeds: int = 2, sure: float = 3.0, far: bool = True,
                 sim_groups: int = 352, leap: bool = True, rungs_up: bool = True, open_up: bool = True):
        self._init = {name: value for name, value in locals().items() if name != "self"}  # for state()
        self.k, self.j, self.cap, self.tie_j = k, j, cap, tie_j
        self.tune_k, self.tune_j, self.budget = tune_k, tune_j, budget
        self.B, self.n, self.sync_every = batch_groups, group_size, sync_every
        self.sync_auto = sync_auto  # the learner sets the cadence (push_cadence.py): simulate the one measured
        self.engines, self.ranks, self.max_num_seqs, self.unit = engines, train_ranks, max_num_seqs, admission_unit
        self.every, self.margin, self.patience = every, margin, patience
        # steps one simulation runs and warms up for (module docstring: large batches measure fewer steps)
        self.sim_warmup = min(SIM_WARMUP, sim_steps // 3)
        self.sim_steps = self.sim_warmup + min(sim_steps - self.sim_warmup, max(8, -(-sim_groups // batch_groups)))
        self.seeds = max(1, seeds)
        self.quick_seeds = min(max(1, quick_seeds), self.seeds)
        self.sure = sure  # a gain this many margins past its need is clear: no second seed pass, no patience
        self.sims = 0  # simulator runs so far (what a decision costs: tests read it)
        self.far = far  # also judge a window twice as wide, and step toward it (module docstring)
        self.leap = leap  # a clear climb moves a whole rung, to that window (module docstring)
        self.rungs_up = rungs_up  # ... and on up the rungs while each still predicts a margin more
        self._last: Optional[bool] = None  # whether the last throughput move widened (reversing needs a wider band)
        self.records: collections.deque = collections.deque(maxlen=history)
        self.groups: collections.deque = collections.deque(maxlen=256)  # recent whole groups' lengths
        self.steps = 0
        self.smooth = smooth
        self._gain: dict[tuple[int, int], float] = {}  # neighbour -> smoothed predicted gain at this window
        self._lags: dict[tuple[int, int], list[float]] = {}  # window -> this decision's predicted token lag per seed
        self._evals = 0  # evaluations since the window last moved
        self.k_range = [k, k]
        self.j_range = [j, j]
        self.outlook: dict[str, float] = {}  # the last evaluation's best smoothed gain: "up", "far", "down"
        # the last decision found a move it may make later (patience) or could not judge yet (too few steps): its
        # "no move" is no reason to decide less often (tuner_host.py: the back-off after decisions that stay)
        self.pending = False
        # the last decision's move was a climb up the rungs that ended where the next stopped paying or at the cap:
        # no climb goes on from it (tuner_host.py: no climbing share after it)
        self.settled = False
        # the opening move (opening.py) is still to be judged: once, on the run's first records
        self.opening = open_up and (tune_k or tune_j)

    def observe(self, record: dict, group_lengths: list[list[int]]) -> Optional[Move]:
        """Take one step's metrics and its groups' response lengths; a :class:`Move` when the window changes (the
        opening's, on the step it moves, instead of that step's decision: the hook's decision process judges the
        new window at once, this thread at the next due step). Decides on the caller's thread (the learner's hook
        decides in a process of its own: :meth:`record`, :meth:`state`, :meth:`take`)."""
        due = self.record(record, group_lengths)
        move = self.opening_move()
        if move is not None or not due:
            return move
        return self.apply(self.decide())

    def record(self, record: dict, group_lengths: list[list[int]]) -> bool:
        """Take one step's metrics and its groups' response lengths; True when a decision is due (every ``every``
        steps, with a knob to tune)."""
        self.records.append({k: v for k, v in record.items() if isinstance(v, (int, float))})
        self.groups.extend(tuple(g) for g in group_lengths if g)
        self.steps += 1
        return not self.steps % self.every and (self.tune_k or self.tune_j)

    def opening_move(self) -> Optional[Move]:
        """The opening move by Little's law (opening.py), put in force, when the run's first records say so: judged
        after the first record alone (the fill, where the engine sat idle through it) and after ``1 + n`` records
        for each ``n`` in ``OPEN_READS``, until it moves; None otherwise. Any move ends it.
        Cheap: the learner's hook calls it on its own thread."""
        read = self.steps - 1  # records past the run's first (the deque may hold fewer than the steps)
        fill = self.steps == 1  # the first alone: read where the engine sat idle through it (opening.py)
        if not self.opening or not (fill or read in OPEN_READS):
            return None
        self.opening = fill or read < max(OPEN_READS)
        drift = self.drift()
        if self.budget is not None and drift is not None and drift > self.budget / 2:
            return None  # as a leap: no jump while the drift is over half the budget
        got = opening(list(self.records)[-max(read, 1):], self.k, self.j, cap=self._drift_allows(drift),
                      tune_k=self.tune_k, tune_j=self.tune_j, tie_j=self.tie_j, valid=self._valid, fill=fill)
        return self.apply(Move(*got)) if got else None

    def decide(self) -> Optional[Move]:
        """The rule of the module docstring at the current window; moves nothing (:meth:`apply` does)."""
        return self._decide()

    def apply(self, move: Optional[Move]) -> Optional[Move]:
        """Put ``move`` in force (the direction it went, the range the window took); ``move`` back."""
        if move is not None:
            self.opening = False  # the run's first records now span two windows: no opening on them
            self._last = None if move.reason.startswith("drift") else move.k + move.j > self.k + self.j
            self._gain, self._evals = {}, 0
            self.k, self.j = move.k, move.j
            self.k_range = [min(self.k_range[0], move.k), max(self.k_range[1], move.k)]
            self.j_range = [min(self.j_range[0], move.j), max(self.j_range[1], move.j)]
        return move

    # ------------------------------------------------------------------------------ deciding in another process
    def state(self) -> dict:
        """What a decision reads, as JSON values: the settings, the window, the recent steps and the smoothed gains
        (:func:`decide_on` rebuilds the tuner from it in the decision process)."""
        return {"init": self._init, "k": self.k, "j": self.j, "last": self._last, "steps": self.steps,
                "records": list(self.records), "groups": [list(g) for g in self.groups],
                "gain": [[k, j, g] for (k, j), g in self._gain.items()], "evals": self._evals}

    def take(self, reply: dict) -> Optional[Move]:
        """A decision made on :meth:`state` elsewhere (:func:`decide_on`'s reply): its smoothed gains and count,
        and its move, put in force; ignored when the window moved since (a restore, the opening, the drift budget),
        the state it judged."""
        if tuple(reply["at"]) != (self.k, self.j):
            return None
        self._gain = {(int(k), int(j)): float(g) for k, j, g in reply["gain"]}
        self._evals = int(reply["evals"])
        move = reply.get("move")
        gain = float(move[3]) if move and len(move) > 3 else 0.0  # a reply without its gain: none claimed
        return self.apply(Move(int(move[0]), int(move[1]), str(move[2]), gain) if move else None)

    # ------------------------------------------------------------------------------------------------------------
    def _floor(self) -> int:
        return max(0, self.sync_every - 1)

    def _valid(self, k: int, j: int) -> bool:
        return self._floor() <= j <= k <= self.cap and k >= self._floor()

    def allows(self, k: int, j: int) -> bool:
        """Whether ``(k, j)`` is a window this tuner may hold: ``sync_every - 1 <= j <= k <= cap``."""
        return self._valid(k, j)

    def _neighbours(self) -> list[tuple[int, int]]:
        """Windows one step away that the auto knobs allow (``tie_j``: ``j`` follows ``k``, as an unset lookahead).
        With both knobs free, one step also moves both together: from ``k = j`` a wider window needs both (``j`` may
        not pass ``k``, and a wider ``k`` alone admits nothing sooner), so without the diagonal a run started at
        ``(0, 0)`` never left it (measured on data=long: 60 steps at k = 0, 2.2x the best fixed window's time)."""
        k, j = self.k, self.j
        if self.tie_j:
            out = [(k + 1, k + 1), (k - 1, k - 1)] if self.tune_k else []
        else:
            out = [(k + 1, j), (k - 1, j)] if self.tune_k else []
            out += [(k, j + 1), (k, j - 1)] if self.tune_j else []
            out += [(k + 1, j + 1), (k - 1, j - 1)] if self.tune_k and self.tune_j else []
        return [c for c in dict.fromkeys(out) if self._valid(*c) and c != (k, j)]

    def _far_window(self) -> Optional[tuple[int, int]]:
        """The window the climb looks toward: the rung above the window in force (:meth:`_rung`)."""
        return self._rung(self.k, self.j)

    def _rung(self, k0: int, j0: int) -> Optional[tuple[int, int]]:
        """The rung above ``(k0, j0)``: ``k`` doubled (at least ``k0 + 2``, at most the cap), ``j`` moved by as much
        where it is auto (within ``k``); None where that is no further than a neighbour."""
        if not (self.far and self.tune_k):
            return None
        k = min(self.cap, max(k0 + 2, 2 * k0))
        j = k if self.tie_j else (min(k, j0 + k - k0) if self.tune_j else j0)
        return (k, j) if k > k0 + 1 and self._valid(k, j) else None

    def _climb(self, rung: tuple[int, int], gain: float, base_rate: list[float], fit: tuple,
               drift: Optional[float]) -> tuple[tuple[int, int], float, int]:
        """From the rung a leap takes (its predicted ``gain``), the rungs above it for as long as each predicts more
        than ``margin`` beyond the one below, and whose ``k`` the measured ``drift``, scaled by the window, allows
        (module docstring, "Why a leap goes on up the rungs"): the highest such, its gain, and how many rungs up
        from the window in force it is. Where ``j`` is free, the highest rung's ``k`` with the narrowest ``j``
        that predicts at most ``margin / 4`` less (:meth:`_narrowest_lookahead`: the lookahead is the lag)."""
        rungs = 1
        while (up := self._rung(*rung)) is not None:
            if up[0] > self._drift_allows(drift):
                break  # about proportional to the window: that rung's drift would be over the budget
            need = (1.0 + gain) * (1.0 + self.margin) - 1.0  # a margin beyond the rung below, as a gain over base
            up_gain = self._gain_of(up, base_rate, need, fit)
            if up_gain <= need:
                break
            rung, gain, rungs = up, up_gain, rungs + 1
        if self.tune_j and not self.tie_j and rung[1] > self.j and self._valid(rung[0], self.j):
            rung, gain = self._narrowest_lookahead(rung, gain, base_rate, fit)
        return rung, gain, rungs

    def _narrowest_lookahead(self, rung: tuple[int, int], gain: float, base_rate: list[float],
                             fit: tuple) -> tuple[tuple[int, int], float]:
        """The top rung's ``k`` with the narrowest ``j`` that predicts at most ``margin / 4`` less than the rung
        (the lookahead is the lag, and lag is never free): the ``j`` in force first, then by halves between it and
        the rung's own ``j`` (the predicted rate grows with ``j`` at a fixed ``k``); the rung itself where none
        does. Measured without it on ``data=reverse``: the rungs took ``j`` from 3 to 7-9, a mean lag of 5.7-6.2
        against 2.5 at the fixed windows' ``j = 3``, for 5-7% more samples a second."""
        k, need = rung[0], (1.0 + gain) * (1.0 - self.margin / 4) - 1.0
        lo, hi, best = self.j, rung[1], (rung, gain)
        low_gain = self._gain_of((k, lo), base_rate, need, fit)
        if low_gain > need:
            return (k, lo), low_gain
        while hi - lo > 1:  # lo predicts too little, hi enough
            mid = (lo + hi) // 2
            mid_gain = self._gain_of((k, mid), base_rate, need, fit)
            if mid_gain > need:
                hi, best = mid, ((k, mid), mid_gain)
            else:
                lo = mid
        return best

    def _drift_allows(self, drift: Optional[float]) -> int:
        """The widest ``k`` the measured ``drift`` allows, taking drift as about proportional to the window
        (``drift x k_new / k <= budget``); the cap where no budget is set or no drift measured."""
        if self.budget is None or not drift:
            return self.cap
        return min(self.cap, int(self.budget * max(self.k, 1) / drift))

    def _toward(self, far: tuple[int, int]) -> Optional[tuple[int, int]]:
        """The wider neighbour on the way to ``far``: both knobs a step where ``j`` is to grow, else ``k`` alone."""
        for c in ((self.k + 1, self.j + 1), (self.k + 1, self.j)) if far[1] > self.j else ((self.k + 1, self.j),):
            if c in self._neighbours():
                return c
        return None

    def drift(self) -> Optional[float]:
        xs = [float(r["actor/mismatch_kl"]) for r in list(self.records)[-self.every:]
              if isinstance(r.get("actor/mismatch_kl"), (int, float))]
        return sum(xs) / len(xs) if xs else None

    def over_budget(self) -> bool:
        """Whether the measured drift is over ``budget`` (the one rule that acts without simulating)."""
        drift = self.drift()
        return self.budget is not None and drift is not None and drift > self.budget

    def drift_move(self) -> Optional[Move]:
        """Over the budget: one step narrower (``k`` first, else ``j``), whatever the throughput; None when the
        window can narrow no further. Cheap: the learner's hook applies it at once, never waiting on a decision."""
        drift = self.drift()
        for c in ((self.k - 1, self.k - 1 if self.tie_j else self.j) if self.tune_k else None,
                  (self.k, self.j - 1) if self.tune_j and not self.tie_j else None):
            if c is not None and self._valid(*c):
                return Move(*c, f"drift over budget (mismatch_kl {drift:.3g} > {self.budget:.3g})")
        return None

    def _decide(self) -> Optional[Move]:
        drift = self.drift()
        self.pending = self.settled = False
        if self.over_budget():
            return self.drift_move()
        try:
            fit = self._fit()
        except ValueError:  # not enough measured yet
            self.pending = True
            return None
        base = self._runs(self.k, self.j, self.seeds, fit=fit)
        base_rate = [r.samples_per_s for r in base]
        self._lags = {(self.k, self.j): [r.token_lag_mean for r in base]}
        train_busy = sum(r.train_busy for r in base) / len(base)
        best, best_gain, best_need, via = None, 0.0, 0.0, None
        self._evals += 1
        self.outlook = {}
        far = self._far_window()
        calm = self.budget is None or drift is None or drift <= self.budget / 2
        # the far window first: where its climb is clear enough to leap, a wider neighbour has only to show it is
        # no loss, which its quick seeds say (module docstring, "What a decision costs"); a narrower one, which may
        # hold the climb back, is still judged on every seed where it is close
        far_need = self._need(far, drift, train_busy) if far else None
        far_raw = self._gain_of(far, base_rate, far_need, fit) if far_need is not None else None
        # clear as the leap below judges it: on the gain smoothed over the evaluations at this window
        clear = far_raw is not None and self.leap and calm and \
            self._smoothed(far, far_raw) > far_need + self.sure * self.margin
        for c in [*self._neighbours(), *([far] if far else [])]:
            need = far_need if c == far else self._need(c, drift, train_busy)
            if need is None:
                self._gain.pop(c, None)  # not predicted this time: no stale gain to average in later
                continue
            wider = c[0] + c[1] > self.k + self.j
            raw = far_raw if c == far else self._gain_of(c, base_rate, need, fit, quick=clear and wider)
            gain = self._gain[c] = self._smoothed(c, raw)
            side = "far" if c == far else "up" if wider else "down"
            self.outlook[side] = max(gain, self.outlook.get(side, -1.0))
            if c == far:
                step = self._toward(far)
                # toward the far window only where that step is itself no predicted loss (else the next evaluation
                # would undo it) and no narrower window predicts a real gain
                narrower = best is not None and best[0] + best[1] < self.k + self.j
                if gain > need and step is not None and self._gain.get(step, -1.0) > -self.margin / 4 and \
                        not (narrower and best_gain > 0) and (best is None or narrower or gain > best_gain):
                    best, best_gain, best_need, via = step, gain, need, far
            elif gain > need and (wider or self._buys_lag(c)) and (best is None or gain > best_gain):
                best, best_gain, best_need = c, gain, need
        sure = best is not None and best_gain > best_need + self.sure * self.margin
        if best is None or (self._evals < self.patience and not sure):
            self.pending = best is not None  # a move waits for patience: the next decision is no "stay"
            return None
        beyond = (1.0 + best_gain) / (1.0 + self._gain.get(best, 0.0)) - 1.0  # the rest of the rung, on its own
        rungs = 0
        if via is not None and sure and self.leap and calm and beyond > self.margin:
            best, rungs = via, 1  # a clear climb whose slope goes on past the next step: the whole rung (docstring)
            if self.rungs_up:
                best, best_gain, rungs = self._climb(via, best_gain, base_rate, fit, drift)
                via, self.settled = best, True
        mean = lambda f: sum(getattr(r, f) for r in base) / len(base)  # noqa: E731
        at = "" if not via else f" at k = {via[0]}, j = {via[1]}" if best != via else \
            ", a rung" if rungs == 1 else f", {rungs} rungs"
        if best[0] + best[1] < self.k + self.j:
            why = f"no predicted loss narrower ({best_gain:+.1%})"
        elif mean("occupancy") < 0.9:
            why = f"engine idle (occupancy {mean('occupancy'):.2f}, {best_gain:+.1%} predicted{at})"
        else:
            why = f"learner waiting (train busy {train_busy:.2f}, {best_gain:+.1%} predicted{at})"
        return Move(best[0], best[1], why, best_gain)

    def _buys_lag(self, c: tuple[int, int]) -> bool:
        """Whether the narrower window ``c`` predicts a mean token lag at least :data:`LAG_CUT` below the window in
        force, on the seeds both were simulated on (True where ``c`` has no prediction of its own to judge by)."""
        lags, base = self._lags.get(c), self._lags.get((self.k, self.j))
        if not lags or not base:
            return True
        return sum(lags) < (1.0 - LAG_CUT) * sum(base[:len(lags)])

    def _smoothed(self, c: tuple[int, int], raw: float) -> float:
        """Window ``c``'s gain smoothed over the evaluations at this window (weight ``smooth`` on ``raw``, the
        newest), not stored."""
        return raw if c not in self._gain else self.smooth * raw + (1 - self.smooth) * self._gain[c]

    def _need(self, c: tuple[int, int], drift: Optional[float], train_busy: float) -> Optional[float]:
        """The gain window ``c`` must predict to be moved to (the bands of the module docstring: a raise
        ``margin``, a lowering no more than ``margin / 4`` lost, each wider against the last move's direction);
        None where it is not judged: a widening close to the drift budget, or one the learner's predicted share
        ``train_busy`` leaves no room for (no window makes the learner busier than always)."""
        wider = c[0] + c[1] > self.k + self.j
        if wider and self.budget is not None and drift is not None and drift > 0.8 * self.budget:
            return None  # close to the budget: never widen
        undo = self._last is not None and wider != self._last  # against the last move: the wider band
        need = (2 * self.margin if undo else self.margin) if wider else (0.0 if undo else -self.margin / 4)
        if wider and 1.0 / max(train_busy, 1e-9) - 1.0 <= need:
            return None  # the learner is busy enough that no window can gain ``need``: not worth simulating
        return need

    def _gain_of(self, c: tuple[int, int], base_rate: list[float], need: float, fit: tuple,
                 quick: bool = False) -> float:
        """Window ``c``'s predicted samples/s over the current window's, minus one, on common seeds: the first
        ``quick_seeds`` alone when they already put it ``sure`` margins from ``need`` either way (a clear case
        costs a fraction of the simulations) or ``quick`` says their word is enough, else all ``seeds``."""
        runs = self._runs(*c, self.quick_seeds, fit=fit)
        rates = [r.samples_per_s for r in runs]
        gain = sum(rates) / max(sum(base_rate[:len(rates)]), 1e-12) - 1.0
        if not (quick or abs(gain - need) > self.sure * self.margin or len(rates) == self.seeds):
            runs += self._runs(*c, self.seeds, first=len(rates), fit=fit)
            rates = [r.samples_per_s for r in runs]
            gain = sum(rates) / max(sum(base_rate), 1e-12) - 1.0
        self._lags[c] = [r.token_lag_mean for r in runs]
        return gain

    def predict(self, k: int, j: int) -> Result:
        """The model's result for window ``(k, j)`` on the rates of the recent steps, averaged over ``seeds``
        simulator seeds (the same seeds for every window: module docstring); ValueError: too few steps measured."""
        runs = self._runs(k, j, self.seeds)
        mean = lambda f: sum(getattr(r, f) for r in runs) / len(runs)  # noqa: E731
        return dataclasses.replace(runs[0], **{f: mean(f) for f in _AVERAGED})

    def _fit(self) -> tuple:
        """The rates of the recent steps, fitted as the advisor fits them: the engine, the learner, the length
        reservoir and the episodes' turns; ValueError: too few steps measured. Once per decision: every window it
        simulates reads the same fit."""
        recs = list(self.records)
        if len(recs) < 3 or not self.groups:
            raise ValueError("too few steps measured")
        notes: list[str] = []
        base, per_seq = engine_speed(recs, self.B, self.n, self.max_num_seqs, notes)
        # multi-turn episodes: turns, time out of the engine per turn, decoded share (the advisor's own reading)
        turns, env_s, model_frac = episode_rates(recs, self.B * self.n, self.engines, notes)
        t_base, t_tok = learner_speed(recs, self.B, self.n, model_frac, notes)
        gen = EngineSpeed(base_s=base, per_seq_s=per_seq, max_num_seqs=self.max_num_seqs)
        train, lengths = TrainSpeed(base_s=t_base, per_token_s=t_tok * self.ranks), EmpiricalGroups(tuple(self.groups))
        every, load_s = push_rates(recs, self.sync_every)
        return gen, train, lengths, turns, env_s, model_frac, (every if self.sync_auto else self.sync_every, load_s)

    def _runs(self, k: int, j: int, seeds: int, first: int = 0, fit: Optional[tuple] = None) -> list[Result]:
        """One simulation of window ``(k, j)`` per seed ``first .. seeds - 1`` on ``fit`` (:meth:`_fit`, fitted
        here when not given)."""
        gen, train, lengths, turns, env_s, model_frac, (every, load_s) = fit or self._fit()
        # an auto cadence never exceeds the lookahead (learner/loop.py: _lookahead), so a narrower j pushes as often
        every = cadence_at(every, j) if self.sync_auto else every
        self.sims += seeds - first
        return [simulate(Setup(engines=self.engines, train_ranks=self.ranks, batch_groups=self.B, group_size=self.n,
                               max_staleness=k, lookahead=j, sync_every=every, load_s=load_s, admission_unit=self.unit,
                               turns=turns, env_s=env_s, model_frac=model_frac, steps=self.sim_steps,
                               warmup_steps=self.sim_warmup, seed=seed),
                         gen, train, lengths) for seed in range(first, seeds)]


def decide_on(state: dict) -> dict:
    """One decision on a tuner's :meth:`~WindowTuner.state`: the reply :meth:`~WindowTuner.take` reads (the window
    it judged, the move or None, the smoothed gains and the evaluation count after it)."""
    tuner = WindowTuner(**state["init"])
    tuner.k, tuner.j, tuner._last, tuner.steps = int(state["k"]), int(state["j"]), state["last"], int(state["steps"])
    tuner.records.extend(state["records"])
    tuner.groups.extend(tuple(g) for g in state["groups"])
    tuner._gain = {(int(k), int(j)): float(g) for k, j, g in state["gain"]}
    tuner._evals = int(state["evals"])
    move = tuner.decide()
    return {"at": [int(state["k"]), int(state["j"])],
            "move": [move.k, move.j, move.reason, move.gain] if move else None,
            "gain": [[k, j, g] for (k, j), g in tuner._gain.items()], "evals": tuner._evals,
            "outlook": tuner.outlook, "pending": tuner.pending, "settled": tuner.settled}
