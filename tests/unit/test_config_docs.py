"""docs/configuration.md documents every option of the schema, so the docs cannot silently fall behind."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path

from asyncppo.config import choices
from asyncppo.config.schema import AsyncPPOConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _leaf_keys(tp, prefix=""):
    hints = typing.get_type_hints(tp)
    for f in dataclasses.fields(tp):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_keys(hints[f.name], key + ".")
        else:
            yield key


def test_every_schema_field_is_documented():
    text = DOC.read_text(encoding="utf-8")
    keys = list(_leaf_keys(AsyncPPOConfig))
    assert len(keys) > 100
    missing = [k for k in keys if f"`{k}`" not in text]
    assert not missing, f"undocumented options in {DOC.name}: {missing}"


def test_every_allowed_value_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for group in (choices.ADV_ESTIMATORS, choices.LOSS_AGG_MODES, choices.KL_PENALTIES_BASE, choices.KL_CTRL_TYPES,
                  choices.OFF_POLICY_CORRECTIONS, choices.ENGINES, choices.GENERATION_MODES,
                  choices.INFLIGHT_UPDATES, choices.ROLLOUT_DTYPES, choices.WANDB_MODES):
        for value in group:
            assert f"`{value}`" in text, value


def _option_rows(text):
    """(key, cells) of every row of the option tables (the ones whose header names the three projects)."""
    rows, in_table = [], False
    for line in text.splitlines():
        if line.startswith("| key | default | allowed | meaning |"):
            in_table = True
            continue
        if in_table and line.startswith("|---"):
            continue
        if in_table and line.startswith("| `"):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
            rows.append((cells[0].strip("`"), cells))
        else:
            in_table = False
    return rows


def test_mapping_columns_are_complete_and_confirmed():
    text = DOC.read_text(encoding="utf-8")
    rows = _option_rows(text)
    assert len(rows) > 100
    for key, cells in rows:
        assert len(cells) == 7, f"{key}: expected 7 cells (key, default, allowed, meaning, verl, ROLL, RLinf)"
        for project, cell in zip(("verl", "ROLL", "RLinf"), cells[4:]):
            assert cell, f"{key}: empty {project} cell (write — when the project has no such option)"
            # a name followed by '?' was the old marker for an unconfirmed key: every cell is now checked
            assert not re.search(r"`\?|\w\?(\s|$)", cell), f"{key}: unconfirmed {project} name {cell!r}"
            assert "not checked" not in cell, f"{key}: {project} cell not checked against the sources"


def test_mapping_names_the_versions_the_converter_was_checked_against():
    from asyncppo.config.convert import PROJECTS

    text = DOC.read_text(encoding="utf-8")
    headers = [line for line in text.splitlines() if line.startswith("| key | default | allowed | meaning |")]
    assert headers and all(h == headers[0] for h in headers)
    for name, mod in PROJECTS.items():
        commit = re.search(r"\b([0-9a-f]{7})\b", mod.VERSION).group(1)
        assert f"`{commit}`" in text, f"docs do not name {name} {commit}, which {mod.__name__} was checked against"
