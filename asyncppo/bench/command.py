"""``asyncppo bench``: its arguments and what each mode does. Importing this module imports nothing heavy (the
command line builds every parser at start); a benchmark's runner is imported only when it runs."""

from __future__ import annotations

import argparse
import os
import sys

HELP = "run a registered benchmark (one JSON result each), list them, rerun the cheap ones, render the docs"
DESCRIPTION = (
    "Run benchmark NAME at its default seeds (or --seeds) and write one JSON result under bench-results/NAME/: the "
    "question, the command and options, the commit, the machine, every figure per seed with its spread, and the "
    "verdict against the target fixed in the registry. KEY=VALUE sets one of the benchmark's options (see --list "
    "and docs/benchmarks.md); any other KEY=VALUE is a config override passed to its launches. --record also "
    "copies the result to docs/benchmarks/results/NAME.json, from which --render writes docs/benchmarks.md.")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help=HELP, description=DESCRIPTION)
    p.add_argument("name", nargs="?", metavar="NAME", help="the benchmark (see --list)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="benchmark options or config overrides")
    p.add_argument("--list", action="store_true", help="print every benchmark: question, target, time, seeds")
    p.add_argument("--seeds", metavar="S,S,...", default=None, help="seeds to run (default: the registry's)")
    p.add_argument("--record", action="store_true",
                   help="also write the result to docs/benchmarks/results/NAME.json (the committed figure)")
    p.add_argument("--out", metavar="DIR", default=None, help="where results go (default: bench-results/)")
    p.add_argument("--quick", action="store_true",
                   help="rerun the cheap benchmarks at reduced size and print them beside the committed figures")
    p.add_argument("--only", metavar="NAME,...", default="", help="with --quick: only these benchmarks")
    p.add_argument("--render", action="store_true", help="write docs/benchmarks.md from the committed results")
    p.add_argument("--check", action="store_true", help="with --render: write nothing, exit 1 if the page is stale")
    p.add_argument("--results", metavar="DIR", default=None,
                   help="the committed results (default: docs/benchmarks/results/)")
    p.set_defaults(func=run)


def _fail(msg: str) -> int:
    print(f"asyncppo: {msg}", file=sys.stderr)
    return 2


def _render(args: argparse.Namespace) -> int:
    from asyncppo.bench.driver import RECORD_DIR
    from asyncppo.bench.machine import REPO
    from asyncppo.bench.registry import BENCHMARKS
    from asyncppo.bench.render import render

    page = os.path.join(REPO, "docs", "benchmarks.md")
    text = render(BENCHMARKS, args.results or RECORD_DIR, os.path.join(REPO, "docs", "benchmarks", "prose.md"))
    if args.check:
        with open(page, encoding="utf-8") as f:
            stale = f.read() != text
        print(f"{page}: {'stale: run asyncppo bench --render' if stale else 'up to date'}")
        return 1 if stale else 0
    with open(page, "w", encoding="utf-8") as f:
        f.write(text)
    print(f"asyncppo: wrote {page}")
    return 0


def run(args: argparse.Namespace) -> int:
    from asyncppo.bench import registry

    if args.list:
        print(registry.format_list())
        return 0
    if args.render:
        return _render(args)
    from asyncppo.bench.driver import RECORD_DIR, RESULTS_DIR, OptionError, resolve_options, run_benchmark

    if args.quick:
        from asyncppo.bench.quick import run_quick

        try:
            text, failed = run_quick([n for n in args.only.split(",") if n], args.out or RESULTS_DIR,
                                     args.results or RECORD_DIR)
        except ValueError as exc:
            return _fail(str(exc))
        print(text)
        return 1 if failed else 0
    if not args.name:
        return _fail("bench needs NAME, --list, --quick or --render")
    try:
        bench = registry.get(args.name)
        opts = resolve_options(bench, list(args.overrides))
        seeds = bench.seeds if args.seeds is None else [int(s) for s in args.seeds.split(",") if s.strip()]
    except KeyError as exc:
        return _fail(exc.args[0])
    except (OptionError, ValueError) as exc:
        return _fail(str(exc))
    argv = [args.name, *args.overrides, *(["--seeds", args.seeds] if args.seeds else [])]
    result, path = run_benchmark(bench, opts, list(seeds), out_dir=args.out or RESULTS_DIR,
                                 record_dir=(args.results or RECORD_DIR) if args.record else None, argv=argv)
    fig = result.figure(result.headline) if result.headline else None
    from asyncppo.bench.render import spread

    print(f"asyncppo: {bench.name}: {result.headline or 'no headline figure'}: {spread(fig) if fig else '-'}; "
          f"target {bench.target.describe() if bench.target else 'none'}: {result.verdict}")
    print(f"asyncppo: result written to {path}" + (" and recorded" if args.record else ""))
    return 1 if result.details.get("errors") else 0
