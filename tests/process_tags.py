"""Which processes did a test's launches start? Those whose environment carries the test's tag.

Ray's GCS, raylet and every actor inherit the driver's environment, so a unique ``ASYNCPPO_E2E_TAG`` in the launch's
environment marks all of them and nothing else: the check stays exact when other runs share the machine (a
machine-wide "no Ray process" check fails whenever anyone else runs Ray)."""

from __future__ import annotations

import os
import time
import uuid

TAG_VAR = "ASYNCPPO_E2E_TAG"


def new_tag(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def tagged_processes(tag: str) -> list[str]:
    """Live processes whose environment carries ``tag`` (pid and the start of the command line)."""
    found = []
    needle = f"{TAG_VAR}={tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle in f.read():
                    with open(f"/proc/{pid}/cmdline", "rb") as c:
                        args = c.read().replace(b"\0", b" ")[:120].decode(errors="replace")
                    found.append(f"{pid} {args}")
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def assert_no_leftovers(tag: str, grace_s: float = 20.0) -> None:
    deadline = time.time() + grace_s
    while tagged_processes(tag) and time.time() < deadline:
        time.sleep(1)
    assert not tagged_processes(tag), f"processes left behind: {tagged_processes(tag)}"
