"""docs/configuration.md documents every option of the schema, so the docs cannot silently fall behind."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

from asyncppo.config import choices
from asyncppo.config.schema import AsyncPPOConfig

DOC = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


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
