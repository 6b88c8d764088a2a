"""sync/reload_quiet.py: vLLM's reload warnings are dropped inside the block, for the thread inside it only, and
logger levels are never touched (setLevel cleared every logger's cache at each weight push)."""

from __future__ import annotations

import logging
import threading

from asyncppo.sync.reload_quiet import RELOAD_LOGGERS, quiet_reload


def _pinned(name: str) -> tuple[logging.Logger, tuple]:
    """The logger with its own level at DEBUG, enabled, and no process-wide ``logging.disable`` (returned: what to
    restore). What the filter does is the question here; the process's logging state is whatever earlier tests and
    imports left (vLLM's logging config reads ``VLLM_LOGGING_LEVEL``, which importing TRL sets to ERROR), and at
    ERROR the warnings this test counts never reach the handler, quiet block or not (seen in a full-suite run)."""
    log = logging.getLogger(name)
    saved = (log.level, log.disabled, logging.root.manager.disable)
    log.setLevel(logging.DEBUG)
    log.disabled = False
    logging.disable(logging.NOTSET)
    return log, saved


def _restore(log: logging.Logger, saved: tuple) -> None:
    level, disabled, disable = saved
    log.setLevel(level)
    log.disabled = disabled
    logging.disable(disable)


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_warnings_are_dropped_inside_the_block_only_for_its_thread_and_errors_pass():
    log, restore = _pinned(RELOAD_LOGGERS[0])
    handler, level = _Collect(), log.level
    log.addHandler(handler)
    try:
        log.warning("before")
        with quiet_reload():
            log.warning("Decoder: Failed to load weights")
            log.error("a real error")
            other = threading.Thread(target=lambda: log.warning("another thread"))
            other.start()
            other.join()
            assert log.level == level  # no setLevel
        log.warning("after")
        with quiet_reload(enabled=False):
            log.warning("not quiet")
    finally:
        log.removeHandler(handler)
        _restore(log, restore)
    assert handler.messages == ["before", "a real error", "another thread", "after", "not quiet"]


def test_nested_blocks_restore_the_outer_state():
    log, restore = _pinned(RELOAD_LOGGERS[1])
    handler = _Collect()
    log.addHandler(handler)
    try:
        with quiet_reload():
            with quiet_reload():
                log.warning("inner")
            log.warning("outer")
        log.warning("outside")
    finally:
        log.removeHandler(handler)
        _restore(log, restore)
    assert handler.messages == ["outside"]
