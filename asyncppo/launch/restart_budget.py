"""How many rollout-worker replacements a run may still spend: ``cluster.max_worker_restarts`` within any
``cluster.worker_restart_window_s`` seconds (null: in the whole run).

Why a window: a long run on many machines sees workers die now and then (a preempted node, an engine that ran out
of memory on one prompt, a network fault), hours apart, and each replacement costs an engine start-up, not the run;
a budget for the whole run would end a week-long run at its fourth such death. What the budget must still stop is a
crash loop: a worker that dies again as soon as it is replaced (a bad model path on one node, a prompt that kills
the engine every time it is drawn), where every further replacement is wasted. Such a loop spends the budget within
minutes, so counting only the replacements of the last hour (the default) ends it as quickly as a whole-run budget
would, while sporadic deaths never add up. A pure object with an injectable clock: tests/unit/test_restart_budget.py.
"""

from __future__ import annotations

import collections
import time
from typing import Callable, Optional


class RestartBudget:
    def __init__(self, limit: int, window_s: Optional[float], clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self.clock = limit, window_s, clock
        self._times: collections.deque[float] = collections.deque()  # when each replacement within the window was

    def recent(self) -> int:
        """Replacements that count now: those within the window (all of them without one)."""
        if self.window_s is not None:
            horizon = self.clock() - self.window_s
            while self._times and self._times[0] <= horizon:
                self._times.popleft()
        return len(self._times)

    def take(self) -> bool:
        """Spend one replacement; False (and nothing spent) when ``limit`` of them already count."""
        if self.recent() >= self.limit:
            return False
        self._times.append(self.clock())
        return True

    def span(self) -> str:
        """How the limit is counted, in words: ``""`` (the whole run) or ``" within 3600s"``."""
        return "" if self.window_s is None else f" within {self.window_s:.0f}s"
