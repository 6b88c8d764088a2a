"""The transition-segment record of embodied runs, and its wire format: defined once, used by every side.

An environment rollout worker steps ``N`` environments in lock-step (a gymnasium vector env) and ships every ``T``
steps one :class:`EnvSegment`: observations, actions, behaviour log-probs, rewards, ``terminated`` / ``truncated``
flags, the observation after the last step (the *bootstrap* observation), the true final observation of every step
whose episode was truncated (gymnasium resets such an env in the same step, so the returned observation belongs to
the next episode; GAE must bootstrap from the final one), the episodes that ended inside the segment (raw return and
length, for metrics), and the policy version that chose every step. Weights are loaded between env steps, so one
segment may span versions; all ``N`` envs step together, so a version per step (``versions[T]``) is exact.

Why it looks like a trajectory group to the staleness machinery: a segment is the unit that takes one admission
ticket and is kept whole, exactly as a group is, so :class:`~asyncppo.staleness.buffer.StalenessBuffer` and the
ticket-ordered lag guard handle it unchanged. It answers the few questions the buffer asks (``ticket``,
``version_min``, ``num_samples``, per-row ``sample_lengths`` / ``sample_version_mins`` / ``sample_version_maxs``,
...): one row per environment, one "token" per step.

Wire layout (one ZeroMQ frame; never pickled)::

    b"APSG" | uint32 LE header length | msgpack header (an array) | pad to 8
    | obs [N,T,*S] | actions [N,T,*A] | logprobs <f4 [N,T] | rewards <f4 [N,T] | flags u1 [N,T]
    | versions <i8 [T] | bootstrap_obs [N,*S] | final_index <i8 [K] | final_obs [K,*S]
    | episode_returns <f8 [E] | episode_lengths <i8 [E]          (every region padded to 8 bytes)

``flags``: bit 0 terminated, bit 1 truncated. ``final_index`` holds the flat positions ``n * T + t`` of the steps
that were truncated and not terminated (termination wins: no bootstrap), ascending. Decoding checks the structure
(exact length, dtype whitelist, header types, bounds), and the content: every float finite (an observation with NaN
is refused with its env and step), flags in range, versions ``>= 0`` and non-decreasing, ``final_index`` exactly
the truncated-not-terminated steps, episode lengths ``>= 1``; and, given a :class:`SegmentSpec` (the learner's
observation and action spaces), the shapes and the discrete action range. A bad frame raises
:class:`~asyncppo.stream.errors.WireError`, which the receiver counts and drops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import numpy as np

from asyncppo.stream.errors import WireError
from asyncppo.stream.framing import ZEROS, as_view, header_parts, pad, read_header

SEGMENT_SCHEMA = 1
MAGIC = b"APSG"
MAX_ENVS = 4096
MAX_STEPS = 1 << 16
MAX_OBS_DIMS = 4

OBS_DTYPES = ("<f4", "<f8", "|u1")
ACTION_DTYPES = ("<i8", "<f4")
_HEADER_TYPES = (int, str, str, int, int, dict, int, int, list, str, list, str, int, int)
_HEADER_NAMES = ("schema", "kind", "segment_id", "worker_id", "ticket", "timings", "num_envs", "num_steps",
                 "obs_shape", "obs_dtype", "action_shape", "action_dtype", "num_final", "num_episodes")
TERMINATED, TRUNCATED = 1, 2


class SegmentRow(NamedTuple):
    """One environment's row of a segment, as the staleness buffer sees a sample: ``num_tokens`` = steps."""

    num_tokens: int
    version_min: int
    version_max: int


@dataclass
class EnvSegment:
    obs: np.ndarray  # [N, T, *S] observation before each step (raw: normalisation is the policy's business)
    actions: np.ndarray  # int64 [N, T] (discrete) or float32 [N, T, *A] (continuous, before any clipping)
    logprobs: np.ndarray  # float32 [N, T] behaviour log-probability (density for continuous actions)
    rewards: np.ndarray  # float32 [N, T] raw environment rewards
    terminated: np.ndarray  # bool [N, T]
    truncated: np.ndarray  # bool [N, T]
    versions: np.ndarray  # int64 [T] policy version that chose step t (non-decreasing)
    bootstrap_obs: np.ndarray  # [N, *S] observation after the last step
    final_index: np.ndarray  # int64 [K] flat n * T + t of truncated-not-terminated steps, ascending
    final_obs: np.ndarray  # [K, *S] the true final observation of those steps
    episode_returns: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))  # episodes ended here
    episode_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    segment_id: str = ""
    worker_id: int = 0
    ticket: int = -1
    timings: dict = field(default_factory=dict)

    # ------------------------------------------------------------------ what the staleness buffer and metrics ask
    @property
    def num_envs(self) -> int:
        return int(self.obs.shape[0])

    @property
    def num_steps(self) -> int:
        return int(self.obs.shape[1])

    @property
    def group_id(self) -> str:
        return self.segment_id

    @property
    def version_min(self) -> int:
        return int(self.versions[0])

    @property
    def version_max(self) -> int:
        return int(self.versions[-1])

    @property
    def samples(self) -> list[SegmentRow]:
        row = SegmentRow(self.num_steps, self.version_min, self.version_max)
        return [row] * self.num_envs

    @property
    def num_samples(self) -> int:
        return self.num_envs

    def sample_lengths(self) -> list[int]:
        """Steps per environment row (every row has ``num_steps``): the buffer's per-sample length."""
        return [self.num_steps] * self.num_envs

    def sample_version_mins(self) -> list[int]:
        return [self.version_min] * self.num_envs

    def sample_version_maxs(self) -> list[int]:
        return [self.version_max] * self.num_envs

    @property
    def num_response_tokens(self) -> int:
        return self.num_envs * self.num_steps

    def token_lag_sum(self, learner_version: int) -> tuple[int, int]:
        """``(sum over every env step of learner_version - step version, number of env steps)``."""
        lag = int((learner_version - self.versions.astype(np.int64)).sum()) * self.num_envs
        return lag, self.num_response_tokens


@dataclass(frozen=True)
class SegmentSpec:
    """What the learner expects: observation and action shapes, action dtype, and the discrete action count."""

    obs_shape: tuple[int, ...]
    action_shape: tuple[int, ...]  # () for discrete actions
    action_dtype: str  # "<i8" (discrete) | "<f4" (continuous)
    num_actions: Optional[int] = None  # discrete only


def _where(flat: int, T: int) -> str:
    return f"env {flat // T}, step {flat % T}"


def _first_bad(arr: np.ndarray, per: int) -> Optional[int]:
    """Index (in units of ``per`` elements) of the first non-finite value, or None."""
    if arr.dtype.kind != "f":
        return None
    ok = np.isfinite(arr)
    if ok.all():
        return None
    return int(np.flatnonzero(~ok.reshape(-1))[0]) // max(per, 1)


def check_segment(seg: EnvSegment, spec: Optional[SegmentSpec] = None) -> Optional[str]:
    """What is wrong with ``seg`` (shapes, dtypes, content), or None. Shared by encode and decode."""
    obs = seg.obs
    if not isinstance(obs, np.ndarray) or obs.ndim < 2 or obs.dtype.str not in OBS_DTYPES:
        return f"obs must be a numpy array [N, T, *S] with dtype in {OBS_DTYPES}"
    N, T = obs.shape[:2]
    S = obs.shape[2:]
    if not (1 <= N <= MAX_ENVS and 1 <= T <= MAX_STEPS and len(S) <= MAX_OBS_DIMS):
        return f"obs shape {obs.shape}: need 1..{MAX_ENVS} envs, 1..{MAX_STEPS} steps, <= {MAX_OBS_DIMS} obs dims"
    obs_size = int(np.prod(S, dtype=np.int64)) if S else 1
    want = {"actions": None, "logprobs": ((N, T), "<f4"), "rewards": ((N, T), "<f4"),
            "terminated": ((N, T), "|b1"), "truncated": ((N, T), "|b1"), "versions": ((T,), "<i8"),
            "bootstrap_obs": ((N, *S), obs.dtype.str), "final_index": None, "final_obs": None,
            "episode_returns": None, "episode_lengths": None}
    for name, shape_dtype in want.items():
        arr = getattr(seg, name)
        if not isinstance(arr, np.ndarray):
            return f"{name} must be a numpy array, got {type(arr).__name__}"
        if shape_dtype is not None and (arr.shape != shape_dtype[0] or arr.dtype.str != shape_dtype[1]):
            return f"{name} must be {shape_dtype[1]} {shape_dtype[0]}, got {arr.dtype.str} {arr.shape}"
    act = seg.actions
    if act.dtype.str not in ACTION_DTYPES or act.shape[:2] != (N, T) or act.ndim > 2 + MAX_OBS_DIMS:
        return f"actions must be {ACTION_DTYPES} [N={N}, T={T}, *A], got {act.dtype.str} {act.shape}"
    if act.dtype.kind == "i" and act.ndim != 2:
        return f"discrete actions must be [N, T], got {act.shape}"
    K = seg.final_index.shape[0] if seg.final_index.ndim == 1 else -1
    if seg.final_index.dtype.str != "<i8" or K < 0 or seg.final_obs.shape != (K, *S) \
            or seg.final_obs.dtype != obs.dtype:
        return (f"final_index must be <i8 [K] and final_obs {obs.dtype.str} [K, *{S}], got {seg.final_index.dtype.str} "
                f"{seg.final_index.shape} / {seg.final_obs.dtype.str} {seg.final_obs.shape}")
    E = seg.episode_returns.shape[0] if seg.episode_returns.ndim == 1 else -1
    if seg.episode_returns.dtype.str != "<f8" or seg.episode_lengths.dtype.str != "<i8" or E < 0 \
            or seg.episode_lengths.shape != (E,) or E > N * T:
        return "episode_returns / episode_lengths must be <f8 [E] / <i8 [E] with E <= N * T"
    # ---- content
    for name, arr, per, where in (("obs", obs, obs_size, lambda i: _where(i, T)),
                                  ("bootstrap_obs", seg.bootstrap_obs, obs_size, lambda i: f"env {i}"),
                                  ("final_obs", seg.final_obs, obs_size, lambda i: f"final row {i}"),
                                  ("logprobs", seg.logprobs, 1, lambda i: _where(i, T)),
                                  ("rewards", seg.rewards, 1, lambda i: _where(i, T)),
                                  ("actions", act, max(1, act[0, 0].size), lambda i: _where(i, T)),
                                  ("episode_returns", seg.episode_returns, 1, lambda i: f"episode {i}")):
        bad = _first_bad(arr, per)
        if bad is not None:
            return f"{name} has a NaN or infinite value at {where(bad)}"
    v = seg.versions
    if v.size and (v[0] < 0 or (np.diff(v) < 0).any()):
        return f"versions {v.tolist()[:16]} must be >= 0 and non-decreasing"
    expect = np.flatnonzero((seg.truncated & ~seg.terminated).reshape(-1))
    if not np.array_equal(seg.final_index, expect):
        return (f"final_index {seg.final_index.tolist()[:8]} must list exactly the truncated-not-terminated steps "
                f"{expect.tolist()[:8]}")
    if E and seg.episode_lengths.min() < 1:
        return "episode_lengths must be >= 1"
    if spec is not None:
        if tuple(S) != tuple(spec.obs_shape):
            return f"observation shape {tuple(S)} != the learner's {tuple(spec.obs_shape)}"
        if act.dtype.str != spec.action_dtype or tuple(act.shape[2:]) != tuple(spec.action_shape):
            return (f"actions {act.dtype.str} {tuple(act.shape[2:])} != the learner's {spec.action_dtype} "
                    f"{tuple(spec.action_shape)}")
        if spec.num_actions is not None and act.size and (act.min() < 0 or act.max() >= spec.num_actions):
            return f"discrete actions must be in [0, {spec.num_actions}), got [{act.min()}, {act.max()}]"
    return None


def _regions(seg: EnvSegment) -> list[np.ndarray]:
    flags = seg.terminated.astype(np.uint8) * TERMINATED | seg.truncated.astype(np.uint8) * TRUNCATED
    return [seg.obs, seg.actions, seg.logprobs, seg.rewards, flags, seg.versions, seg.bootstrap_obs,
            seg.final_index, seg.final_obs, seg.episode_returns, seg.episode_lengths]


def encode_segment(seg: EnvSegment) -> bytes:
    """One frame for ``seg``; raises WireError("schema") when :func:`check_segment` refuses it (the worker's bug or
    its environment's NaN is reported at the sender)."""
    problem = check_segment(seg)
    if problem is not None:
        raise WireError("schema", f"segment {seg.segment_id!r}: {problem}")
    try:
        timings = {str(k): float(v) for k, v in seg.timings.items()}
        header = [SEGMENT_SCHEMA, "segment", str(seg.segment_id), int(seg.worker_id), int(seg.ticket), timings,
                  seg.num_envs, seg.num_steps, list(seg.obs.shape[2:]), seg.obs.dtype.str,
                  list(seg.actions.shape[2:]), seg.actions.dtype.str, int(seg.final_index.shape[0]),
                  int(seg.episode_returns.shape[0])]
        parts: list[Any] = header_parts(MAGIC, header)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError("schema", f"segment scalars are not representable: {e}") from None
    for arr in _regions(seg):
        arr = np.ascontiguousarray(arr)
        parts += [arr.tobytes(), ZEROS[: pad(arr.nbytes)]]
    return b"".join(parts)


def _header(mv: memoryview, max_bytes: Optional[int]) -> tuple[list, int]:
    header, data_start = read_header(mv, MAGIC, max_bytes, "segment header", " (a transition segment)")
    if type(header) is not list or not header:
        raise WireError("schema", f"segment header must be a msgpack array, got {type(header).__name__}")
    if type(header[0]) is int and header[0] != SEGMENT_SCHEMA:
        raise WireError("version", f"segment schema {header[0]}, this reader speaks {SEGMENT_SCHEMA}")
    if len(header) != len(_HEADER_TYPES) or tuple(map(type, header)) != _HEADER_TYPES:
        for name, typ, val in zip(_HEADER_NAMES, _HEADER_TYPES, header):
            if type(val) is not typ:
                raise WireError("schema", f"segment: field {name!r} must be {typ.__name__}, got {type(val).__name__}")
        raise WireError("schema", f"segment header has {len(header)} fields, expected {list(_HEADER_NAMES)}")
    return header, data_start


def _shape(dims: list, what: str) -> tuple[int, ...]:
    if len(dims) > MAX_OBS_DIMS or any(type(d) is not int or d < 1 or d > 1 << 20 for d in dims):
        raise WireError("schema", f"{what} {dims}: at most {MAX_OBS_DIMS} dims, each an int in [1, 2^20]")
    return tuple(dims)


def decode_segment(buf: Any, max_bytes: Optional[int] = None, spec: Optional[SegmentSpec] = None) -> EnvSegment:
    """Parse and validate one frame from :func:`encode_segment` (module docstring); WireError on anything else.
    The arrays are read-only views into ``buf``."""
    mv = as_view(buf)
    header, pos = _header(mv, max_bytes)
    (_, kind, segment_id, worker_id, ticket, timings, N, T, obs_shape, obs_dt, act_shape, act_dt, K, E) = header
    if kind != "segment":
        raise WireError("schema", f"kind {kind!r}, expected 'segment'")
    if not (1 <= N <= MAX_ENVS and 1 <= T <= MAX_STEPS and 0 <= K <= N * T and 0 <= E <= N * T):
        raise WireError("schema", f"num_envs={N}, num_steps={T}, num_final={K}, num_episodes={E} out of range")
    if obs_dt not in OBS_DTYPES or act_dt not in ACTION_DTYPES:
        raise WireError("schema", f"dtypes obs={obs_dt!r} actions={act_dt!r}; allowed {OBS_DTYPES} / {ACTION_DTYPES}")
    if any(type(k) is not str or type(v) is not float or not math.isfinite(v) for k, v in timings.items()):
        raise WireError("schema", "timings must map str -> finite float")
    S, A = _shape(obs_shape, "obs_shape"), _shape(act_shape, "action_shape")
    if act_dt == "<i8" and A:
        raise WireError("schema", f"discrete actions carry no action_shape, got {list(A)}")
    layout = [("obs", obs_dt, (N, T, *S)), ("actions", act_dt, (N, T, *A)), ("logprobs", "<f4", (N, T)),
              ("rewards", "<f4", (N, T)), ("flags", "|u1", (N, T)), ("versions", "<i8", (T,)),
              ("bootstrap_obs", obs_dt, (N, *S)), ("final_index", "<i8", (K,)), ("final_obs", obs_dt, (K, *S)),
              ("episode_returns", "<f8", (E,)), ("episode_lengths", "<i8", (E,))]
    end, spans = pos, []
    for name, dt, shape in layout:
        nbytes = math.prod(shape) * np.dtype(dt).itemsize
        spans.append((name, dt, shape, end))
        end += nbytes + pad(nbytes)
    if end != mv.nbytes:  # plain arithmetic first: nothing is allocated for what the header claims
        raise WireError("malformed", f"message is {mv.nbytes} bytes, but its header describes {end}")
    arrays = {name: np.frombuffer(mv, dtype=dt, count=math.prod(shape), offset=off).reshape(shape)
              for name, dt, shape, off in spans}
    flags = arrays.pop("flags")
    if flags.size and flags.max() > (TERMINATED | TRUNCATED):
        raise WireError("schema", "step flags use bits other than terminated (1) and truncated (2)")
    seg = EnvSegment(**arrays, terminated=(flags & TERMINATED) > 0, truncated=(flags & TRUNCATED) > 0,
                     segment_id=segment_id, worker_id=worker_id, ticket=ticket, timings=timings)
    problem = check_segment(seg, spec)
    if problem is not None:
        raise WireError("schema", f"segment {segment_id!r} from worker {worker_id}: {problem}")
    return seg


def segment_decoder(spec: Optional[SegmentSpec]):
    """A ``decode(buf, max_bytes)`` for :class:`~asyncppo.stream.channels.TrajectoryReceiver` that also checks the
    segment against the learner's spaces."""

    def decode(buf: Any, max_bytes: Optional[int] = None) -> EnvSegment:
        return decode_segment(buf, max_bytes, spec)

    return decode
