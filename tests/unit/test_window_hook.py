"""The learner's window hook (asyncppo/learner/window.py) on a real admission controller: every step's record
carries the window, a move reaches the controller and the console with its reason, a fixed window has no hook, and
the summary table gives the range the window took (launch/console.py)."""

from __future__ import annotations

import random

from asyncppo.config.loader import load_config
from asyncppo.launch.console import window_row
from asyncppo.learner.window import buffer_bound, window_hook
from asyncppo.pipeline.tuner import Move
from asyncppo.staleness.controller import AdmissionController


class _Group:
    def __init__(self, lengths):
        self._lengths = lengths

    def sample_lengths(self):
        return self._lengths


def _step(rng, B=2):
    """A generation-bound step (the learner waits on a slow engine): the tuner should widen."""
    running = rng.uniform(10, 60)
    metrics = {"rollout/decode_step_s": 0.002 + 0.0004 * running, "rollout/running_mean": running,
               "response_length/mean": 30.0, "time/step_s": 0.05, "time/wait_s": 0.0, "actor/mismatch_kl": 0.0}
    groups = [_Group([max(2, min(400, int(rng.lognormvariate(3.0, 1.0)))) for _ in range(4)]) for _ in range(B)]
    return metrics, groups


def test_moves_reach_the_controller_the_console_and_every_record():
    cfg = load_config(["rollout.max_staleness=auto", "rollout.tune_every=3", "rollout.rollout_batch_size=2",
                       "rollout.num_return_sequences_in_group=4", "rollout.max_staleness_cap=4",
                       "rollout.max_num_seqs=64"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append)
    rng, records = random.Random(0), []
    for _ in range(60):
        metrics, groups = _step(rng)
        hook.after_step(metrics, groups)
        assert (metrics["tune/k"], metrics["tune/j"]) == (adm.k, adm.j)  # the record says what is in force
        records.append(metrics)
    assert said and all(line.startswith("window k ") and ": " in line for line in said), said
    assert len([r for r in records if "tune/reason" in r]) == len(said) == hook.changes
    assert 1 < adm.k <= 4 and adm.j == adm.k  # widened from 1, a null lookahead follows k, the cap holds
    assert hook.summary()["window"]["k_range"] == [1, adm.k]
    assert hook.j_min == 1  # what a coalesced push is checked against: the smallest j ever in force (loop.py)
    what, value = window_row(records)
    assert what.startswith("window k / j") and value.startswith(f"k 1 -> {adm.k} (1..{adm.k})")


def test_a_fixed_window_has_no_hook_and_the_buffer_guard_is_the_cap_only_under_auto():
    fixed = load_config(["rollout.max_staleness=3"])
    assert window_hook(fixed, None, print) is None and buffer_bound(fixed) == 3 and window_row([{"step": 1}]) is None
    auto = load_config(["rollout.max_staleness=auto", "rollout.max_staleness_cap=9"])
    assert buffer_bound(auto) == 9


def test_a_lowered_lookahead_is_what_a_coalesced_push_must_still_serve():
    """Tickets keep the j of their grant, so after a lowering the push check uses the lower j; after a raise the
    older, lower j still holds for tickets granted before it (j_min never rises)."""
    cfg = load_config(["rollout.max_staleness=auto", "rollout.max_staleness_cap=6"])
    adm = AdmissionController(cfg.rollout.rollout_batch_size, cfg.rollout.max_staleness)
    hook = window_hook(cfg, adm, lambda _line: None)
    for move, j_min in ((Move(3, 3, "up"), 1), (Move(0, 0, "down"), 0), (Move(2, 2, "up"), 0)):
        hook.tuner.observe = lambda *_a, m=move: m  # the decision itself is test_window_tuner.py's
        hook.after_step({}, [])
        assert (adm.k, adm.j, hook.j_min) == (move.k, move.j, j_min)


def test_a_resumed_run_goes_on_at_the_checkpoints_window_and_pinned_knobs_keep_the_launchs():
    """The hook's state is what a checkpoint keeps (llm_workload.py: trainer state 'window'); restored, the window
    moves to it for later grants, says so, and keeps every rule: a pinned lookahead stays, the cap holds, an old
    checkpoint without a window changes nothing."""
    cfg = load_config(["rollout.max_staleness=auto", "rollout.rollout_batch_size=2", "rollout.max_staleness_cap=6"])
    adm = AdmissionController(2, cfg.rollout.max_staleness, lookahead=cfg.rollout.admission_lookahead)
    said: list[str] = []
    hook = window_hook(cfg, adm, said.append)
    assert hook.state() == {"k": 1, "j": 1}
    hook.restore(None)  # a checkpoint from before this field, or a fixed window's
    assert (adm.k, adm.j) == (1, 1) and not said
    hook.restore({"k": 4, "j": 4})
    assert (adm.k, adm.j) == (4, 4) and hook.state() == {"k": 4, "j": 4}
    assert said == ["window k 1 -> 4, j 1 -> 4: restored from the checkpoint"]
    assert hook.summary()["window"]["k_range"] == [1, 4] and hook.j_min == 1
    hook.restore({"k": 40, "j": 40})  # past the cap: held at it
    assert (adm.k, adm.j) == (6, 6)

    pinned = load_config(["rollout.max_staleness=auto", "rollout.admission_lookahead=1",
                          "rollout.rollout_batch_size=2"])
    adm2 = AdmissionController(2, pinned.rollout.max_staleness, lookahead=1)
    hook2 = window_hook(pinned, adm2, said.append)
    hook2.restore({"k": 5, "j": 3})
    assert (adm2.k, adm2.j) == (5, 1)  # k was tuned and comes back; the pinned j stays the launch's
