"""The ``asyncppo`` command line.

Subcommands live in :data:`SUBCOMMANDS` (name -> function that adds its parser); each parser sets ``func`` to a
handler returning the exit code, so adding ``asyncppo bench`` is one function plus one entry. Heavy imports
(Ray, torch, the runner) happen inside handlers only: ``--help`` and ``--dry-run`` stay fast and work even where
the training stack is not importable. Exit codes: 0 success, 2 invalid configuration or usage (message on stderr,
no traceback), anything else comes from the runner.
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Callable, Optional, Sequence

DOCS = "docs/configuration.md"

_LAUNCH_EPILOG = f"""\
overrides use Hydra syntax, KEY=VALUE with dotted keys into the config tree, or GROUP=PRESET:
  algorithm=ppo|grpo|rloo|reinforce_plus_plus     (default: ppo)
  data=addition|gsm8k                             (default: addition)
  +extra.KEY=VALUE                                free-form keys, kept in cfg.extra

examples:
  asyncppo launch --dry-run
  asyncppo launch algorithm=grpo algorithm.pg_clip=0.28 rollout.max_staleness=4
  asyncppo launch --rollout-gpus 2 --train-gpus 2 data=gsm8k model.path=/models/qwen \\
      data.train_files=[/data/gsm8k/train.parquet] data.eval_files=[/data/gsm8k/test.parquet]

every option, its default, allowed values and its verl / ROLL / RLinf name: {DOCS}
"""


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="start a training run (or show its resolved config and placement with --dry-run)",
        description="Compose the configuration (presets + overrides), validate it, plan where each role runs, "
        "then start the learner and the rollout workers on Ray.",
        epilog=_LAUNCH_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. algorithm.pg_clip=0.28 or algorithm=grpo")
    p.add_argument("--rollout-gpus", type=int, metavar="N", default=None,
                   help="GPUs for rollout: N engines with one GPU each; 0 runs cluster.rollout_workers CPU rollout "
                   "actors (same as cluster.rollout_gpus=N; the flag wins over an override)")
    p.add_argument("--train-gpus", type=int, metavar="M", default=None,
                   help="GPUs for training: M learner ranks with one GPU each; 0 runs one CPU learner "
                   "(same as cluster.train_gpus=M; the flag wins over an override)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config as YAML and the placement plan, then exit without starting "
                   "anything")
    p.add_argument("--config-dir", metavar="DIR", default=None,
                   help="compose from this directory instead of the packaged configs (it must hold config.yaml; "
                   "copy asyncppo/configs to start)")
    p.set_defaults(func=_cmd_launch)


# name -> adds the subcommand's parser (which sets func=handler(args) -> exit code)
SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {"launch": _add_launch}


def build_parser() -> argparse.ArgumentParser:
    from asyncppo import __version__

    parser = argparse.ArgumentParser(
        prog="asyncppo",
        description="Asynchronous off-policy streaming PPO for language models: vLLM rollout workers stream "
        "version-stamped samples over ZeroMQ to a PPO learner that pushes weights back, with bounded staleness.",
        epilog=f"run 'asyncppo launch --help' for options and examples; configuration reference: {DOCS}",
    )
    parser.add_argument("--version", action="version", version=f"asyncppo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS.values():
        add(sub)
    return parser


def _fail(msg: str, code: int = 2) -> int:
    print(f"asyncppo: {msg}", file=sys.stderr)
    return code


def _load(args: argparse.Namespace):
    """Compose + validate; warnings go to stderr. Raises ConfigError."""
    from asyncppo.config import ConfigWarning, load_config

    overrides = list(args.overrides)
    if args.rollout_gpus is not None:
        overrides.append(f"cluster.rollout_gpus={args.rollout_gpus}")
    if args.train_gpus is not None:
        overrides.append(f"cluster.train_gpus={args.train_gpus}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        cfg = load_config(overrides, config_dir=args.config_dir)
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            print(f"asyncppo: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return cfg


def _cmd_launch(args: argparse.Namespace) -> int:
    from asyncppo.config import ConfigError, config_to_yaml

    try:
        cfg = _load(args)
    except ConfigError as exc:
        return _fail(f"{exc}\n(see {DOCS})")
    if args.dry_run:
        from asyncppo.launch.plan import format_plan, make_placement_plan

        # The plan is printed as YAML comments so that the whole output still parses as the config.
        plan = format_plan(make_placement_plan(cfg))
        sys.stdout.write(config_to_yaml(cfg))
        sys.stdout.write("".join(f"# {line}\n" for line in plan.splitlines()))
        sys.stdout.flush()
        return 0
    try:
        from asyncppo.launch.runner import run
    except ImportError as exc:
        return _fail(f"cannot start a run: the launcher could not be imported ({exc})", code=1)
    return int(run(cfg) or 0)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    # Overrides may follow the flags (`launch --dry-run a=1 b=2`): argparse hands later ones back as extras.
    unknown = [e for e in extra if e.startswith("-")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if extra:
        if not hasattr(args, "overrides"):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = list(args.overrides) + extra
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
