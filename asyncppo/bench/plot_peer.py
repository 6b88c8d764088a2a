"""Held-out accuracy against training time, asyncppo beside TRL: the picture of the peer benchmark on ``data=long``.

``asyncppo bench peer`` keeps each seed's ``bench_peer_long.json`` (the shared start and each contender's scored
points) and draws ``bench_peer_long.png`` beside it with :func:`plot`. Sampled accuracy (4 answers a prompt at
T = 1) is the solid line, greedy the dashed one; the dotted horizontal line is the lower of the two final sampled
accuracies and each contender's marker is where its curve first reaches it (curves.py: linear between scored
points), with the ratio of the two times in the legend, and the ratio that takes asyncppo's first scored point at or
above the line instead of interpolating from the start. Both curves start at the shared start (0 s), so what
differs is how fast training moved each one.
"""

from __future__ import annotations

from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from asyncppo.bench.curves import compare, curves_of, first_scored  # noqa: E402

COLORS = {"asyncppo": "tab:blue", "trl": "tab:orange", "trl:spg1": "tab:orange", "trl:spg4": "tab:red",
          "trl:spg1-cb": "tab:green", "trl:spg4-cb": "tab:purple"}  # the pilot's TRL setups each a colour


def plot(doc: dict, path: str, title: Optional[str] = None) -> dict:
    """Draw ``doc`` (the JSON of ``bench_peer.py --task long``) to ``path``; returns what the markers show: the
    threshold, the time each contender reached it (None: never) and the ratio (:func:`curves.compare`), or an
    empty dict when the file lacks one of the two contenders (the curves are drawn all the same)."""
    sampled, greedy = curves_of(doc, "sampled"), curves_of(doc, "greedy")
    fig, ax = plt.subplots(figsize=(10, 4.2), dpi=100)
    for name, points in sampled.items():
        color = COLORS.get(name, "tab:gray")
        ax.plot(*zip(*points), color=color, marker="o", linewidth=1.6, label=f"{name}: sampled")
        ax.plot(*zip(*greedy[name]), color=color, linestyle="--", linewidth=1.0, alpha=0.7,
                label=f"{name}: greedy")
    shown: dict = {}
    if set(sampled) == {"asyncppo", "trl"}:
        shown = compare(sampled, fast="asyncppo", slow="trl")
        ax.axhline(shown["threshold"], color="black", linestyle=":", linewidth=1.0,
                   label=f"lower final (sampled) {shown['threshold']:.3f}")
        for name, t in shown["reached"].items():
            if t is not None:
                ax.plot([t], [shown["threshold"]], marker="D", markersize=8, color=COLORS[name],
                        markeredgecolor="black", linestyle="none",
                        label=f"{name} reaches it at {t:.0f} s")
        ratio, t_slow = shown["speedup"], shown["reached"]["trl"]
        scored = first_scored(sampled["asyncppo"], shown["threshold"])
        if ratio is not None:
            text = "TRL never" if ratio == float("inf") else f"{ratio:.1f}x interpolated"
            if scored and t_slow is not None:  # no interpolation before asyncppo's first scored point
                shown["at_least"] = t_slow / scored
                text = f">= {shown['at_least']:.1f}x at scored points, " + text
            ax.plot([], [], linestyle="none", label="asyncppo sooner: " + text)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(title or f"held-out accuracy against training time ({doc.get('seconds', 0):.0f} s each)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return shown
