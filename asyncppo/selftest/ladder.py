"""Running rungs and writing their results: one record per rung, JSON and a markdown table.

A rung is a function of the :class:`Context` that returns its figures; raising :class:`Skip` skips it with the
reason, any other exception fails it with the error (and the ladder goes on: one broken rung must not hide the
others' figures).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
import traceback
from typing import Any, Callable, Optional


class Skip(Exception):
    """The rung cannot run here; the message says why."""


@dataclasses.dataclass
class Context:
    """What every rung may use: the device, the sizes, the built model and where to write."""

    device: str  # "cuda" | "cpu"
    out_dir: str
    model_dir: str = ""
    size: str = "tiny"  # "0.5b" on CUDA, "tiny" on CPU
    shared_steps: int = 20
    gpu_count: int = 0


@dataclasses.dataclass
class RungResult:
    name: str
    title: str
    status: str  # passed | failed | skipped
    seconds: float
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)
    detail: str = ""  # the error (failed) or the reason (skipped)


def run_rung(name: str, title: str, fn: Callable[[Context], dict], ctx: Context) -> RungResult:
    t0 = time.perf_counter()
    try:
        figures = fn(ctx)
        status, detail = "passed", ""
    except Skip as why:
        figures, status, detail = {}, "skipped", str(why)
    except Exception as exc:  # a failed rung is reported, and the ladder goes on
        tb = traceback.format_exc(limit=4).strip().splitlines()
        figures, status, detail = {}, "failed", f"{type(exc).__name__}: {exc} | {' / '.join(tb[-3:])}"
    finally:
        release_device_memory(ctx.device)
    return RungResult(name, title, status, round(time.perf_counter() - t0, 2), figures or {}, detail)


def release_device_memory(device: str) -> None:
    """Give the rung's freed CUDA blocks back to the device. The ladder's own process keeps a caching allocator
    across rungs, and later rungs start other processes on the same GPU: on one H100 the learner of the ``--gpus 1``
    launch ran out of memory while this process still held 43 GiB cached by the earlier rungs."""
    if device != "cuda":
        return
    import gc

    import torch  # heavy: torch

    gc.collect()
    torch.cuda.empty_cache()


def _figure(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(results: list[RungResult], header: str) -> str:
    """The table for docs/benchmarks.md: one row per rung."""
    lines = [header, "", "| rung | status | figures | seconds |", "|---|---|---|---|"]
    for r in results:
        figures = ", ".join(f"{k} {_figure(v)}" for k, v in r.figures.items())
        if r.detail:
            figures = (figures + "; " if figures else "") + r.detail.replace("|", "/")
        lines.append(f"| {r.title} | {r.status} | {figures} | {r.seconds:g} |")
    return "\n".join(lines) + "\n"


def environment(ctx: Context) -> dict[str, Any]:
    """What the figures were measured on."""
    import torch  # heavy: torch

    env: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__, "device": ctx.device,
                           "size": ctx.size, "host_cpus": os.cpu_count()}
    if ctx.device == "cuda":
        env["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        env["cuda"] = torch.version.cuda
    try:
        import transformers  # heavy: transformers

        env["transformers"] = transformers.__version__
    except ImportError:
        env["transformers"] = None
    return env


def write(results: list[RungResult], ctx: Context, env: dict[str, Any], started: float,
          command: Optional[str] = None) -> tuple[str, str]:
    """``selftest.json`` and ``selftest.md`` in the output directory; returns their paths."""
    os.makedirs(ctx.out_dir, exist_ok=True)
    doc = {"environment": env, "command": command, "seconds": round(time.time() - started, 1),
           "rungs": [dataclasses.asdict(r) for r in results]}
    json_path, md_path = os.path.join(ctx.out_dir, "selftest.json"), os.path.join(ctx.out_dir, "selftest.md")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
    gpus = ", ".join(env.get("gpus") or []) or "no GPU"
    header = (f"asyncppo selftest on {ctx.device} ({gpus}; torch {env.get('torch')}, Python {env.get('python')}; "
              f"{ctx.size} model), {doc['seconds']:g} s in all; command: `{command}`")
    with open(md_path, "w") as f:
        f.write(markdown(results, header))
    return json_path, md_path
