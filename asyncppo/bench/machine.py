"""Where a benchmark ran: the machine (cores, CPU model, load, GPU) and the code (git commit, dirty tree).

A figure from a 2-core box shared with other jobs and one from an idle server are different measurements, and the
diary this replaces lost that context more than once; every result file therefore carries it, measured here.
"""

from __future__ import annotations

import os
import subprocess

from asyncppo.bench.result import NOT_RECORDED, Machine

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or NOT_RECORDED


def load_average() -> float:
    return round(os.getloadavg()[0], 2)


def gpus() -> str:
    """The CUDA devices torch sees ("none" without torch or without a device). Importing torch is what the
    benchmarks do anyway; asking here before they start costs nothing they would not pay."""
    try:
        import torch
    except ImportError:
        return "none"
    if not torch.cuda.is_available():
        return "none"
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", ".join(f"{names.count(n)}x {n}" for n in dict.fromkeys(names))


def machine_before() -> Machine:
    return Machine(cores=os.cpu_count() or NOT_RECORDED, cpu_model=cpu_model(), load_before=load_average(),
                   load_after=NOT_RECORDED, gpu=gpus())


def git_state(repo: str = REPO) -> dict:
    """The commit checked out and whether tracked files differ from it (untracked ones do not count)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, timeout=30,
                              check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.SubprocessError):
        return {"commit": NOT_RECORDED, "dirty": NOT_RECORDED}
