"""``final/``, the trained model a run leaves, written whole or not at all.

Why: a model directory that a learner killed in the middle of writing leaves behind looks complete (its
``config.json`` comes first) and loads into garbage or fails later. So it is written into ``.tmp-<name>`` beside
it and renamed when whole; an earlier one (a run resumed in its own directory) is moved aside, not deleted first,
so a kill at any moment leaves a whole model on disk; a failed write removes what it wrote (a full disk gets the
space back) and raises its error.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable


def write_whole(path: str, save: Callable[[str], None]) -> None:
    """``save(directory)`` into a temporary directory beside ``path``, then renamed to ``path``."""
    parent, name = os.path.split(os.path.abspath(path))
    tmp, old = os.path.join(parent, f".tmp-{name}"), os.path.join(parent, f".old-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        save(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)
