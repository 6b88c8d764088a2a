"""The ``asyncppo convert`` subcommand: its arguments and the file writing around :func:`convert`.

Exit codes: 0 the converted config validates (flagged keys may still need your attention: they are printed),
1 it was written but does not validate (the report lists why), 2 bad usage or unreadable input.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from asyncppo.config.convert import ConvertError, convert

EPILOG = """\
examples:
  asyncppo convert --from verl ppo_trainer.yaml                 # -> ppo_trainer.asyncppo.yaml + .report.md
  asyncppo convert --from roll rlvr_config.yaml -o my_run.yaml  # -> my_run.yaml + my_run.report.md
  asyncppo launch --config-file my_run.yaml --dry-run           # check it, then run without --dry-run

The report lists every key of the input: mapped, approximate (with why) or unsupported, flagged where the
converted run would behave differently; see docs/configuration.md, "Converting a verl, ROLL or RLinf config".
"""
HELP = "convert a verl, ROLL or RLinf config into an asyncppo config plus a report"
DESCRIPTION = ("Read a config in verl, ROLL or RLinf format and write an asyncppo config (run it with "
               "'asyncppo launch --config-file') and a markdown report accounting for every key.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The subcommand's arguments; the parser itself (``HELP``, ``DESCRIPTION``, ``EPILOG``) is made by cli.py like
    every other subcommand's."""
    p.add_argument("--from", dest="project", required=True, choices=("verl", "roll", "rlinf"),
                   help="the project whose config format CONFIG is in")
    p.add_argument("config", metavar="CONFIG.yaml", help="the foreign config file")
    p.add_argument("-o", "--output", metavar="OUT.yaml", default=None,
                   help="where to write the asyncppo config (default: CONFIG.asyncppo.yaml next to the input)")
    p.add_argument("--report", metavar="REPORT.md", default=None,
                   help="where to write the report (default: the output path with .report.md)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    src = Path(args.config)
    if not src.is_file():
        print(f"asyncppo: convert: no such file: {src}", file=sys.stderr)
        return 2
    try:
        result = convert(src.read_text(encoding="utf-8"), args.project, src.name)
    except ConvertError as exc:
        print(f"asyncppo: convert: {src}: {exc}", file=sys.stderr)
        return 2
    out = Path(args.output) if args.output else src.with_name(src.stem + ".asyncppo.yaml")
    report = Path(args.report) if args.report else out.with_name(out.name.removesuffix(".yaml") + ".report.md")
    out.write_text(result.yaml, encoding="utf-8")
    report.write_text(result.report, encoding="utf-8")
    n = len(result.entries)
    by = {s: sum(e.status == s for e in result.entries.values()) for s in ("mapped", "approximate", "unsupported",
                                                                           "unknown")}
    print(f"asyncppo: converted {n} {args.project} keys ({by['mapped']} mapped, {by['approximate']} approximate, "
          f"{by['unsupported']} unsupported, {by['unknown']} unknown) -> {out}\n"
          f"asyncppo: report -> {report}")
    for e in result.flagged:
        print(f"  flagged: {e.key} = {e.value!r}: {e.status}{': ' + e.why if e.why else ''}")
    if result.problems:
        print("asyncppo: the converted config does not validate:", file=sys.stderr)
        for p in result.problems:
            print(f"  - {p}", file=sys.stderr)
        return 1
    print(f"asyncppo: check it with: asyncppo launch --config-file {out} --dry-run")
    return 0
