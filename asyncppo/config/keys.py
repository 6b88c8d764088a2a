"""Whether a dotted key names a field of the schema: the one check shared by ``KEY=VALUE`` overrides
(:mod:`asyncppo.config.loader`) and ``--config-file`` keys (:mod:`asyncppo.config.config_file`).

It lives apart from both so that neither has to import the other for it.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any, Optional

from asyncppo.config.schema import AsyncPPOConfig

CONFIG_GROUPS = ("algorithm", "data", "env")
# Sub-trees that accept keys the schema does not declare.
_OPEN_NODES = ("extra", "hydra")


def _schema_children(tp: Any) -> Optional[dict[str, Any]]:
    """Field name -> type for a dataclass type, else None."""
    if dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return {f.name: hints[f.name] for f in dataclasses.fields(tp)}
    return None


def _is_container(tp: Any) -> bool:
    origin = typing.get_origin(tp)
    return origin in (list, dict) or tp in (list, dict)


def check_override_key(key: str, add: bool) -> Optional[str]:
    """Return a problem line if ``key`` (dotted) is not a schema field, else None."""
    parts = key.split(".")
    if parts[0] in _OPEN_NODES or (len(parts) == 1 and key in CONFIG_GROUPS):
        return None
    if "@" in parts[0] or parts[0].startswith("/"):  # package-qualified group override: let Hydra judge it
        return None
    node: Any = AsyncPPOConfig
    path: list[str] = []
    for part in parts:
        children = _schema_children(node)
        if children is None:
            if _is_container(node):  # list index / dict key inside a declared container
                return None
            return f"{key}: '{'.'.join(path)}' is a value, it has no sub-key '{part}'"
        if part not in children:
            where = ".".join(path) or "the top level"
            close = difflib.get_close_matches(part, list(children), n=3, cutoff=0.6)
            hint = f"; did you mean {', '.join(repr('.'.join(path + [c])) for c in close)}?" if close else ""
            how = " ('+' cannot add keys: the schema is closed; free-form keys go under extra.*)" if add else ""
            return f"{key}: unknown key{how}; keys under {where}: {', '.join(children)}{hint}"
        node = children[part]
        args = [a for a in typing.get_args(node) if a is not type(None)]
        if typing.get_origin(node) is typing.Union and len(args) == 1:
            node = args[0]
        path.append(part)
    return None
