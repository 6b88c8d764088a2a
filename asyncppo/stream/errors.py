"""The error type of the stream wire format, in its own module so that :mod:`asyncppo.stream.wire` and
:mod:`asyncppo.stream.spans` can both raise it without importing each other. Import it from
:mod:`asyncppo.stream.wire`, which re-exports it."""

from __future__ import annotations

#: Reason codes carried by :class:`WireError`.
REASONS = ("malformed", "oversized", "version", "schema")


class WireError(ValueError):
    """A message that must be rejected. ``reason`` is one of :data:`REASONS`; ``detail`` says what and why."""

    def __init__(self, reason: str, detail: str = ""):
        if reason not in REASONS:
            raise ValueError(f"unknown WireError reason {reason!r}; allowed: {REASONS}")
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)
