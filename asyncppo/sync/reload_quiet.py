"""Silence vLLM's per-layer warnings while a deliberate partial reload runs, without touching logger levels.

A partial in-place reload (:mod:`asyncppo.sync.engine_load`, :mod:`asyncppo.rollout.tp_load`) makes vLLM 0.32 log
"<Layer>: Failed to load weights" for every layer it does not touch; the load was validated beforehand, so those
lines are noise. They used to be silenced with ``Logger.setLevel`` around each reload, but ``setLevel`` clears the
level cache of every logger in the process (thousands once vLLM, Ray and transformers are imported): measured at
3.2 ms of a 16 ms reload of the 0.5M-parameter model, paid at every weight push. A filter installed once costs a
flag check per record.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator

RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                  "vllm.model_executor.model_loader.reload.inplace")


class _BelowErrorWhileQuiet(logging.Filter):
    """Drops records below ERROR from the thread that is inside :func:`quiet_reload`."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    @property
    def quiet(self) -> bool:
        return getattr(self._local, "quiet", False)

    @quiet.setter
    def quiet(self, value: bool) -> None:
        self._local.quiet = value

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not self.quiet


_FILTER = _BelowErrorWhileQuiet()
for _name in RELOAD_LOGGERS:  # once, at import: outside quiet_reload the filter passes everything
    logging.getLogger(_name).addFilter(_FILTER)


@contextlib.contextmanager
def quiet_reload(enabled: bool = True) -> Iterator[None]:
    """Within the block, this thread's warnings from vLLM's reload loggers are dropped (errors still pass)."""
    if not enabled:
        yield
        return
    before, _FILTER.quiet = _FILTER.quiet, True
    try:
        yield
    finally:
        _FILTER.quiet = before
