"""The rules of the house hold: `lint-imports` checks the layer contracts of pyproject.toml ([tool.importlinter],
written from shared/design.md) against the package as it is, and every contract must be kept."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _lint_imports_command() -> list[str]:
    """The `lint-imports` script beside this interpreter: the one the dev extra installed into this environment."""
    script = Path(sys.executable).parent / "lint-imports"
    assert script.is_file(), f"{script} is missing: install the dev extra (pip install -e .[dev])"
    return [str(script), "--no-cache"]


def test_every_import_contract_is_kept():
    env = dict(os.environ, PYTHONPATH=str(REPO))  # the package of this checkout, not an installed copy
    proc = subprocess.run(_lint_imports_command(), cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert ", 0 broken." in proc.stdout, proc.stdout[-6000:]  # the contracts were read and checked
