"""A pump thread from a :class:`~asyncppo.stream.channels.TrajectoryReceiver` into a
:class:`~asyncppo.staleness.buffer.StalenessBuffer`, for the learner process.

Why a thread: the learner's PPO step takes seconds; the socket must keep being read meanwhile, or the workers stall
on the high-water mark even though the buffer has room. When the buffer *is* full the pump blocks in ``put`` and
stops reading, which is exactly the backpressure we want.

Content validation happens here, between the socket and the buffer: with a ``validator`` (a
:class:`asyncppo.stream.validate.Door`: ``GroupValidator`` for trajectory groups, ``SegmentDoor`` for embodied
segments) every record is checked and a refused one is counted and dropped,
so nothing that reaches the buffer (and so a batch) is unchecked, and no message can stop the pump. ``summary``
(:class:`asyncppo.stream.validate.RejectionSummary`) is polled every turn to log one line per interval.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional

from asyncppo.staleness.buffer import BufferClosed, StalenessBuffer
from asyncppo.stream.channels import TrajectoryReceiver

log = logging.getLogger(__name__)


class Feeder:
    """Runs ``receiver -> buffer`` in a daemon thread. Owns neither: closing the feeder stops the pump only."""

    def __init__(self, receiver: TrajectoryReceiver, buffer: StalenessBuffer, poll_ms: int = 50,
                 validator=None, summary=None):
        self.receiver = receiver
        self.buffer = buffer
        self.validator = validator  # .check(record) -> None (accept) or the counted error
        self.summary: Optional[object] = summary  # .poll(): the rate-limited rejection log line
        self._poll_ms = poll_ms
        self._stop = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="trajectory-feeder", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                group = self.receiver.recv(timeout_ms=self._poll_ms)
                if self.summary is not None:
                    self.summary.poll()
                if group is None:
                    continue
                if self.validator is not None and self.validator.check(group) is not None:
                    continue  # refused: counted by the validator
                # Retry in short slices so that close() is noticed even while the buffer stays full.
                while not self.buffer.put(group, timeout_s=self._poll_ms / 1000):
                    if self._stop.is_set():
                        log.warning("feeder stopped with group %s still in hand", group.group_id)
                        return
        except BufferClosed:
            pass
        except BaseException as e:  # surfaced to the learner through .error / alive
            self.error = e
            log.exception("trajectory feeder crashed")

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)
