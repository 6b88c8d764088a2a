"""Builds, beside a whole-suite run, the built-in models the end-to-end launches will ask for (``python -m
prebuild_models``, started by tests/conftest.py in a session with component tests before its e2e ones).

Why: on a fresh machine, as in CI, the first launch of each preset built its model inside the test, one after the
other on the suite's critical path: tiny-addition 94 s, tiny-calculator 109 s, tiny-reverse 63 s, tiny-moe 50 s,
tiny-long 40 s (build.json's ``build_s``, the whole suite on a fresh 2-core box, 2026-11-30), ~6 min of a 66-min CI
run. The component tests, which run first, leave a core idle much of the time (they wait on sockets, deadlines and
engine start-ups); this process builds in that idle time, at the lowest CPU priority and on one torch thread, so
that a busy test gives up almost nothing to it. A test that reaches a model before this process finished it builds
the model itself, as before (:func:`asyncppo.data.tiny.ensure_builtin_model` builds into a temporary directory and
renames it; the second rename finds the first's result and keeps it). The cache is the one the launches read
(``ASYNCPPO_CACHE``, else ``~/.cache/asyncppo``); a model already there costs nothing. What it built, or why not, is in
``<tmp>/asyncppo-prebuild.log`` (the system's temporary directory; rewritten by each session).
"""

from __future__ import annotations

import os
import signal
import sys


def presets() -> list[tuple[str, ...]]:
    """The launches' presets, in the order the e2e tests first ask for their models (tests/e2e, file order): the
    calculator, the default task, data=reverse, data=long at the warm start test_e2e_long.py uses, tiny-moe."""
    from test_e2e_long import WARMUP  # the long run's own constant, so that the two cannot drift apart

    return [("data=calculator",), (), ("data=reverse",), ("data=long", f"trainer.sft_warmup_steps={WARMUP}"),
            ("model.path=builtin:tiny-moe",)]


def _lowest_priority() -> None:
    """SCHED_IDLE where the kernel has it, else nice 19. Nice 19 is not low enough beside a launch: Ray starts its
    actors at nice 15, and nice 19 against 15 is a weight of 15 against 36, ~30% of a core the launch also wants;
    SCHED_IDLE (a weight of 3) takes ~8% of it, and still all of an idle core."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        os.nice(19)


def main() -> int:
    # stopped by the session's end: leave by an exception, so that a build in progress removes its temporary directory
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    _lowest_priority()
    import torch

    from asyncppo.config.loader import load_config
    from asyncppo.data.tiny import model_of

    torch.set_num_threads(1)
    failed = 0
    for overrides in presets():
        name = " ".join(overrides) or "default"
        try:  # one that fails is built inside its launch, as before; the others are still built here
            cfg = load_config(list(overrides))
            path = model_of(cfg)
            print(f"[prebuild] {name}: {path}", flush=True)
        except Exception as exc:  # noqa: BLE001 (reported in the log, never raised into the test session)
            failed += 1
            print(f"[prebuild] {name}: FAILED: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
