"""The project-neutral half of ``asyncppo convert``: read a foreign YAML, record a decision for every key, write.

A converter that drops a setting quietly is worse than none: the user believes the run is the one they had. So
the engine keeps a ledger with one line per key of the input file and every key ends in exactly one state:

* ``mapped`` - same meaning, value carried over (possibly renamed or re-expressed, e.g. a count into a size);
* ``approximate`` - carried over, but the semantics differ in a way the ledger explains;
* ``unsupported`` - asyncppo has no equivalent; the value is not carried over. It is *flagged* when it differs
  from the project's own default (the run will behave differently), and listed as harmless otherwise;
* ``unknown`` - the converter has no rule for the key (always flagged).

Keys the file does not set matter too: where the project's default differs from asyncppo's (verl trains at
lr 1e-6, asyncppo at 1e-4) the project's default is written explicitly and listed under "defaults carried over",
so the converted run behaves like the original rather than like asyncppo's defaults.

The project modules (``verl.py``, ``roll.py``, ``rlinf.py``) are data plus small functions over a
:class:`Context`; this module never names a foreign key.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from asyncppo.config import choices as config_choices
from asyncppo.config.schema import AsyncPPOConfig

_NO_DEFAULT = object()

#: Resolvers that the projects' YAML files use besides OmegaConf's built-ins (RLinf registers these itself).
_EXTRA_RESOLVERS: dict[str, Callable[..., Any]] = {
    "subtract": lambda x, y: x - y,
    "multiply": lambda x, y: x * y,
    "int_div": lambda x, y: x // y,
    "not": lambda x: not bool(x),
}


class ConvertError(ValueError):
    """The input cannot be converted at all (not YAML, not a mapping, unknown project)."""


def schema_defaults() -> dict[str, Any]:
    """Dotted asyncppo key -> schema default, for every leaf of :class:`AsyncPPOConfig`."""
    out: dict[str, Any] = {}

    def walk(obj: Any, prefix: str) -> None:
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            if dataclasses.is_dataclass(value):
                walk(value, f"{prefix}{f.name}.")
            else:
                out[f"{prefix}{f.name}"] = value

    walk(AsyncPPOConfig(), "")
    return out


def _leaf_type(key: str) -> Any:
    node: Any = AsyncPPOConfig
    for part in key.split("."):
        node = typing.get_type_hints(node)[part]
    return node


@dataclass
class Entry:
    """One line of the ledger: a foreign key and what became of it."""

    key: str
    value: Any
    status: str  # mapped | approximate | unsupported | unknown | default
    targets: list[str] = field(default_factory=list)
    why: str = ""
    flagged: bool = False


@dataclass
class Assignment:
    """One asyncppo key written to the output, with the foreign keys it came from."""

    target: str
    value: Any
    sources: list[str]
    status: str  # mapped | approximate | default
    why: str = ""


def flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key -> value for every leaf; lists and empty mappings are leaves. Unresolvable interpolations are kept
    as their text (the ledger shows them) instead of failing the whole conversion."""
    out: dict[str, Any] = {}
    if isinstance(node, DictConfig):
        keys = list(node.keys())
        for key in keys:
            path = f"{prefix}{key}"
            try:
                child = node[key]
            except Exception:  # unresolvable interpolation
                child = OmegaConf.to_container(node, resolve=False)[key]
            if isinstance(child, DictConfig) and len(child) > 0:
                out.update(flatten(child, path + "."))
            elif isinstance(child, (DictConfig, ListConfig)):
                try:
                    out[path] = OmegaConf.to_container(child, resolve=True)
                except Exception:
                    out[path] = OmegaConf.to_container(child, resolve=False)
            else:
                out[path] = child
    return out


def read_foreign(text: str) -> dict[str, Any]:
    """Parse a foreign YAML config into flat dotted keys with interpolations resolved where possible."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConvertError(f"not valid YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConvertError(f"expected a mapping at the top level, got {type(data).__name__}")
    added = [name for name in _EXTRA_RESOLVERS if not OmegaConf.has_resolver(name)]
    for name in added:
        OmegaConf.register_new_resolver(name, _EXTRA_RESOLVERS[name])
    try:
        return flatten(OmegaConf.create(data))
    finally:
        for name in added:
            OmegaConf.clear_resolver(name)


class Context:
    """What a project's converter function works with: the input, the project's defaults, and the ledger."""

    def __init__(self, project: str, values: dict[str, Any], defaults: dict[str, Any],
                 ignored: Iterable[tuple] = ()):
        self.project = project
        self.values = values
        self.defaults = defaults
        self.ignored = list(ignored)
        self.ours = schema_defaults()
        self.assignments: dict[str, Assignment] = {}
        self.entries: dict[str, Entry] = {}
        self.notes: list[str] = []

    # ---- reading ---------------------------------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return key in self.values

    def get(self, key: str, default: Any = _NO_DEFAULT) -> Any:
        """The file's value, else the project's default (``default`` overrides the table), else None."""
        if key in self.values:
            return self.values[key]
        if default is not _NO_DEFAULT:
            return default
        return self.defaults.get(key)

    def keys_under(self, prefix: str) -> list[str]:
        return [k for k in self.values if k == prefix or k.startswith(prefix + ".")]

    @staticmethod
    def choices(name: str) -> tuple:
        """An enumeration of :mod:`asyncppo.config.choices`, empty when this build does not define it."""
        return tuple(getattr(config_choices, name, ()))

    def differs_from_default(self, key: str) -> bool:
        """True when the file's value differs from the project default. Where that default is unknown, an 'off'
        value (null, false, 0, empty, 'disabled') is taken as having no effect, anything else as a change."""
        value = self.values.get(key)
        if key in self.defaults:
            return value != self.defaults[key]
        if isinstance(value, (dict, list, str)) and not value:
            return False
        return not (value is None or value is False or (isinstance(value, (int, float)) and value == 0)
                    or value in ("disabled", "disable", "none"))

    # ---- writing ---------------------------------------------------------------------------------------------
    def set(self, target: str, value: Any, sources: list[str] | str, status: str = "mapped", why: str = "") -> None:
        """Write ``target = value`` because of ``sources``. Sources absent from the file make it a carried-over
        default; it is then only written when asyncppo's default differs."""
        sources = [sources] if isinstance(sources, str) else list(sources)
        present = [s for s in sources if s in self.values]
        if target not in self.ours:
            for s in present:
                self.record(s, "unsupported", f"asyncppo has no `{target}` in this version", flag=True)
            return
        value = _coerce(target, value)
        if not present:
            if value == self.ours[target]:
                return
            status = "default"
        prev = self.assignments.get(target)
        if prev is not None and prev.value != value and prev.status != "default":
            why = (why + "; " if why else "") + f"overrides {prev.value!r} derived from {', '.join(prev.sources)}"
        self.assignments[target] = Assignment(target, value, present or sources, status, why)
        for s in present:
            self.record(s, status, why, targets=[target], flag=status == "approximate")

    def map(self, key: str, target: str, fn: Callable[[Any], Any] = lambda v: v, why: str = "",
            carry_default: bool = True) -> None:
        """``target = fn(value)``: exact when ``why`` is empty, approximate otherwise. An absent key carries the
        project's default when ``carry_default`` and the table knows it."""
        if key not in self.values and (not carry_default or key not in self.defaults):
            return
        raw = self.get(key)
        if isinstance(raw, str) and "${" in raw:
            self.record(key, "unsupported", f"interpolation {raw!r} could not be resolved from this file", flag=True)
            return
        try:
            value = fn(raw)
        except (TypeError, ValueError) as exc:
            if key in self.values:
                self.record(key, "unsupported", f"value not convertible: {exc}", flag=True)
            return
        self.set(target, value, key, "approximate" if why else "mapped", why)

    def unsupported(self, key_or_pattern: str, why: str) -> None:
        """Record every matching key of the file as having no asyncppo equivalent."""
        for key in self.values:
            if fnmatch.fnmatchcase(key, key_or_pattern) and key not in self.entries:
                marker = key.endswith("._target_")  # Hydra's instantiate marker: never a setting
                self.record(key, "unsupported", "Hydra class marker" if marker else why,
                            flag=not marker and self.differs_from_default(key))

    def consumed(self, key: str, status: str, why: str, targets: Optional[list[str]] = None,
                 flag: Optional[bool] = None) -> None:
        """Record a key whose effect was folded into another key's conversion."""
        if key in self.values:
            self.record(key, status, why, targets=targets or [],
                        flag=(status != "mapped") if flag is None else flag)

    def record(self, key: str, status: str, why: str = "", targets: Optional[list[str]] = None,
               flag: bool = False) -> None:
        prev = self.entries.get(key)
        if prev is not None:  # a key feeding several targets: keep the weakest status, merge the rest
            order = ["mapped", "default", "approximate", "unsupported", "unknown"]
            if order.index(status) > order.index(prev.status):
                prev.status = status
            prev.targets += [t for t in targets or [] if t not in prev.targets]
            if why and why not in prev.why:
                prev.why = f"{prev.why}; {why}" if prev.why else why
            prev.flagged = prev.flagged or flag
            return
        self.entries[key] = Entry(key, self.values.get(key), status, list(targets or []), why, flag)

    def note(self, text: str) -> None:
        self.notes.append(text)

    # ---- closing ---------------------------------------------------------------------------------------------
    def finish(self) -> None:
        """Give every key that no rule claimed its final state: a known-unsupported pattern, else unknown."""
        for key in self.values:
            if key in self.entries:
                continue
            for pattern, why, changes_behaviour, *gate in self.ignored:
                if fnmatch.fnmatchcase(key, pattern):
                    active = not gate or (gate[0](self) if callable(gate[0]) else bool(self.get(gate[0])))
                    flag = changes_behaviour and active and self.differs_from_default(key)
                    self.record(key, "unsupported", why if active else f"{why} (switched off here)", flag=flag)
                    break
            else:
                self.record(key, "unknown", f"no rule for this {self.project} key; not converted", flag=True)


def _coerce(target: str, value: Any) -> Any:
    """Bring a foreign value to the schema field's type (YAML `1` for a float field, a string path into a list)."""
    tp = _leaf_type(target)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is typing.Union and len(args) == 1:
        if value is None:
            return None
        tp = args[0]
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if typing.get_origin(tp) is list and isinstance(value, (str, int, float)):
        return [value]
    if typing.get_origin(tp) is list and isinstance(value, (list, tuple)):
        inner = (typing.get_args(tp) or (Any,))[0]
        return [float(v) if inner is float else v for v in value]
    return value


def nested(assignments: dict[str, Assignment]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key in sorted(assignments):
        node = out
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = assignments[key].value
    return out


def _scalar(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text[:-4].strip() if text.endswith("\n...") or text.endswith(" ...") else text


def to_yaml(ctx: Context, header: str) -> str:
    """The converted config as YAML, each key preceded by a comment naming the foreign key(s) it came from."""
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]

    def emit(node: dict[str, Any], prefix: str, indent: int) -> None:
        for name in node:
            key = f"{prefix}{name}"
            pad = "  " * indent
            if isinstance(node[name], dict) and key not in ctx.assignments:
                lines.append(f"{pad}{name}:")
                emit(node[name], key + ".", indent + 1)
                continue
            a = ctx.assignments[key]
            origin = {"mapped": "from", "approximate": "APPROXIMATE, from", "default": "default of"}[a.status]
            lines.append(f"{pad}# {origin} {ctx.project} {', '.join(a.sources)}")
            lines.append(f"{pad}{name}: {_scalar(a.value)}")

    emit(nested(ctx.assignments), "", 0)
    return "\n".join(lines) + "\n"
