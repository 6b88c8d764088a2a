"""The run report: ``report.png`` (every panel on one page) and one PNG per panel, for one run or several overlaid.

Each panel is a small function of the runs; a metric a run did not log is skipped (and a panel with nothing to
draw says so instead of vanishing), so old runs, GRPO runs without a critic and crashed runs still get a report.
Colours tell runs apart, line styles tell metrics apart. matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import numpy as np
from PIL import Image

from asyncppo.report.runs import Run, load_run

PAGE_DPI = 80  # report.png; each panel's PNG is cut out of it

_STYLES = ["-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (1, 3)), (0, (8, 2))]
_SMOOTH_OVER = 25  # more points than this: draw a moving average over the faint raw curve


def _smooth(ys: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, y in enumerate(ys):
        acc += y
        if i >= window:
            acc -= ys[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _line(ax, xs, ys, color, style, label) -> bool:
    if not xs:
        return False
    if len(xs) > _SMOOTH_OVER:
        ax.plot(xs, ys, color=color, linestyle=style, alpha=0.25, linewidth=0.8)
        ax.plot(xs, _smooth(ys, max(3, len(xs) // 20)), color=color, linestyle=style, label=label, linewidth=1.4)
    else:
        ax.plot(xs, ys, color=color, linestyle=style, label=label, linewidth=1.4, marker="." if len(xs) < 12 else None)
    return True


def _label(run: Run, metric: str, runs: Sequence[Run]) -> str:
    return metric if len(runs) == 1 else f"{run.name}: {metric}"


def _metrics_panel(keys: Sequence[tuple[str, str]], ylabel: str, twin: Sequence[tuple[str, str]] = (),
                   twin_label: str = "", x: str = "step") -> Callable:
    """A panel drawing ``keys`` (metric key, legend name) against step or wall time, ``twin`` on a right axis."""

    def draw(ax, runs: Sequence[Run], colors) -> bool:
        drawn = False
        ax2 = ax.twinx() if twin else None
        ax.asyncppo_twin = ax2  # _draw merges both axes' legends
        for run, color in zip(runs, colors):
            walls = run.wall_of_step() if x == "wall" else None
            for (axis, group) in ((ax, keys), (ax2, twin)):
                for i, (key, name) in enumerate(group):
                    xs, ys = run.get(key)
                    if x == "wall":
                        pts = [(walls[s], y) for s, y in zip(xs, ys) if s in walls]
                        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
                    style = _STYLES[(i + (len(keys) if axis is ax2 else 0)) % len(_STYLES)]
                    drawn |= _line(axis, xs, ys, color, style, _label(run, name, runs))
        ax.set_ylabel(ylabel)
        if ax2 is not None:
            ax2.set_ylabel(twin_label)
        return drawn

    return draw


def _reward_panel(x: str) -> Callable:
    """Training reward (lines) and every held-out metric (markers) against step or wall time."""

    def draw(ax, runs: Sequence[Run], colors) -> bool:
        drawn = False
        for run, color in zip(runs, colors):
            walls = run.wall_of_step()
            xs, ys = run.get("reward/mean")
            if x == "wall":
                xs = [walls.get(s, float("nan")) for s in xs]
            drawn |= _line(ax, xs, ys, color, "-", _label(run, "reward", runs))
            markers = "osD^v<>p*"
            for i, key in enumerate(k for k in run.eval_keys() if "accuracy" in k):
                ex, ey = run.get(key, run.evals)
                if x == "wall":
                    last = max(walls) if walls else 0.0
                    ex = [walls.get(s, walls[last] if s >= last else float("nan")) for s in ex]
                if ex:
                    ax.plot(ex, ey, color=color, linestyle=":", marker=markers[i % len(markers)], markersize=5,
                            label=_label(run, key[len("eval/"):], runs))
                    drawn = True
        ax.set_ylabel("reward / accuracy")
        return drawn

    return draw


# (file name, title, x label, draw function)
PANELS: list[tuple[str, str, str, Callable]] = [
    ("reward_step", "Reward and held-out accuracy", "learner step", _reward_panel("step")),
    ("reward_wall", "Reward and held-out accuracy against time", "wall time (s)", _reward_panel("wall")),
    # under rollout.max_staleness=auto the window in force (tune/k, tune/j) on the same axis: the lag against its bound
    ("lag", "Policy lag and window (versions)", "learner step", _metrics_panel(
        [("staleness/min", "lag min"), ("staleness/mean", "lag mean"), ("staleness/max", "lag max"),
         ("staleness/token_mean", "token-weighted lag"), ("tune/k", "window k (auto)"),
         ("tune/j", "window j (auto)")], "lag")),
    ("utilisation", "Busy fractions and engine occupancy", "learner step", _metrics_panel(
        [("util/rollout_busy", "rollout busy"), ("util/train_busy", "train busy"),
         ("rollout/occupancy", "engine occupancy")], "fraction")),
    # three KLs: of the update (approx KL; 0 with one update per batch), of the samples' lag (behaviour -> proximal,
    # what the PPO ratio corrects) and to the reference (the KL loss, when on)
    ("policy", "KL, clip fractions and entropy", "learner step", _metrics_panel(
        [("actor/approx_kl", "approx KL"), ("actor/mismatch_kl", "off-policy KL"), ("actor/kl_loss", "KL to ref"),
         ("actor/clipfrac", "clip frac"), ("actor/clipfrac_low", "clip low"), ("actor/clipfrac_high", "clip high")],
        "KL / fraction", twin=[("actor/entropy", "entropy")], twin_label="entropy")),
    ("lengths", "Response length and waste", "learner step", _metrics_panel(
        [("response_length/mean", "length mean"), ("response_length/p99", "length p99")], "tokens",
        twin=[("waste/tokens_frac", "waste")], twin_label="waste (dropped tokens / generated)")),
    ("push", "Weight push latency", "learner step", _metrics_panel([("sync/push_s", "push s (max per step)")],
                                                                   "seconds")),
]


# drawn only for runs that log it: mixture-of-experts policies with algorithm.routing_replay on (docs/moe.md)
MOE_PANEL = ("moe", "MoE routing: learner against engine", "learner step", _metrics_panel(
    [("moe/routing_mismatch", "routing mismatch"), ("moe/routing_mismatch_fresh", "mismatch, same weights"),
     ("moe/routing_mismatch_stale", "mismatch, lagged"), ("actor/mismatch_kl", "off-policy KL")],
    "fraction / KL", twin=[("moe/expert_load", "expert load (max / mean)")], twin_label="expert load"))


def _panels(runs) -> list:
    return PANELS + ([MOE_PANEL] if any(run.get("moe/routing_mismatch")[0] for run in runs) else [])


def _draw(ax, runs, colors, title, xlabel, fn) -> bool:
    drawn = fn(ax, runs, colors)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(alpha=0.3)
    if drawn:
        handles, labels = [], []
        for a in (ax, getattr(ax, "asyncppo_twin", None)):
            if a is not None:
                h, lab = a.get_legend_handles_labels()
                handles += h
                labels += lab
        if handles:
            ax.legend(handles, labels, fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes, color="grey")
    return drawn


def write_report(*run_dirs: str, out_dir: Optional[str] = None, names: Optional[Sequence[str]] = None) -> dict:
    """Render the report of ``run_dirs`` (one run, or several overlaid) into ``out_dir`` (default: the first run's
    directory, or ``<first run>/compare`` when overlaying). Returns ``{panel: path, "report": path}``."""
    import matplotlib  # heavy: matplotlib, only when a report is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # heavy: matplotlib; after use("Agg") so no display backend is tried

    if not run_dirs:
        raise ValueError("write_report needs at least one run directory")
    runs = [load_run(d, (names or [None] * len(run_dirs))[i]) for i, d in enumerate(run_dirs)]
    if out_dir is None:
        out_dir = runs[0].path if len(runs) == 1 else os.path.join(runs[0].path, "compare")
    panel_dir = os.path.join(out_dir, "report")
    os.makedirs(panel_dir, exist_ok=True)
    colors = [plt.get_cmap("tab10")(i % 10) for i in range(len(runs))]
    # One drawing: the page is rendered once and each panel's PNG is cut out of its pixels (drawing every panel a
    # second time on its own figure doubled the time, ~11 s -> ~5 s at the end of every run on two CPU cores).
    panels = _panels(runs)
    cols = 2
    rows = (len(panels) + 1 + cols - 1) // cols  # and a slot for the summary text
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.2 * rows), dpi=PAGE_DPI)
    flat = list(axes.flat)
    for ax, (name, title, xlabel, fn) in zip(flat, panels):
        _draw(ax, runs, colors, title, xlabel, fn)
    for ax in flat[len(panels):]:
        _summary_text(ax, runs)
    fig.suptitle("asyncppo run report: " + ", ".join(r.name for r in runs), fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    page = np.asarray(fig.canvas.buffer_rgba())
    paths: dict[str, str] = {}
    height = page.shape[0]
    for ax, (name, *_) in zip(flat, panels):
        boxes = [a.get_tightbbox(renderer) for a in (ax, getattr(ax, "asyncppo_twin", None)) if a is not None]
        x0, y0 = min(b.x0 for b in boxes), min(b.y0 for b in boxes)
        x1, y1 = max(b.x1 for b in boxes), max(b.y1 for b in boxes)
        pad = 4  # display y grows upwards, image rows downwards
        top, bottom = max(0, int(height - y1) - pad), min(height, int(height - y0) + pad)
        left, right = max(0, int(x0) - pad), min(page.shape[1], int(x1) + pad)
        paths[name] = os.path.join(panel_dir, f"{name}.png")
        _save_png(page[top:bottom, left:right], paths[name])
    paths["report"] = os.path.join(out_dir, "report.png")
    _save_png(page, paths["report"])
    plt.close(fig)
    return paths


def _save_png(rgba, path: str) -> None:
    Image.fromarray(np.ascontiguousarray(rgba)).save(path)


def _summary_text(ax, runs: Sequence[Run]) -> None:
    """The spare cell: a few run totals from summary.json (when the run finished)."""
    ax.axis("off")
    lines = []
    for run in runs:
        s, ro = run.summary, run.summary.get("rollout", {}) if isinstance(run.summary.get("rollout"), dict) else {}
        walls = run.wall_of_step()
        lines.append(f"{run.name}")
        lines.append(f"  steps {s.get('steps', len(run.records))}, samples {s.get('samples_trained', '?')}, "
                     f"train wall {max(walls.values()) if walls else 0:.0f}s")
        for when in ("eval_before", "eval_after"):
            if isinstance(s.get(when), dict):
                lines.append(f"  {when}: " + ", ".join(f"{k} {v:.3f}" for k, v in s[when].items()
                                                       if isinstance(v, (int, float))))
        if ro:
            lines.append(f"  occupancy {ro.get('occupancy', 0):.2f}, push p50 {ro.get('push_s_p50', 0):.3f}s, "
                         f"length mean {ro.get('response_length_mean', 0):.1f} p99 {ro.get('response_length_p99', 0):.0f}")
    ax.text(0.0, 1.0, "\n".join(lines) or "no summary.json", va="top", ha="left", family="monospace", fontsize=8,
            transform=ax.transAxes)
