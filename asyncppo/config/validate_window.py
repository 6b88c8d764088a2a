"""``rollout.max_staleness=auto`` / ``rollout.admission_lookahead=auto`` / ``rollout.sync_every=auto``: the checks and
where the window starts.

Why a module of its own: ``auto`` is the one place a knob holds a word instead of a number, and every other check
and every consumer (workers, launch, the learner) reads ``max_staleness`` as an int. So ``auto`` is resolved here,
once, into the int the run starts from plus ``rollout.window_auto`` (which knobs the in-run tuner,
:mod:`asyncppo.pipeline.tuner`, may move); a dumped config reloads to the same values and the same tuning. An auto
``sync_every`` becomes 1 (a push every step until the engines' loads are measured) with ``rollout.sync_auto`` set
(the learner's push cadence, learner/push_cadence.py); every check reads it as 1, the cadence's floor, and the
cadence itself never exceeds the lookahead, so it can make no window invalid.

Where auto starts (docs/configuration.md): ``rollout.max_staleness_start`` where set (a preset that says ``auto``
names its start so), else the preset's number when the command line's ``auto`` replaced one (the loader reads it,
:func:`asyncppo.config.loader.load_config`), else :data:`AUTO_START_K`; always clipped to
``[sync_every - 1, max_staleness_cap]``. An auto lookahead starts at ``rollout.admission_lookahead_start``, else at
the preset's ``j`` if it set one, else at the start of ``k``; never above ``k``. A knob set to a number is pinned and
never moves (its start key is then ignored: pinning a preset's auto knob on the command line must not need a second
override).
"""

from __future__ import annotations

from typing import Optional

from asyncppo.config.checks import Checks
from asyncppo.config.schema import AsyncPPOConfig

AUTO = "auto"
AUTO_START_K = 4  # the documented start of an auto k when no preset number is known
# rollout.window_auto: "" (fixed window), "k" (k tuned, j pinned), "j" (j tuned, k pinned), "k=j" (k tuned, j follows
# it: the lookahead was null), "k,j" (both tuned independently)
WINDOW_AUTO = ("", "k", "j", "k=j", "k,j")


def sync_every_of(r) -> int:
    """``rollout.sync_every`` as the other checks read it: an auto cadence as 1, where it starts and its floor."""
    return r.sync_every if isinstance(r.sync_every, int) else 1  # another word: check_window refuses it


def effective(r) -> tuple[int, Optional[int]]:
    """The ints the other rollout checks test: an auto ``k`` as its start (unknown yet: the floor), an auto ``j``
    as null (= k)."""
    k = r.max_staleness if isinstance(r.max_staleness, int) else max(0, sync_every_of(r) - 1)
    j = r.admission_lookahead if isinstance(r.admission_lookahead, int) else None
    return k, j


def check_window(cfg: AsyncPPOConfig, c: Checks) -> None:
    r, a = cfg.rollout, cfg.algorithm
    for key, v in (("rollout.max_staleness", r.max_staleness), ("rollout.admission_lookahead", r.admission_lookahead)):
        if isinstance(v, str) and v != AUTO:
            c.error(key, v, 'must be an int or "auto" (the learner tunes it, docs/staleness.md)')
    if isinstance(r.sync_every, str) and r.sync_every != AUTO:
        c.error("rollout.sync_every", r.sync_every, 'must be an int >= 1 or "auto" (the learner sets the push '
                "cadence from the engines' load time, docs/staleness.md)")
    if r.sync_auto and r.sync_every not in (1, AUTO):
        c.error("rollout.sync_auto", r.sync_auto, f"is derived from rollout.sync_every=auto, and sync_every is "
                f"{r.sync_every}: set rollout.sync_every=auto (or a number, with sync_auto false)")
    s = sync_every_of(r)
    if r.max_staleness_cap < max(0, s - 1):
        c.error("rollout.max_staleness_cap", r.max_staleness_cap,
                f"must be >= 0 and >= rollout.sync_every - 1 = {s - 1} (the most an auto k may reach)")
    j_tuned = r.admission_lookahead == AUTO or r.window_auto == "j"  # "j": a saved config's, or a resolved one's
    if isinstance(r.max_staleness, int) and "k" not in r.window_auto and j_tuned and \
            r.max_staleness > r.max_staleness_cap:
        c.error("rollout.max_staleness", r.max_staleness,
                f"must be <= rollout.max_staleness_cap={r.max_staleness_cap} when the lookahead is auto (a preset's "
                "may be: data=long, data=guess, data=calculator): pin rollout.admission_lookahead too, or raise the "
                "cap")
    for key, v, tuned in (("rollout.max_staleness_start", r.max_staleness_start,
                           r.max_staleness == AUTO or "k" in r.window_auto),
                          ("rollout.admission_lookahead_start", r.admission_lookahead_start,
                           r.admission_lookahead == AUTO or r.window_auto in ("j", "k,j"))):
        if v is not None and not (isinstance(v, int) and v >= 0):
            c.error(key, v, "must be null or an int >= 0 (where an auto knob starts)")
        elif v is not None and v > r.max_staleness_cap and tuned:  # a lowered cap under a preset's start
            c.warn(f"{key}={v} is above rollout.max_staleness_cap={r.max_staleness_cap}: the auto window starts at "
                   "the cap")
    if r.tune_every < 1:
        c.error("rollout.tune_every", r.tune_every, "must be >= 1 (learner steps between two window decisions)")
    if a.offpolicy_budget is not None and not a.offpolicy_budget > 0:
        c.error("algorithm.offpolicy_budget", a.offpolicy_budget,
                "must be null (no cap) or > 0 (the most actor/mismatch_kl an auto window allows)")
    if r.window_auto not in WINDOW_AUTO:
        c.error("rollout.window_auto", r.window_auto, f"is derived from max_staleness/admission_lookahead=auto; one "
                f"of {', '.join(repr(w) for w in WINDOW_AUTO)}")


def resolve_window(cfg: AsyncPPOConfig, preset_k: Optional[int] = None, preset_j: Optional[int] = None) -> None:
    """Turn ``auto`` into the start value and record it in ``rollout.window_auto`` (``rollout.sync_auto`` for the
    push cadence), in place; idempotent (a resolved config has ints). Runs before the lookahead's own default (null:
    = k)."""
    r = cfg.rollout
    if r.sync_every == AUTO:
        r.sync_every, r.sync_auto = 1, True
    k_word, j_word = r.max_staleness == AUTO, r.admission_lookahead == AUTO
    if not (k_word or j_word):
        return
    # a saved config's tuning (ints and window_auto) under an override to auto: the knob left alone keeps its own
    # (keep_saved_tuning has already dropped what the overrides pinned), from the int it was saved with
    saved = r.window_auto
    if k_word and saved == "k=j" and isinstance(r.admission_lookahead, int):
        r.admission_lookahead = None  # j followed k when saved: it follows again
    k_auto = k_word or "k" in saved
    j_auto = j_word or (saved in ("k,j", "j") and isinstance(r.admission_lookahead, int))
    if k_auto and not k_word:
        preset_k = r.max_staleness
    if j_auto and not j_word:
        preset_j = r.admission_lookahead
    lo = max(0, r.sync_every - 1)
    if k_auto:  # at least a pinned lookahead (j <= k), at most the cap
        floor = max(lo, r.admission_lookahead if isinstance(r.admission_lookahead, int) and not j_auto else 0)
        start = _first_of(r.max_staleness_start, preset_k, AUTO_START_K)
        r.max_staleness = max(floor, min(start, r.max_staleness_cap))
    if j_auto:
        start = _first_of(r.admission_lookahead_start, preset_j, r.max_staleness)
        r.admission_lookahead = min(max(lo, start), r.max_staleness)
    r.window_auto = ("k,j" if j_auto else "k=j" if r.admission_lookahead is None else "k") if k_auto else "j"


def keep_saved_tuning(r, k_word: Optional[str], j_word: Optional[str]) -> None:
    """A saved config (its knobs ints, ``rollout.window_auto`` saying which were tuned) composed again under
    command-line overrides of the window (``k_word`` / ``j_word``: the overrides' values, None where there is
    none): a knob an override sets to a number (``j``: or to null, which makes it follow ``k``) is pinned now, so
    its letter leaves ``window_auto``; a knob set to ``auto`` is resolved again by :func:`resolve_window`, where
    the other keeps the tuning it was saved with. Without this a reloaded ``config.yaml`` (its ``data=long`` window
    saved as ``k,j``) kept moving a window the command line had pinned, and ``max_staleness=auto`` over it pinned
    its lookahead."""
    letters = r.window_auto
    if k_word is not None and k_word != AUTO:
        if letters == "k=j" and j_word is None:
            r.admission_lookahead = None  # j followed k when saved: it follows the pinned k
        letters = {"k,j": "j", "k": "", "k=j": ""}.get(letters, letters)
    if j_word is not None and j_word != AUTO:
        if j_word == "null":
            letters = "k=j" if "k" in letters else ""
        else:
            letters = {"k,j": "k", "j": "", "k=j": "k"}.get(letters, letters)
    r.window_auto = letters
    # what stays tuned starts from its saved int, fitted to what the command line pinned, as a fresh launch's start
    # is (resolve_window): a tuned j no wider than a pinned k, a tuned k no narrower than a pinned j, within the cap
    k, j = r.max_staleness, r.admission_lookahead
    if not (isinstance(k, int) and isinstance(j, int)):
        return  # an auto word is left: resolve_window starts it
    if "k" in letters:
        r.max_staleness = k = max(min(k, r.max_staleness_cap), j if letters == "k" else 0)
    if letters in ("j", "k,j"):
        r.admission_lookahead = min(j, k)


def _first_of(*values: Optional[int]) -> int:
    """The first value that is set: an explicit start key, then the preset's number, then the default."""
    return next(v for v in values if v is not None)


def widest_lookahead(r) -> int:
    """The largest admission lookahead ``j`` a run may come to (``r``: a resolved ``rollout`` section): ``j`` itself
    while it is fixed; under an auto lookahead the staleness cap when ``k`` moves too, the pinned ``k`` when only ``j``
    does (``j <= k``). What is sized once at the start for the episodes a worker may hold (its ticket cap,
    ``env.max_concurrency``) is sized by this: sized by the start's ``j``, a guess run behind a 200 ms tool that auto
    widened to ``k = j = 4`` held as few episodes as at ``j = 1``."""
    if "j" not in r.window_auto:
        return r.admission_lookahead
    return r.max_staleness if r.window_auto == "j" else r.max_staleness_cap
