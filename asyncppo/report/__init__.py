"""Reading a finished (or running) run directory: the run report (plots) and the placement advisor (a pure
discrete-event model of the pipeline). Nothing here touches a live run: it reads metrics.jsonl, summary.json and
config.yaml only. ``write_report(run_dir)`` is what the launcher calls at the end of every run."""


def write_report(run_dir, *others, out_dir=None):
    """Render ``report.png`` and one PNG per panel for ``run_dir`` (overlaying ``others``); returns the paths."""
    from asyncppo.report.plots import write_report as _write  # heavy: matplotlib, numpy (kept off `--help`)

    return _write(run_dir, *others, out_dir=out_dir)


__all__ = ["write_report"]
