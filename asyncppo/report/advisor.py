"""``asyncppo advise``: simulate every rollout/train split of a GPU budget and every ``max_staleness``, recommend one.

Why a recommendation rule and not just "the fastest": more staleness is never free for learning (docs/staleness.md),
so among the configurations within ``tolerance`` (default 3%) of the best predicted throughput the advisor picks the
smallest ``k``, then the smallest admission lookahead ``j`` (the lag most samples get), then the split with the least
idle GPU time. Lookaheads (``--lookahead``) are swept beside ``k`` because on long-tailed groups they decide how full
the engines run: a group holds its ticket until its last sample ends, so the window of ``(j + 1) * B`` groups holds
far fewer running samples than ``(j + 1) * B * n`` (docs/staleness.md, "Choosing j"). A synchronous trainer colocated on the whole budget
(every GPU generates, then every GPU trains) is simulated alongside as the baseline that published speed-ups are
measured against.

Splits: with one node every split ``R`` rollout GPUs (a multiple of the engine's tensor-parallel size ``tp``) and
``N - R`` train GPUs is tried (at most ``max_splits`` of them, evenly spread); with ``--nodes K > 1`` the two pools
get whole nodes, as disjoint pools on a cluster do.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional, Sequence

from asyncppo.pipeline.model import Result
from asyncppo.report.rates import Rates
from asyncppo.pipeline.simulator import simulate


@dataclass
class Row:
    rollout_gpus: int
    train_gpus: int
    max_staleness: int
    result: Result
    colocated: bool = False
    lookahead: Optional[int] = None  # j; None: k (no lookahead)

    @property
    def j(self) -> int:
        return self.max_staleness if self.lookahead is None else self.lookahead

    @property
    def label(self) -> str:
        if self.colocated:
            return f"colocated sync ({self.rollout_gpus} GPUs)"
        ahead = "" if self.lookahead is None else f", j={self.lookahead}"
        return f"{self.rollout_gpus} rollout / {self.train_gpus} train, k={self.max_staleness}{ahead}"

    @property
    def overrides(self) -> str:
        """The configuration keys of this row, as ``asyncppo launch`` takes them."""
        ahead = "" if self.lookahead is None else f" rollout.admission_lookahead={self.lookahead}"
        return f"rollout.max_staleness={self.max_staleness}{ahead}"


def splits(gpus: int, nodes: int = 1, tp: int = 1, max_splits: int = 12) -> list[int]:
    """Rollout GPU counts to try (the rest train)."""
    if gpus < 2:
        raise ValueError(f"--gpus {gpus}: need at least 2 GPUs (one engine and one learner rank)")
    if nodes < 1 or gpus % nodes:
        raise ValueError(f"--gpus {gpus} must be a multiple of --nodes {nodes}")
    unit = gpus // nodes if nodes > 1 else tp
    if unit % tp:
        raise ValueError(f"GPUs per node ({unit}) must be a multiple of the engine tensor-parallel size {tp}")
    options = list(range(unit, gpus, unit))
    if not options:
        raise ValueError(f"--gpus {gpus} with --nodes {nodes}: no split leaves GPUs on both sides")
    if len(options) > max_splits:
        step = (len(options) - 1) / (max_splits - 1)
        options = sorted({options[round(i * step)] for i in range(max_splits)})
    return options


def lookaheads_for(k: int, lookaheads: Optional[Sequence[Optional[int]]]) -> list[Optional[int]]:
    """The lookaheads to try under ``k``: each given ``j < k``, and always none (``j = k``: ticket order, the
    baseline a lookahead is judged against)."""
    return [*sorted({j for j in (lookaheads or ()) if j is not None and 0 <= j < k}), None]


def sweep(rates: Rates, gpus: int, nodes: int = 1, tp: int = 1, ks: Sequence[int] = (0, 1, 2, 4, 8),
          steps: int = 40, warmup: int = 10, switch_s: float = 0.0, max_splits: int = 12,
          batch_groups: Optional[int] = None, lookaheads: Optional[Sequence[int]] = None) -> list[Row]:
    """Every split x every ``k`` (``k >= sync_every - 1``) x every lookahead ``j < k`` (default: the run's own, if
    it set one), plus the colocated synchronous baseline. A ``j < sync_every - 1`` is left out, as the config
    refuses it: its tickets would wait for weights that no push brings."""
    common = dict(steps=steps, warmup_steps=warmup)
    if batch_groups:
        common["batch_groups"] = batch_groups
    if lookaheads is None:
        lookaheads = () if rates.lookahead is None else (rates.lookahead,)
    rows = []
    floor = 0 if rates.sync_auto else rates.sync_every - 1  # an auto cadence follows each window (Rates.setup)
    for r in splits(gpus, nodes, tp, max_splits):
        for k in ks:
            if k < floor:
                continue
            for j in lookaheads_for(k, lookaheads):
                if j is not None and j < floor:
                    continue
                setup = rates.setup(engines=r // tp, train_ranks=gpus - r, max_staleness=k, lookahead=j, **common)
                rows.append(Row(r, gpus - r, k, simulate(setup, rates.gen, rates.train, rates.lengths),
                                lookahead=j))
    colo = dataclasses.replace(rates.setup(engines=gpus // tp, train_ranks=gpus, max_staleness=0, sync_every=1,
                                           lookahead=None, colocated=True, switch_s=switch_s, **common))
    rows.append(Row(gpus, gpus, 0, simulate(colo, rates.gen, rates.train, rates.lengths), colocated=True))
    return rows


def recommend(rows: Sequence[Row], tolerance: float = 0.03) -> Row:
    candidates = [r for r in rows if not r.colocated]
    best = max(r.result.samples_per_s for r in candidates)
    good = [r for r in candidates if r.result.samples_per_s >= (1 - tolerance) * best]
    return min(good, key=lambda r: (r.max_staleness, r.j, r.result.idle_gpu_frac))


def format_table(rows: Sequence[Row], pick: Row) -> str:
    base = next((r for r in rows if r.colocated), None)
    head = (f"{'rollout':>7s} {'train':>5s} {'k':>2s} {'j':>2s} | {'samples/s':>9s} {'tokens/s':>10s} {'vs sync':>7s} | "
            f"{'gen busy':>8s} {'train busy':>10s} {'occup.':>6s} | {'lag':>4s} {'tok lag':>7s} {'lag max':>7s} | "
            f"{'idle GPU':>8s} {'waste':>5s}")
    out = [head, "-" * len(head)]
    for r in rows:
        x = r.result
        rel = x.samples_per_s / base.result.samples_per_s if base and base.result.samples_per_s else float("nan")
        split = ("colocated", "sync") if r.colocated else (str(r.rollout_gpus), str(r.train_gpus))
        mark = "  <- recommended" if r is pick else ""
        out.append(f"{split[0]:>7s} {split[1]:>5s} {r.max_staleness:>2d} {r.j:>2d} | {x.samples_per_s:9.2f} {x.tokens_per_s:10.0f} "
                   f"{rel:6.2f}x | {x.rollout_busy:8.2f} {x.train_busy:10.2f} {x.occupancy:6.2f} | {x.lag_mean:4.2f} "
                   f"{x.token_lag_mean:7.2f} {x.lag_max:7d} | {x.idle_gpu_frac:8.2f} {x.waste:5.2f}{mark}")
    return "\n".join(out)


def plot(rows: Sequence[Row], pick: Row, path: str, title: str = "") -> str:
    import matplotlib  # heavy: matplotlib, only when a plot is drawn

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt  # heavy: matplotlib; after use("Agg") so no display backend is tried

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for k, j in sorted({(r.max_staleness, r.j) for r in rows if not r.colocated}):
        pts = sorted((r.rollout_gpus, r.result.samples_per_s) for r in rows
                     if not r.colocated and (r.max_staleness, r.j) == (k, j))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"max_staleness={k}" + (f", lookahead={j}" if j < k else ""))
    base = next((r for r in rows if r.colocated), None)
    if base is not None:
        ax.axhline(base.result.samples_per_s, color="grey", linestyle="--", label="colocated synchronous")
    ax.scatter([pick.rollout_gpus], [pick.result.samples_per_s], s=160, facecolors="none", edgecolors="red",
               linewidths=2, label=f"recommended: {pick.label}", zorder=5)
    ax.set_xlabel("rollout GPUs (the rest train)")
    ax.set_ylabel("predicted trained samples / s")
    ax.set_title(title or "Predicted throughput over the rollout/train split", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
