"""``asyncppo convert``: turn a verl, ROLL or RLinf config into an asyncppo config plus a report.

>>> from asyncppo.config.convert import convert
>>> result = convert(open("ppo_trainer.yaml").read(), "verl")
>>> result.yaml          # asyncppo config; `asyncppo launch --config-file FILE` runs it
>>> result.report        # markdown: every foreign key mapped, approximate (why) or unsupported; flags first
>>> result.problems      # validation errors of the converted config ([] when it is valid)

Each project's rules live in a module of their own (``verl``, ``roll``, ``rlinf``) that names the version it was
checked against; :mod:`asyncppo.config.convert.engine` keeps the ledger that guarantees no key is dropped silently.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from asyncppo.config import ConfigError, config_from_yaml
from asyncppo.config.convert import rlinf, roll, verl
from asyncppo.config.convert.engine import Context, ConvertError, Entry, read_foreign, to_yaml

PROJECTS: dict[str, ModuleType] = {"verl": verl, "roll": roll, "rlinf": rlinf}

__all__ = ["PROJECTS", "Conversion", "ConvertError", "convert"]


@dataclass
class Conversion:
    """The result: the asyncppo YAML, the report, and the ledger behind both."""

    project: str
    yaml: str
    report: str
    entries: dict[str, Entry]
    values: dict[str, Any]  # asyncppo key -> value written
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def flagged(self) -> list[Entry]:
        return [e for e in self.entries.values() if e.flagged]


def convert(text: str, project: str, source_name: str = "CONFIG.yaml") -> Conversion:
    """Convert a YAML config of ``project`` (``verl``, ``roll`` or ``rlinf``). Raises :class:`ConvertError` on input
    that is not a YAML mapping or an unknown project; everything else ends up in the report."""
    if project not in PROJECTS:
        raise ConvertError(f"unknown project {project!r}; choose one of {', '.join(PROJECTS)}")
    mod = PROJECTS[project]
    ctx = Context(project, read_foreign(text), mod.DEFAULTS, mod.IGNORED)
    mod.convert(ctx)
    ctx.finish()
    header = (f"asyncppo config converted from {project} ({source_name}) by `asyncppo convert`;\n"
              f"rules checked against {mod.VERSION}. Keys not listed keep asyncppo's schema defaults.\n"
              "Run: asyncppo launch --config-file THIS_FILE [--dry-run] [KEY=VALUE ...]")
    text_out = to_yaml(ctx, header)
    problems, warns = _validate(text_out)
    values = {k: a.value for k, a in ctx.assignments.items()}
    report = _report(ctx, mod.VERSION, source_name, problems, warns)
    return Conversion(project, text_out, report, ctx.entries, values, problems, warns)


def _validate(text: str) -> tuple[list[str], list[str]]:
    """Load the converted YAML exactly as ``launch --config-file`` would (schema + file), collecting problems."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            config_from_yaml(text)
        except ConfigError as exc:
            return list(exc.problems), []
    return [], [str(w.message) for w in caught]


def _cell(value: Any) -> str:
    text = repr(value) if not isinstance(value, str) else value
    text = text.replace("|", "\\|").replace("\n", " ")
    return f"`{text}`" if len(text) < 80 else f"`{text[:77]}...`"


def _report(ctx: Context, version: str, source: str, problems: list[str], warns: list[str]) -> str:
    entries = sorted(ctx.entries.values(), key=lambda e: e.key)
    counts = {s: sum(e.status == s for e in entries) for s in ("mapped", "approximate", "unsupported", "unknown")}
    flagged = [e for e in entries if e.flagged]
    out = [f"# Conversion report: {ctx.project} -> asyncppo", "",
           f"Source: `{source}`. Rules checked against {version}.", "",
           f"{len(entries)} keys read: {counts['mapped']} mapped, {counts['approximate']} approximate, "
           f"{counts['unsupported']} unsupported, {counts['unknown']} unknown; **{len(flagged)} flagged** "
           "(the converted run behaves differently there unless you act).", ""]
    if problems:
        out += ["## The converted config does not validate", ""] + [f"- {p}" for p in problems] + [""]
    if warns:
        out += ["## Validation warnings", ""] + [f"- {w}" for w in warns] + [""]
    out += ["## Flagged", "", "| key | value | status | asyncppo key | why |", "|---|---|---|---|---|"]
    out += [f"| `{e.key}` | {_cell(e.value)} | {e.status} | {', '.join(f'`{t}`' for t in e.targets) or '—'} | "
            f"{e.why or ''} |" for e in flagged] or ["| — | | | | |"]
    carried = [a for a in ctx.assignments.values() if a.status == "default"]
    out += ["", f"## Defaults carried over from {ctx.project}", "",
            f"Not set in your file, but {ctx.project}'s default differs from asyncppo's, so it is written explicitly:",
            "", f"| asyncppo key | value | asyncppo default | from {ctx.project} default of | why |",
            "|---|---|---|---|---|"]
    out += [f"| `{a.target}` | {_cell(a.value)} | {_cell(ctx.ours[a.target])} | "
            f"{', '.join(f'`{s}`' for s in a.sources)} | {a.why} |"
            for a in sorted(carried, key=lambda a: a.target)] or ["| — | | | | |"]
    if ctx.notes:
        out += ["", "## Notes", ""] + [f"- {n}" for n in ctx.notes]
    out += ["", "## Every key", "", "| key | value | status | asyncppo key | why |", "|---|---|---|---|---|"]
    out += [f"| `{e.key}` | {_cell(e.value)} | {e.status}{' (flagged)' if e.flagged else ''} | "
            f"{', '.join(f'`{t}`' for t in e.targets) or '—'} | {e.why} |" for e in entries]
    return "\n".join(out) + "\n"
