"""The learner's side of ``rollout.max_staleness=auto``: feed the window tuner each step's metrics, apply its moves
to the admission controller, and make every decision visible.

Why a hook of its own and not code inside the loop: the loop (loop.py) owns steps, versions and pushes; the window
is one more consumer of the step's metrics, and keeping it here keeps the loop's edit to three calls. The tuner
(:mod:`asyncppo.pipeline.tuner`) is pure and predicts with the advisor's model; this hook only turns the config into
its arguments and the learner's records into its inputs.

What the bound relies on (docs/staleness.md, "A window that moves"): the buffer is opened with ``k = cap`` so its
guard is each ticket's own ``k`` (``AdmissionController.bound_of``), and :meth:`AdmissionController.set_window`
changes later grants only. A pinned knob is passed to the tuner as not tunable and never moves.
"""

from __future__ import annotations

import time
from typing import Callable, Optional

from asyncppo.pipeline.tuner import WindowTuner
from asyncppo.pipeline.tuner_host import DecisionHost


class WindowHook:
    """One per run when ``rollout.window_auto`` is set (:func:`window_hook` returns None otherwise)."""

    def __init__(self, cfg, admission, say: Callable[[str], None], engines: int = 1, train_ranks: int = 1,
                 background: bool = True):
        r = cfg.rollout
        self.admission, self.say = admission, say
        self.tuner = WindowTuner(
            k=r.max_staleness, j=r.admission_lookahead, cap=r.max_staleness_cap,
            tune_k="k" in r.window_auto, tune_j="j" in r.window_auto, tie_j=r.window_auto == "k=j",
            batch_groups=r.rollout_batch_size, group_size=r.num_return_sequences_in_group,
            sync_every=r.sync_every, sync_auto=r.sync_auto, engines=max(1, engines), train_ranks=max(1, train_ranks),
            max_num_seqs=r.max_num_seqs, admission_unit=r.admission_unit,
            budget=cfg.algorithm.offpolicy_budget, every=r.tune_every)
        self.j_min = r.admission_lookahead  # the smallest j ever in force (what a coalesced push must still serve)
        self.changes = 0
        self.restored = False  # a checkpoint's window in force: judged before the restart (idle-class decisions)
        # decisions in a process of their own (pipeline/tuner_host.py); None: on this thread
        self.host = None
        if background:
            try:
                self.host = DecisionHost()
            except OSError as exc:  # no process to be had: the run still tunes, on this thread
                say(f"window tuner: cannot start its decision process ({exc}); deciding on the learner's thread")

    def after_step(self, metrics: dict, records: list) -> None:
        """Feed one step; on a move set the window, say why on the console and in this step's record. Every
        record gets ``tune/k`` and ``tune/j`` (the window in force for the grants after this step) and
        ``time/tune_s``, the time this hook held the learner's thread (a benchmark adds it to the steps' time)."""
        t0 = time.perf_counter()
        lengths = [list(r.sample_lengths()) for r in records if hasattr(r, "sample_lengths")]
        old = (self.tuner.k, self.tuner.j)
        move = self._step(metrics, lengths)
        if move is not None:
            self.admission.set_window(move.k, move.j)
            self.j_min = min(self.j_min, move.j)
            self.changes += 1
            metrics["tune/reason"] = move.reason
            self.say(f"window k {old[0]} -> {move.k}, j {old[1]} -> {move.j}: {move.reason}")
        metrics["tune/k"], metrics["tune/j"] = self.tuner.k, self.tuner.j
        metrics["time/tune_s"] = time.perf_counter() - t0

    def _step(self, metrics: dict, lengths: list):
        """The move this step puts in force, if any: decided here, or the decision process's latest reply."""
        if self.host is None:
            self.tuner.outlook = {}  # filled again only by a decision this step
            move = self.tuner.observe(metrics, lengths)
            _outlook(metrics, self.tuner.outlook)
            return move
        due = self.tuner.record(metrics, lengths)
        opened = self.tuner.opening_move()  # once, on the learner's thread: no decision waits for it (opening.py)
        if opened is not None:
            self.host.moved()  # a decision in flight judged the old window
            if due and self.host.ready():
                self.host.submit(self.tuner.state(), idle=True)  # the new window judged at once, on the same rates
            return opened
        if due and self.tuner.over_budget():  # the budget acts at once, not after a decision in flight (which,
            move = self.tuner.apply(self.tuner.drift_move())  # judged at the old window, is then ignored)
            if move is not None:
                self.host.moved()
            return move
        reply, move = self.host.poll(), None
        if reply is not None and "error" not in reply:
            metrics["tune/decide_s"] = reply["decide_s"]
            if "decide_cpu_s" in reply:
                metrics["tune/decide_cpu_s"] = reply["decide_cpu_s"]
            if tuple(reply["at"]) == (self.tuner.k, self.tuner.j):  # a reply on the window in force, not a stale one
                _outlook(metrics, reply.get("outlook", {}))
            move = self.tuner.take(reply)
            if move is not None:
                self.host.taken(reply)
        elif reply is not None:
            self.say(f"window tuner: {self.host.failed}; deciding on the learner's thread from here on")
            self.host.close()
            self.host = None
            return self._decide_here(metrics, due)
        if due and self.host.ready():
            # once the window has been judged, decisions run in the idle class (tuner_host.py: "Why the idle class")
            judged = self.changes > 0 or self.host.decisions > 0 or self.restored
            self.host.submit(self.tuner.state(), idle=judged)
        return move

    def _decide_here(self, metrics: dict, due: bool):
        """A decision on this thread when one is due (after the decision process failed): its move."""
        if not due:
            return None
        move = self.tuner.apply(self.tuner.decide())
        _outlook(metrics, self.tuner.outlook)
        return move

    def close(self) -> None:
        """Stop the decision process (the run ended)."""
        if self.host is not None:
            self.host.close()
            self.host = None

    def state(self) -> dict:
        """What a checkpoint keeps of the window: the ``(k, j)`` in force."""
        return {"k": int(self.tuner.k), "j": int(self.tuner.j)}

    def restore(self, state: Optional[dict]) -> None:
        """A resumed run goes on at the checkpoint's window (its tunable knobs, within the cap and the rules), not at
        the start one; a knob the launch pins keeps the launch's value. Like any move, later grants only."""
        t = self.tuner
        if not state:
            return
        t.opening = False  # the run opened before its checkpoint: it goes on from the window it had
        self.restored = True
        k = min(int(state.get("k", t.k)), t.cap) if t.tune_k else t.k
        j = k if t.tie_j else (int(state.get("j", t.j)) if t.tune_j else t.j)
        if (k, j) == (t.k, t.j) or not t.allows(k, j):
            return
        old = (t.k, t.j)
        self.admission.set_window(k, j)
        t.k, t.j = k, j
        t.k_range = [min(t.k_range[0], k), max(t.k_range[1], k)]
        t.j_range = [min(t.j_range[0], j), max(t.j_range[1], j)]
        self.j_min = min(self.j_min, j)
        self.say(f"window k {old[0]} -> {k}, j {old[1]} -> {j}: restored from the checkpoint")

    def summary(self) -> dict:
        t = self.tuner
        return {"window": {"k_range": list(t.k_range), "j_range": list(t.j_range), "changes": self.changes,
                          "k_final": t.k, "j_final": t.j}}


def _outlook(metrics: dict, outlook: dict) -> None:
    """A decision's predicted gains into the step's record: ``tune/gain_up`` (one step wider), ``tune/gain_far``
    (the doubled window), ``tune/gain_down`` (one step narrower); a window the decision did not predict is absent."""
    for side, gain in outlook.items():
        metrics[f"tune/gain_{side}"] = gain


def window_hook(cfg, admission, say, engines: int = 1, train_ranks: int = 1,
                background: bool = True) -> Optional[WindowHook]:
    """The hook for an auto window, None for a fixed one (nothing is measured or logged then). ``background``:
    decide in a process of its own (the run's way); False decides on the caller's thread, step for step."""
    return WindowHook(cfg, admission, say, engines, train_ranks, background) if cfg.rollout.window_auto else None


def buffer_bound(cfg) -> int:
    """The buffer's global guard: the cap while the window may move (each ticket's own k binds below it), else k."""
    r = cfg.rollout
    return r.max_staleness_cap if "k" in r.window_auto else r.max_staleness
