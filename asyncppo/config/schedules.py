"""Named generation schedules: the overrides that turn one task's config into synchronous PPO, whole-batch
asynchronous PPO or continuous asynchronous PPO, for runs that compare them on the same task, model and seed.

Why in the package: the async-against-sync benchmark (asyncppo/bench/async_sync.py) and the self-test's
``data=long`` rung must mean the same thing by "sync"; one table keeps them from drifting apart.

``{k}`` is ``rollout.max_staleness`` and ``{j}`` the admission lookahead; ``rollout.admission_lookahead=null`` resets a
preset's lookahead (e.g. ``data=long`` sets one) so that the window is ``k``.
"""

from __future__ import annotations

NO_LOOKAHEAD = "rollout.admission_lookahead=null"
SCHEDULES = {
    # generate a batch, train on it, repeat
    "sync": ["rollout.max_staleness=0", NO_LOOKAHEAD, "rollout.generation=batch", "rollout.inflight_update=off"],
    # k versions of lag, weights loaded between whole batches
    "async-batch": ["rollout.max_staleness={k}", NO_LOOKAHEAD, "rollout.generation=batch",
                    "rollout.inflight_update=off"],
    # continuous generation with in-flight weight updates
    "async-cont": ["rollout.max_staleness={k}", NO_LOOKAHEAD, "rollout.generation=continuous",
                   "rollout.inflight_update=keep"],
    # async-cont, with a push skipped while the previous one is still loading (learner/loop.py: _may_coalesce)
    "async-cont-coalesce": ["rollout.max_staleness={k}", NO_LOOKAHEAD, "rollout.generation=continuous",
                            "rollout.inflight_update=keep", "rollout.coalesce_pushes=true"],
    # async-cont admitting only j versions ahead (fresh samples), stragglers still allowed up to k
    "async-cont-lookahead": ["rollout.max_staleness={k}", "rollout.generation=continuous",
                             "rollout.inflight_update=keep", "rollout.admission_lookahead={j}"],
}


def schedule_overrides(name: str, k: int = 0, j: int = 0) -> list[str]:
    """The overrides of schedule ``name`` at staleness bound ``k`` and lookahead ``j``."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    return [o.format(k=k, j=j) for o in SCHEDULES[name]]
