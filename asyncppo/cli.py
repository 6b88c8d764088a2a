"""The ``asyncppo`` command line.

Subcommands live in :data:`SUBCOMMANDS` (name -> function that adds its parser); each parser sets ``func`` to a
handler returning the exit code, so adding ``asyncppo bench`` is one function plus one entry. Heavy imports
(Ray, torch, the runner) happen inside handlers only: ``--help`` and ``--dry-run`` stay fast and work even where
the training stack is not importable. Exit codes: 0 success, 2 invalid configuration or usage (message on stderr,
no traceback), anything else comes from the runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import warnings
from typing import Callable, Optional, Sequence

from asyncppo import __version__
from asyncppo.bench import command as bench_command
from asyncppo.config import ConfigError
from asyncppo.launch.disk_plan import disk_lines
from asyncppo.launch.plan import format_plan
from asyncppo.launch.resolve import plan_launch
from asyncppo.launch.shared_device import SharedSplitError, check_shared_split, resolve_shared_device
from asyncppo.selftest import command as selftest_command

# Hydra and OmegaConf (the config loader, `convert`, `report`, `advise`) are imported inside the handlers that need
# them, so that `asyncppo selftest` runs on a bare GPU machine that has neither (asyncppo/selftest/).

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


def _subcommand(sub: argparse._SubParsersAction, name: str, help: str, description: str,
                epilog: Optional[str] = None) -> argparse.ArgumentParser:
    """One subcommand's parser, made the same way for all: an epilog keeps its own line breaks (examples)."""
    if epilog is None:
        return sub.add_parser(name, help=help, description=description)
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_launch(sub: argparse._SubParsersAction) -> None:
    p = _subcommand(
        sub, "launch",
        help="start a training run (or show its resolved config and placement with --dry-run)",
        description="Compose the configuration (presets + overrides), validate it, plan where each role runs, "
        "then start the learner and the rollout workers on Ray.",
        epilog=_LAUNCH_EPILOG,
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config overrides, e.g. algorithm.pg_clip=0.28 or algorithm=grpo")
    p.add_argument("--rollout-gpus", type=int, metavar="N", default=None,
                   help="GPUs for rollout: N / rollout.tensor_parallel_size engines of that many GPUs each (default "
                   "1 GPU each); 0 runs cluster.rollout_workers CPU rollout actors (same as cluster.rollout_gpus=N; "
                   "the flag wins over an override)")
    p.add_argument("--train-gpus", type=int, metavar="M", default=None,
                   help="GPUs for training: M learner ranks with one GPU each; 0 runs one CPU learner "
                   "(same as cluster.train_gpus=M; the flag wins over an override)")
    p.add_argument("--gpus", type=int, metavar="N", default=None,
                   help="share N devices, each between one rollout engine (rollout.gpu_memory_utilization of its "
                   "memory) and one learner rank (the rest); weights move through host shared memory. On a machine "
                   "without an NVIDIA GPU the same placement runs on the CPU (same as cluster.shared_gpus=N)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the resolved config as YAML and the launch plan (placement, Ray, actors' environment, "
                   "model), then exit without starting anything")
    p.add_argument("--config-dir", metavar="DIR", default=None,
                   help="compose from this directory instead of the packaged configs (it must hold config.yaml; "
                   "copy asyncppo/configs to start)")
    p.add_argument("--config-file", metavar="FILE.yaml", default=None,
                   help="run the options in this YAML file (e.g. from 'asyncppo convert' or --dry-run): schema "
                   "defaults < presets named here < the file < KEY=VALUE overrides")
    p.set_defaults(func=_cmd_launch)


def _add_convert(sub: argparse._SubParsersAction) -> None:
    try:
        from asyncppo.config.convert import command as convert_command  # optional: hydra, omegaconf
    except ImportError as exc:
        why = f"unavailable here: {exc}"
        sub.add_parser("convert", help=why, description=why).set_defaults(func=lambda args: _fail(why, code=1))
        return
    convert_command.add_arguments(_subcommand(sub, "convert", convert_command.HELP, convert_command.DESCRIPTION,
                                              convert_command.EPILOG))


# subcommand -> (one-line help, description) for the subcommands whose texts live here
_TEXTS = {
    "report": (
        "plot a run (or overlay several): report.png and one PNG per panel",
        "Read RUN_DIR/metrics.jsonl (and summary.json) and write report.png plus report/<panel>.png: reward and "
        "held-out accuracy against step and wall time, lag, busy fractions and occupancy, KL / clip / entropy, "
        "response length and waste, push latency. With several runs the curves are overlaid and the images go to "
        "FIRST_RUN/compare/ unless --out is given.",
    ),
    "advise": (
        "predict throughput, occupancy, lag and idle GPUs for every rollout/train split, max_staleness and lookahead",
        "Measure a run's rates (generation speed by occupancy, learner speed per token, weight-load time, response "
        "lengths), simulate the pipeline for a GPU budget and recommend a split, max_staleness and admission "
        "lookahead. Prints a table "
        "and writes a PNG of predicted throughput over the split. See docs/advisor.md.",
    ),
}


def _add_report(sub: argparse._SubParsersAction) -> None:
    p = _subcommand(sub, "report", *_TEXTS["report"])
    p.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (trainer.output_dir of each run)")
    p.add_argument("--out", metavar="DIR", default=None, help="where to write the images")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args: argparse.Namespace) -> int:
    from asyncppo.report import write_report  # optional: omegaconf, matplotlib
    from asyncppo.report.runs import RunDirError  # optional: omegaconf

    try:
        paths = write_report(*args.runs, out_dir=args.out)
    except RunDirError as exc:
        return _fail(str(exc))
    print(f"asyncppo: report written to {paths['report']} (and {len(paths) - 1} panels beside it in report/)")
    return 0


def _add_advise(sub: argparse._SubParsersAction) -> None:
    p = _subcommand(sub, "advise", *_TEXTS["advise"])
    p.add_argument("run", nargs="?", metavar="RUN_DIR", help="a finished run to take the rates from")
    p.add_argument("--workload", metavar="NAME", default=None,
                   help="use a documented workload's rates instead of a run (7b-long)")
    p.add_argument("--gpus", type=int, required=True, metavar="N", help="total GPU budget to split")
    p.add_argument("--nodes", type=int, default=1, metavar="K", help="nodes the GPUs are on (pools get whole nodes)")
    p.add_argument("--tp", type=int, default=1, metavar="T", help="GPUs per rollout engine (tensor parallel)")
    p.add_argument("--staleness", default="0,1,2,4,8", metavar="K,K,...", help="max_staleness values to try")
    p.add_argument("--lookahead", default=None, metavar="J,J,...",
                   help="admission lookaheads to try under each k (only those < k; default: the run's own "
                        "rollout.admission_lookahead, if it set one)")
    p.add_argument("--batch", type=int, default=None, metavar="B", help="prompts per step (default: the run's)")
    p.add_argument("--steps", type=int, default=40, help="simulated learner steps per configuration")
    p.add_argument("--env-s", type=float, default=None, metavar="S",
                   help="seconds a multi-turn episode spends out of the engine per turn: the environment call plus "
                        "the wait to re-enter (default: the run's own, measured; ~20 ms above the call on a 2-core "
                        "box): what a slower or faster tool would do")
    p.add_argument("--turns", type=float, default=None, metavar="T",
                   help="model turns per episode (default: the run's own; above 1 the samples are multi-turn "
                        "episodes)")
    p.add_argument("--out", metavar="PNG", default=None, help="plot path (default: RUN_DIR/advise_<N>gpus.png)")
    p.set_defaults(func=_cmd_advise)


def _counts(text: str) -> list[int] | None:
    """``"0,1,4"`` -> ``[0, 1, 4]`` (sorted, unique); None unless every item is an integer >= 0 and there is one."""
    try:
        values = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        return None
    return values if values and all(v >= 0 for v in values) else None


def _cmd_advise(args: argparse.Namespace) -> int:
    from asyncppo.report.advisor import format_table, plot, recommend, sweep  # optional: omegaconf, matplotlib
    from asyncppo.report.rates import measure  # optional: omegaconf
    from asyncppo.report.workloads import SWITCH_S, workload  # optional: omegaconf

    if (args.run is None) == (args.workload is None):
        return _fail("advise needs exactly one of RUN_DIR or --workload NAME")
    ks = _counts(args.staleness)
    if ks is None:
        return _fail(f"--staleness {args.staleness!r}: expected comma-separated integers >= 0, e.g. 0,1,2,4")
    lookaheads = None if args.lookahead is None else _counts(args.lookahead)
    if args.lookahead is not None and lookaheads is None:
        return _fail(f"--lookahead {args.lookahead!r}: expected comma-separated integers >= 0, e.g. 1,2,3")
    switch_s = 0.0
    try:
        if args.workload:
            rates, switch_s = workload(args.workload), SWITCH_S.get(args.workload, 0.0)
        else:
            rates = measure(args.run)
        if args.env_s is not None or args.turns is not None:
            rates = dataclasses.replace(rates, env_s=rates.env_s if args.env_s is None else args.env_s,
                                        turns=rates.turns if args.turns is None else args.turns)
            rates.setup()  # refuses a negative or non-finite time, or turns below 1, by name
        rows = sweep(rates, args.gpus, nodes=args.nodes, tp=args.tp, ks=ks, steps=args.steps,
                     warmup=max(2, args.steps // 4), switch_s=switch_s, batch_groups=args.batch,
                     lookaheads=lookaheads)
    except ValueError as exc:
        return _fail(str(exc))
    pick = recommend(rows)
    for note in rates.notes:
        print(f"note: {note}")
    print(format_table(rows, pick))
    print(f"\nrecommended: {pick.label}: {pick.result.samples_per_s:.2f} samples/s, lag mean "
          f"{pick.result.lag_mean:.2f}, idle GPU {pick.result.idle_gpu_frac:.0%}\n"
          f"  asyncppo launch --rollout-gpus {pick.rollout_gpus} --train-gpus {pick.train_gpus} "
          f"{pick.overrides}")
    out = args.out or os.path.join(args.run or ".", f"advise_{args.gpus}gpus.png")
    print(f"plot: {plot(rows, pick, out, title=f'{args.run or args.workload}: {args.gpus} GPUs')}")
    return 0


# name -> adds the subcommand's parser (which sets func=handler(args) -> exit code)
SUBCOMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "launch": _add_launch, "report": _add_report, "advise": _add_advise, "convert": _add_convert,
    "selftest": selftest_command.add_parser, "bench": bench_command.add_parser,
}


def build_parser() -> argparse.ArgumentParser:
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
    from asyncppo.config import ConfigWarning, load_config  # optional: hydra, omegaconf

    overrides = list(args.overrides)
    if args.rollout_gpus is not None:
        overrides.append(f"cluster.rollout_gpus={args.rollout_gpus}")
    if args.train_gpus is not None:
        overrides.append(f"cluster.train_gpus={args.train_gpus}")
    if getattr(args, "gpus", None) is not None:
        overrides.append(f"cluster.shared_gpus={args.gpus}")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConfigWarning)
        cfg = load_config(overrides, config_dir=args.config_dir, config_file=args.config_file)
    for w in caught:
        if issubclass(w.category, ConfigWarning):
            print(f"asyncppo: warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return resolve_shared_device(cfg)  # --gpus N: cuda or cpu, settled once for every actor


def _cmd_launch(args: argparse.Namespace) -> int:
    try:
        cfg = _load(args)
    except ConfigError as exc:
        return _fail(f"{exc}\n(see {DOCS})")
    except ImportError as exc:  # a bare machine: `asyncppo selftest` runs there, `launch` needs the whole stack
        return _fail(f"launch needs Hydra and OmegaConf, which cannot be imported here ({exc})", code=1)
    if args.dry_run:
        # The plan is printed as YAML comments so that the whole output still parses as the config.
        try:
            memory = check_shared_split(cfg)  # --gpus N: refused here when the learner cannot fit beside the engine
        except SharedSplitError as exc:
            return _fail(f"{exc}\n(see {DOCS})")
        plan = plan_launch(cfg)
        disk, warning = disk_lines(cfg, plan.output_dir)
        plan = dataclasses.replace(plan, memory_lines=tuple(memory), disk_lines=tuple(disk), disk_warning=warning)
        lines = format_plan(plan.placement).splitlines() + plan.describe()
        from asyncppo.config import config_to_yaml  # optional: omegaconf

        sys.stdout.write(config_to_yaml(cfg))
        sys.stdout.write("".join(f"# {line}\n" for line in lines))
        sys.stdout.flush()
        return 0
    try:
        from asyncppo.launch.runner import run  # heavy: ray, torch (the runner and its actors)
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
    # Before torch loads OpenMP: idle OpenMP threads sleep instead of spinning, so a second torch thread (the
    # built-in recipe's learner) cannot starve a process that shares its core (measured in docs/benchmarks.md).
    # Ray actors get the same setting from launch/resolve.py (actor_env).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
