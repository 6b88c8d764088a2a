"""What the launcher reads of a run directory too, without torch: the name of the newest complete checkpoint
(``checkpoints/latest``, written by learner/checkpoint.py) and the disk space where the run writes.

Why a module of its own: learner/checkpoint.py imports torch and its distributed checkpointing, which the
launcher's driver and ``--dry-run`` must not load for a file read.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_of(name: str) -> Optional[int]:
    """The step of a checkpoint directory's name (``step_300`` -> 300); None for any other name."""
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def read_latest(root: str) -> Optional[str]:
    """The name ``checkpoints/latest`` holds under ``root`` (a ``checkpoints/`` directory), None without one."""
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def latest_name(output_dir: str) -> Optional[str]:
    """The newest complete checkpoint's name (``step_300``) of a run directory, or None (none, or unreadable)."""
    try:
        return read_latest(os.path.join(output_dir, CHECKPOINTS_DIR))
    except OSError:
        return None


def disk_usage_near(path: str):
    """``shutil.disk_usage`` of the filesystem that holds ``path`` (its nearest existing directory: the run
    directory may not exist yet); None if unreadable."""
    path = os.path.abspath(path)
    while not os.path.isdir(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        return shutil.disk_usage(path)
    except OSError:
        return None
