"""The learner's door: content, identity and ticket checks of every record that enters it (:class:`Door`, with
:class:`GroupValidator` for trajectory groups and :class:`SegmentDoor` for embodied segments), and the rate-limited
summary of rejections.

Why a second check after :func:`asyncppo.stream.wire.decode_group`: the decoder proves a frame is *well formed*
(types, dtypes, exact length, zero padding, version-span rules). It cannot know what the learner knows: the
tokenizer's vocabulary, the configured lengths, the current policy version, which tickets are outstanding and who
holds them, which group ids were already seen. A well-formed group can still carry a NaN reward, a log-prob of
+3, a token id past the embedding table or a version from the future, and any of those would reach a training
batch (an index error in the embedding, a NaN loss, a ratio ``exp(logp - behaviour)`` of zero). So every group
passes :meth:`GroupValidator.check` between the socket and the staleness buffer; a bad one is counted by reason
and dropped, never raised. The checks are a fixed number of numpy reductions per group (no per-token Python).

Tickets. The validator does not own admission state (stream/ knows nothing of staleness/): it asks a
:class:`TicketLedger` (the admission server) to *claim* the group's ticket, which succeeds once, for the worker
the ticket was granted to, and only if the group's oldest token is not older than the ticket's ``min_version``.
A group refused for its content gives its ticket back (``forfeit``) when the ticket is held by the group's
worker, so a worker's bug costs a regenerated slot, not a learner that waits for a group that will never come.

Log-prob tolerance. A log-prob is ``<= 0`` in exact arithmetic; engines compute it in floating point, where a
token of probability ~1 can come out a hair above zero. ``logprob_tolerance`` (``cluster.logprob_tolerance``) is
that hair; anything above it is a broken or hostile record.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Protocol

import numpy as np

from asyncppo.stream.group_ids import parse_key
from asyncppo.stream.records import TrajectoryGroup
from asyncppo.stream.routing import content_problem as routing_problem
from asyncppo.stream.segments import EnvSegment
from asyncppo.stream.turns import turn_content_problem

log = logging.getLogger(__name__)

#: Reason codes of :class:`GroupValidator` (the wire decoder's are :data:`asyncppo.stream.errors.REASONS`).
CONTENT_REASONS = (
    "nonfinite",  # NaN/inf reward, log-prob or timing
    "logprob",  # a log-prob above logprob_tolerance
    "token_id",  # a prompt or response token id outside [0, vocab_size)
    "length",  # empty prompt, prompt/response longer than configured, too many samples
    "version",  # a version newer than the learner's, or older than the ticket's min_version
    "ticket",  # ticket not outstanding, already delivered (duplicate) or never granted
    "worker",  # ticket granted to another worker, or worker_id out of range
    "duplicate",  # group_id seen before
    "group_id",  # a group id not of the form "<worker>[.<incarnation>]-<draw>" naming the sender's own worker_id
    "routing",  # MoE routing column: missing, unexpected, wrong shape, expert id out of range (stream/routing.py)
    "turns",  # multi-turn episode: bad environment segments, env log-prob != 0, turn rewards != reward
    "error",  # a check itself failed unexpectedly (a bug, logged with its traceback): refused all the same
)


@dataclass(frozen=True)
class ContentLimits:
    """What a valid group may contain (from the tokenizer and the config; see :func:`limits_from_config`)."""

    vocab_size: int  # token ids must lie in [0, vocab_size)
    max_prompt_len: int
    max_response_len: int
    max_samples: int  # samples per group
    num_workers: Optional[int] = None  # worker_id must lie in [0, num_workers) when given
    logprob_tolerance: float = 0.01
    # (layers, top_k, num_experts) of the model whose engine routing the groups carry; None: groups carry none
    routing: Optional[tuple[int, int, int]] = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_prompt_len", "max_response_len", "max_samples"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"ContentLimits.{name} must be an int >= 1, got {v!r}")
        if not (self.logprob_tolerance >= 0 and np.isfinite(self.logprob_tolerance)):
            raise ValueError(f"ContentLimits.logprob_tolerance must be finite and >= 0, got {self.logprob_tolerance}")


class TicketLedger(Protocol):
    """What the validator needs from admission control (implemented by the admission server)."""

    def claim(self, index: int, worker_id: int, version_min: int) -> Optional[str]:
        """Mark ticket ``index`` delivered by ``worker_id``; None on success, else a reason from
        :data:`CONTENT_REASONS` ("ticket", "worker" or "version"). Succeeds at most once per grant."""

    def forfeit(self, index: int, worker_id: int) -> bool:
        """Give back a ticket still held by ``worker_id`` whose group was refused; False if it is not."""


class ContentError(ValueError):
    """Why a group was refused (``reason`` is one of :data:`CONTENT_REASONS`)."""

    def __init__(self, reason: str, detail: str):
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}")


def _arrays(group: TrajectoryGroup):
    """(response ids, log-probs, per-sample lengths, rewards, vmin, vmax) from the group's columns (no Sample
    objects are built for a group that arrived columnar)."""
    c = group.as_columns()
    return c.response_ids, c.behavior_logprobs, c.lengths(), c.reward, c.version_min, c.version_max


def check_content(group: TrajectoryGroup, limits: ContentLimits, learner_version: int) -> None:
    """Raise :class:`ContentError` if ``group``'s content breaks ``limits`` (stateless checks only)."""
    ids, lps, lengths, rewards, vmin, vmax = _arrays(group)
    n = len(lengths)
    if n < 1 or n > limits.max_samples:
        raise ContentError("length", f"{n} samples; a group has 1..{limits.max_samples}")
    prompt = np.asarray(group.prompt_ids)
    if prompt.shape[0] < 1 or prompt.shape[0] > limits.max_prompt_len:
        raise ContentError("length", f"prompt of {prompt.shape[0]} tokens; allowed 1..{limits.max_prompt_len}")
    if max(lengths) > limits.max_response_len:
        raise ContentError("length", f"a response of {max(lengths)} tokens > {limits.max_response_len}")
    if limits.num_workers is not None and not 0 <= group.worker_id < limits.num_workers:
        raise ContentError("worker", f"worker_id {group.worker_id} not in [0, {limits.num_workers})")
    if not np.isfinite(np.asarray(rewards, dtype=np.float64)).all():
        raise ContentError("nonfinite", f"rewards {list(rewards)}")
    if group.timings and not np.isfinite(np.fromiter(group.timings.values(), np.float64)).all():
        raise ContentError("nonfinite", f"timings {group.timings}")
    if lps.shape[0]:
        if not np.isfinite(lps).all():
            raise ContentError("nonfinite", "a behaviour log-prob is NaN or infinite")
        top = float(lps.max())
        if top > limits.logprob_tolerance:
            raise ContentError("logprob", f"log-prob {top:.4g} > tolerance {limits.logprob_tolerance}")
    for name, arr in (("prompt", prompt), ("response", ids)):
        if arr.shape[0] and (int(arr.min()) < 0 or int(arr.max()) >= limits.vocab_size):
            raise ContentError("token_id", f"{name} token ids span [{int(arr.min())}, {int(arr.max())}], "
                                           f"vocabulary is [0, {limits.vocab_size})")
    newest = max(vmax)
    if newest > learner_version or min(vmin) < 0:
        raise ContentError("version", f"versions [{min(vmin)}, {newest}] outside [0, learner version "
                                      f"{learner_version}]")
    problem = routing_problem(group.routing, limits.routing, prompt.shape[0], lengths)
    if problem is not None:
        raise ContentError("routing", problem)
    if group.turn_columns() is not None:  # a multi-turn episode (asyncppo.stream.turns)
        # a columnar group came off the wire, whose decoder checked the segments' structure already
        problem = turn_content_problem(group.as_columns(), structure_checked=group.columns is not None)
        if problem is not None:
            raise ContentError(*problem)
    # last, so a group with other faults is refused for those (stream/group_ids.py says why ids have a form)
    owner = parse_key(group.group_id)
    if owner is None or owner[0] != group.worker_id:
        raise ContentError("group_id", f"group id {str(group.group_id)[:40]!r} is not '<worker>[.<incarnation>]-"
                                       f"<draw>' of worker {group.worker_id}")


class Door:
    """The one pattern by which a record enters the learner: its content is checked, its id is accepted once, and
    its ticket is claimed from the ledger; a refused record is counted by reason, its worker's ticket is given
    back, and the refusal is *returned*, never raised (a check that fails unexpectedly is refused as ``"error"``
    and logged with its traceback). Thread-safe.

    A record type plugs in by subclassing: :attr:`record_type` (records of other types are not this door's and
    pass), :meth:`check_content` (raise :class:`ContentError`) and :meth:`record_id`. ``current_version()`` is the
    learner's policy version; ``ledger`` the admission server (None: tickets are not checked)."""

    record_type: type = object
    noun = "record"  # how log lines and errors name a record and its id field
    id_field = "id"
    #: Check the id before the content (a replayed record is named a duplicate whatever else is wrong with it).
    id_first = False
    #: Level of the per-refusal log line (DEBUG where a rate-limited :class:`RejectionSummary` reports instead).
    refusal_log_level = logging.DEBUG

    def __init__(self, current_version: Callable[[], int], ledger: Optional[TicketLedger] = None):
        self.current_version = current_version
        self.ledger = ledger
        self.counts: dict[str, int] = {r: 0 for r in CONTENT_REASONS}
        self.accepted = 0
        self.forfeited = 0  # tickets given back because their holder's record was refused
        self.last_error: Optional[ContentError] = None
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def check_content(self, record, learner_version: int) -> None:
        """Raise :class:`ContentError` if ``record``'s content may not be trained on (stateless checks)."""

    def record_id(self, record) -> str:
        return record.group_id

    def admit(self, record) -> Optional[ContentError]:
        """None if ``record`` may enter the buffer (its ticket is then claimed); else the counted error."""
        if not isinstance(record, self.record_type):
            return None
        try:
            if not self.id_first:
                self.check_content(record, self.current_version())
            with self._lock:
                rid = self.record_id(record)
                if rid in self._seen:
                    raise ContentError("duplicate", f"{self.id_field} {rid!r} was seen before")
                if self.id_first:
                    self.check_content(record, self.current_version())
                if self.ledger is not None:
                    why = self.ledger.claim(record.ticket, record.worker_id, record.version_min)
                    if why is not None:
                        raise ContentError(why, f"ticket {record.ticket} of worker {record.worker_id} "
                                                f"({self.noun} {rid!r})")
                self._seen.add(rid)
                self.accepted += 1
            return None
        except ContentError as e:
            self._refuse(record, e)
            return e
        except Exception as e:  # never let a check stop the learner's intake
            log.exception("content check of %r failed", getattr(record, "group_id", "?"))
            err = ContentError("error", f"{type(e).__name__}: {e}")
            self._refuse(record, err)
            return err

    def _refuse(self, record, err: ContentError) -> None:
        with self._lock:
            self.counts[err.reason] += 1
            self.last_error = err
            # The worker's own ticket comes back so its slot is regenerated; a ticket claimed already, or held by
            # someone else, is left alone (forfeit refuses both).
            if self.ledger is not None and err.reason not in ("ticket", "worker", "duplicate"):
                if self.ledger.forfeit(record.ticket, record.worker_id):
                    self.forfeited += 1
        log.log(self.refusal_log_level, "refused %s %r of worker %s (ticket %s): %s", self.noun,
                getattr(record, "group_id", "?"), getattr(record, "worker_id", "?"), getattr(record, "ticket", "?"),
                err)

    @property
    def num_rejected(self) -> int:
        return sum(self.counts.values())


class GroupValidator(Door):
    """The door for trajectory groups: :func:`check_content` against ``limits``, then identity and ticket."""

    record_type = TrajectoryGroup
    noun, id_field = "group", "group_id"

    def __init__(self, limits: ContentLimits, current_version: Callable[[], int],
                 ledger: Optional[TicketLedger] = None):
        super().__init__(current_version, ledger)
        self.limits = limits

    @property
    def rejected(self) -> dict[str, int]:
        """Refusals by reason, every reason of :data:`CONTENT_REASONS` present (zeros included)."""
        return self.counts

    def check_content(self, record: TrajectoryGroup, learner_version: int) -> None:
        check_content(record, self.limits, learner_version)

    def check(self, group: TrajectoryGroup) -> Optional[ContentError]:
        """None if ``group`` may enter the buffer (its ticket is then claimed); else the counted error.
        Records of other types (e.g. env segments on the same stream) are not this validator's and pass."""
        return self.admit(group)


class SegmentDoor(Door):
    """The door for embodied transition segments. Their content (finite values, shapes, the learner's spaces) was
    checked when they were decoded (:func:`asyncppo.stream.segments.decode_segment`); here no step may carry a
    version newer than the learner's, a segment id is accepted once (checked first), and the admission ledger must
    know the worker holds the ticket and that its first step honours the ticket's ``min_version``. Claiming also
    frees the worker's per-connection ticket allowance (``cluster.max_tickets_per_worker``)."""

    record_type = EnvSegment
    noun, id_field = "segment", "segment_id"
    id_first = True
    refusal_log_level = logging.WARNING

    def __init__(self, ledger: TicketLedger, current_version: Callable[[], int]):
        super().__init__(current_version, ledger)

    @property
    def rejected(self) -> collections.Counter:
        """Refusals by reason, only the reasons that happened."""
        return collections.Counter({r: n for r, n in self.counts.items() if n})

    def record_id(self, record: EnvSegment) -> str:
        return record.segment_id

    def check_content(self, record: EnvSegment, learner_version: int) -> None:
        if record.version_max > learner_version:
            raise ContentError("version", f"segment version {record.version_max} > learner version "
                                          f"{learner_version}")

    def check(self, seg: EnvSegment) -> Optional[str]:
        """None if ``seg`` may enter the buffer, else the reason it was refused (counted)."""
        err = self.admit(seg)
        return None if err is None else err.reason


class RejectionSummary:
    """One log line per ``interval_s`` with the rejections counted since the last line, by source and reason.

    A hostile or broken peer can send thousands of bad messages a second; a warning per message would flood the
    log and cost more than the check. Sources are callables returning cumulative ``{reason: count}`` maps (the
    receiver's, the validator's, the admission server's); :meth:`poll` is cheap enough to call every loop turn."""

    def __init__(self, sources: Mapping[str, Callable[[], Mapping[str, int]]], interval_s: float = 10.0,
                 logger: Optional[logging.Logger] = None, clock: Callable[[], float] = time.monotonic):
        self.sources = dict(sources)
        self.interval_s = float(interval_s)
        self.log = logger or log
        self.clock = clock
        self._last_t = self._checked_t = clock()
        self._last: dict[str, int] = self.totals()
        self.lines = 0

    def totals(self) -> dict[str, int]:
        """Cumulative counts as ``{"source/reason": n}`` (zeros included)."""
        out: dict[str, int] = {}
        for name, fn in self.sources.items():
            for reason, n in dict(fn()).items():
                out[f"{name}/{reason}"] = int(n)
        return out

    def poll(self, force: bool = False) -> Optional[str]:
        """Log (and return) the summary line if the interval passed and something was rejected since the last."""
        now = self.clock()
        if not force and now - self._checked_t < self.interval_s:
            return None
        self._checked_t = now
        totals = self.totals()
        delta = {k: v - self._last.get(k, 0) for k, v in totals.items() if v - self._last.get(k, 0) > 0}
        if not delta:
            return None
        span = now - self._last_t  # since the previous line (or the start)
        self._last_t, self._last = now, totals
        line = (f"rejected {sum(delta.values())} message(s) in the last {span:.0f}s: "
                + ", ".join(f"{k}={v}" for k, v in sorted(delta.items())))
        self.log.warning(line)
        self.lines += 1
        return line
