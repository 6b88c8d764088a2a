"""Value converters shared by the project tables: each returns the asyncppo value or raises ``ValueError`` with a
sentence the ledger shows (the key is then reported as unsupported and flagged, never silently dropped)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

NO_STOP = "asyncppo's engines stop at the tokenizer's eos only (rollout.sampling.stop is reserved)"
NO_PENALTY = "asyncppo's engines apply no repetition penalty yet (rollout.sampling.repetition_penalty is reserved)"


def as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if value is None:
        return False
    raise ValueError(f"{value!r} is not a boolean")


def as_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not an integer")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    raise ValueError(f"{value!r} is not an integer")


def as_str_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return [str(v) for v in value]
    raise ValueError(f"{value!r} is not a string or a list of strings")


def choose(table: Mapping[Any, Any]) -> Callable[[Any], Any]:
    """A value converter that accepts only the keys of ``table``."""

    def convert(value: Any) -> Any:
        if value not in table:
            raise ValueError(f"{value!r} has no asyncppo equivalent (supported: {', '.join(map(str, table))})")
        return table[value]

    return convert


def positive_or_none(kind: Callable[[Any], Any], zero: bool = False) -> Callable[[Any], Any]:
    """null stays null (or 0 with ``zero``: asyncppo's 'off' for counts); otherwise a positive number."""

    def convert(value: Any) -> Any:
        if value is None:
            return 0 if zero else None
        out = as_int(value) if kind is int else kind(value)
        if out <= 0:
            raise ValueError(f"{value!r} must be > 0")
        return out

    return convert


def only(allowed: Any, why: str, kind: Callable[[Any], Any] = lambda v: v) -> Callable[[Any], Any]:
    """For options asyncppo reserves but does not implement yet: only the neutral value converts."""

    def convert(value: Any) -> Any:
        out = kind(value)
        if out != allowed:
            raise ValueError(f"{value!r}: {why}")
        return out

    return convert
