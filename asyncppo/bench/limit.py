"""The pipeline's limit: the engine alone, then the learner alone, each pinned to its own cores, on the same samples.

``asyncppo bench limit`` measures it beside a launch (asyncppo/bench/async_sync.py); on its own, as a tool:

    python -m asyncppo.bench.limit --steps 80 data=reverse algorithm=grpo rollout.rollout_batch_size=4

1. engine alone (``--rollout-cpus``): the run's engine generates ``steps x rollout_batch_size`` groups with its
   ``max_num_seqs`` slots kept full (asyncppo/rollout/engine_alone.py); the groups are written to a file;
2. learner alone (``--learner-cpus``): the run's learner trains ``steps`` updates on exactly those groups, in ticket
   order (asyncppo/learner/learner_alone.py).

Each side runs in its own process, one after the other, with the pinning and torch threads a launch gives it
(launch/actors.py), and its start-up (engine load, model build) is left out of its time. ``limit = max(engine,
learner)``; asyncppo/bench/async_sync.py calls :func:`measure_limit` and puts ``limit / async time`` beside the
speed-up over sync. Why this is the limit: asyncppo/report/limit.py.

``--beside-engine`` adds a third run: the learner alone once more, on the same groups, while an engine generates on
its own cores at the same time (enough groups to outlast the learner's start-up and run, sized from the two sides'
times just measured; then stopped). The two sides share no work, only the machine (caches, memory bandwidth, the
kernel); the ratio of the two learner times is what sharing the machine costs the update, a cost no pipeline on
that machine can avoid. It is reported beside the limit, which stays as defined.

``--replay RUN_DIR`` measures the limit on a finished run's own work instead (its trained samples regenerated at
their own lengths, its own batches trained); with ``--beside-learner`` the engine side runs once more while a
learner trains that run's batches on its own cores: what sharing the machine costs the engine.

    python -m asyncppo.bench.limit --replay RUN_DIR --beside-learner data=long trainer.seed=2 <the run's overrides>
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time

SIDES = ("engine", "learner")
# The tree this module lives in, ahead of the installed one: run from a git worktree, every process a measurement
# starts (each side, a launch and its Ray actors) imports that worktree's asyncppo, not the editable install's.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(overrides: list[str], steps: int):
    from asyncppo.config import load_config
    from asyncppo.data.tiny import model_of  # heavy: torch, transformers (builds the built-in model)

    cfg = load_config([*overrides, f"trainer.total_steps={steps}"])
    return cfg, model_of(cfg)


def run_side(side: str, root: str, steps: int, overrides: list[str], replay: str = "", repeat: int = 1) -> dict:
    """One side in this process (already pinned by the caller's environment); writes ``root/<side>.json``. The
    learner trains ``replay``'s own batches when given (a run directory), else the engine alone's groups, ``repeat``
    times over (a busy learner beside a measured engine)."""
    from omegaconf import OmegaConf

    from asyncppo.launch.actors import pin_cpus, set_learner_threads  # heavy: ray (the launch's own pinning)
    from asyncppo.stream.group_file import read_groups, write_groups

    # pin before anything runs a torch op: the affinity is inherited only by threads created after it, and loading
    # the config builds the model, which starts torch's thread pool (measured: a learner of 2 threads whose pool was
    # left unpinned ran 6x slower beside a busy core, 10.4 s a step against 1.7 s pinned, data=long)
    pin_cpus("ASYNCPPO_ROLLOUT_CPUS" if side == "engine" else "ASYNCPPO_LEARNER_CPUS")
    cfg, model_path = _config(overrides, steps)
    groups_file = os.path.join(root, "groups.bin")
    if side == "engine":
        import torch

        from asyncppo.rollout.engine_alone import generate_alone, replay_alone

        torch.set_num_threads(1)
        if replay:
            from asyncppo.learner.learner_alone import trained_batches

            run = replay_alone(cfg, model_path, [g for batch in trained_batches(replay) for g in batch])
            out = {"samples": len(run.finished), "gen_tokens": sum(run.finished)}
        else:
            run, stats = generate_alone(cfg, model_path, steps * cfg.rollout.rollout_batch_size)
            write_groups(groups_file, run.finished)
            lengths = [s.num_tokens for g in run.finished for s in g.samples]
            out = {"samples": len(lengths), "gen_tokens": sum(lengths),
                   "reward_mean": sum(s.reward for g in run.finished for s in g.samples) / max(len(lengths), 1),
                   "reward_failures": stats["reward_failures"]}
        out.update(engine_s=run.wall_s, step_s=run.step_s, decode_steps=run.steps, occupancy=run.occupancy)
    else:
        from asyncppo.learner.learner_alone import ticket_batches, train_alone, trained_batches

        set_learner_threads(OmegaConf.to_container(OmegaConf.structured(cfg)))
        if replay:
            batches = trained_batches(replay)
        else:
            batches = ticket_batches(read_groups(groups_file), cfg.rollout.rollout_batch_size, steps)
        result = train_alone(cfg, model_path, batches * max(1, repeat))
        out = {k: result[k] for k in ("learner_s", "steps", "samples")}
        out["step_s_mean"] = result["learner_s"] / result["steps"]
    with open(os.path.join(root, f"{side}.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def pinned_env(rollout_cpus: str, learner_cpus: str) -> dict:
    """The CPUs each side is pinned to (launch/actors.py reads them), and this tree first on ``PYTHONPATH`` (Ray's
    actors inherit it from a launch)."""
    path = os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, ASYNCPPO_ROLLOUT_CPUS=rollout_cpus, ASYNCPPO_LEARNER_CPUS=learner_cpus, PYTHONPATH=path)


def _side_argv(side: str, root: str, steps: int, overrides: list[str], replay: str = "", repeat: int = 1
               ) -> list[str]:
    """This module, running one side in its own process (:func:`run_side`)."""
    return [sys.executable, "-m", "asyncppo.bench.limit", "--side", side, "--dir", root, "--steps", str(steps),
            *(["--replay", replay] if replay else []), *(["--repeat", str(repeat)] if repeat > 1 else []),
            *overrides]


def _run_side_process(argv: list[str], env: dict, what: str) -> None:
    """Run one side (its :func:`_side_argv`) to its end; on failure, show its output's tail and stop naming ``what``
    failed."""
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-4000:])
        raise SystemExit(f"[limit] {what} failed with exit code {proc.returncode}")


def measure_limit(overrides: list[str], steps: int, rollout_cpus: str, learner_cpus: str, root: str,
                  replay: str = ""):
    """Both sides, one after the other, each in its own pinned process, on the engine alone's own groups or, with
    ``replay`` (a run directory), on that run's work; the :class:`PipelineLimit` and the two sides' records."""
    from asyncppo.report.limit import PipelineLimit

    os.makedirs(root, exist_ok=True)
    env = pinned_env(rollout_cpus, learner_cpus)
    work = f"the {steps} batches of {replay}" if replay else " ".join(overrides)
    sides = {}
    for side in SIDES:
        print(f"[limit] {side} alone: {work}", flush=True)
        t0, load_before = time.perf_counter(), os.getloadavg()[0]
        _run_side_process(_side_argv(side, root, steps, overrides, replay), env, f"the {side} alone on {work}")
        with open(os.path.join(root, f"{side}.json")) as f:
            sides[side] = json.load(f)
        sides[side]["load"] = f"{load_before:.1f} / {os.getloadavg()[0]:.1f}"  # 1-minute load at start / end
        print(f"[limit] {side} alone: {json.dumps(sides[side])} ({time.perf_counter() - t0:.0f}s with start-up)",
              flush=True)
    engine, learner = sides["engine"], sides["learner"]
    limit = PipelineLimit(engine_s=engine["engine_s"], learner_s=learner["learner_s"], samples=learner["samples"],
                          engine_occupancy=engine["occupancy"])
    return limit, sides


def _run_steps(run_dir: str) -> int:
    """How many steps a finished run trained (its ``trainer.total_steps``: the learner's rate schedule needs it)."""
    with open(os.path.join(run_dir, "trained_groups.jsonl"), encoding="utf-8") as f:
        return len({json.loads(line)["step"] for line in f})


def replay_limit(run_dir: str, overrides: list[str], rollout_cpus: str, learner_cpus: str, root: str):
    """The limit on ``run_dir``'s own work (launched with ``trainer.save_trained_groups=true``): the engine alone
    generating every trained sample again at its own length (rollout/engine_alone.py: ``replay_alone``), then the
    learner alone on the run's own batches, each pinned as the limit's sides are. ``overrides`` must build the run's
    engine and learner (its preset and overrides); the step count comes from the run. Returns the
    :class:`PipelineLimit` and the two sides' records."""
    return measure_limit(overrides, _run_steps(run_dir), rollout_cpus, learner_cpus, root, replay=run_dir)


#: Seconds the busy engine must keep generating beyond the learner's own run: its start-up wait below and the
#: learner process's start-up (imports, model build), with room to spare.
BESIDE_SLACK_S = 40.0


def learner_beside_engine(overrides: list[str], steps: int, rollout_cpus: str, learner_cpus: str, root: str,
                          engine_s: float, learner_s: float) -> float:
    """The learner alone on ``root``'s groups again, while an engine generates on its own cores (in
    ``root/beside``, so nothing of the first runs is overwritten): ``steps`` batches took it ``engine_s`` alone, so
    it is given enough batches to last ``learner_s + BESIDE_SLACK_S``. Returns the learner's seconds."""
    import shutil

    beside = os.path.join(root, "beside")
    engine_dir = os.path.join(beside, "engine")
    os.makedirs(engine_dir, exist_ok=True)
    shutil.copy(os.path.join(root, "groups.bin"), os.path.join(beside, "groups.bin"))
    env = pinned_env(rollout_cpus, learner_cpus)
    print(f"[limit] learner alone beside a generating engine: {' '.join(overrides)}", flush=True)
    batches = steps * math.ceil((learner_s + BESIDE_SLACK_S) / max(engine_s, 1e-3))
    busy = _side_argv("engine", engine_dir, batches, overrides)
    return _beside(busy, "engine", _side_argv("learner", beside, steps, overrides), "learner", beside, env)


def _beside(busy_argv: list[str], busy: str, measured_argv: list[str], measured: str, root: str, env: dict) -> float:
    """Run the ``measured`` side (its argv, writing ``root/<measured>.json``) while the ``busy`` side works on its
    own cores from 20 s before (its start-up) to the end; the measured side's seconds."""
    proc = subprocess.Popen(busy_argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(20.0)  # the busy side's own start-up (imports, model load) before the measured side's timed part
        if proc.poll() is not None:
            raise SystemExit(f"[limit] the busy {busy} exited early with code {proc.returncode}")
        _run_side_process(measured_argv, env, f"the {measured} beside the {busy}")
        if proc.poll() is not None:
            print(f"[limit] warning: the busy {busy} finished before the {measured}; the figure is a lower bound",
                  flush=True)
    finally:
        proc.kill()
        proc.wait()
    with open(os.path.join(root, f"{measured}.json")) as f:
        return json.load(f)[f"{measured}_s"]


def engine_beside_learner(run_dir: str, overrides: list[str], rollout_cpus: str, learner_cpus: str, root: str,
                          engine_s: float, learner_s: float) -> float:
    """The engine alone on ``run_dir``'s own work again (:func:`replay_limit`'s engine side), while a learner trains
    that run's batches on its own cores at the same time (repeated to outlast the engine, then stopped): the
    engine's share of what sharing the machine costs, as :func:`learner_beside_engine` measures the update's.
    Returns the engine's seconds."""
    beside = os.path.join(root, "beside-learner")
    learner_dir = os.path.join(beside, "learner")
    os.makedirs(learner_dir, exist_ok=True)
    steps = _run_steps(run_dir)
    env = pinned_env(rollout_cpus, learner_cpus)
    print(f"[limit] engine alone on the run's own work beside a training learner: {run_dir}", flush=True)
    repeat = math.ceil((engine_s + BESIDE_SLACK_S) / max(learner_s, 1e-3))
    busy = _side_argv("learner", learner_dir, steps, overrides, run_dir, repeat)
    return _beside(busy, "learner", _side_argv("engine", beside, steps, overrides, run_dir), "engine", beside, env)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rollout-cpus", default="1", help="CPU ids for the engine alone (taskset-style list: 1 or 0-7,9)")
    p.add_argument("--learner-cpus", default="0", help="CPU ids for the learner alone")
    p.add_argument("--dir", default="", help="where the groups and the per-side records go (default: a temp dir)")
    p.add_argument("--beside-engine", action="store_true",
                   help="also time the learner alone while an engine generates on its own cores (machine sharing)")
    p.add_argument("--beside-learner", action="store_true",
                   help="with --replay: also time the engine on the run's own work while a learner trains on its "
                        "own cores (machine sharing, the engine's side)")
    p.add_argument("--replay", default="", metavar="RUN_DIR",
                   help="the limit on a finished run's own work instead (launched with trainer.save_trained_groups="
                        "true; pass that run's preset and overrides too): the engine alone generating its samples "
                        "again at their own lengths, then the learner alone on its own batches")
    p.add_argument("--side", choices=SIDES, default="", help=argparse.SUPPRESS)  # internal: run one side here
    p.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)  # internal: the learner's batches N times
    p.add_argument("overrides", nargs="*", help="Hydra presets and overrides of the run being measured")
    args = p.parse_args()
    if args.side:
        run_side(args.side, args.dir, args.steps, args.overrides, args.replay, args.repeat)
        return
    root = args.dir or tempfile.mkdtemp(prefix="asyncppo-limit-")
    if args.replay:
        limit, _ = replay_limit(args.replay, args.overrides, args.rollout_cpus, args.learner_cpus, root)
        print(json.dumps(limit.as_dict(), indent=1))
        if args.beside_learner:
            beside = engine_beside_learner(args.replay, args.overrides, args.rollout_cpus, args.learner_cpus, root,
                                           limit.engine_s, limit.learner_s)
            print(f"[limit] engine alone on the run's own work {limit.engine_s:.1f} s; beside a training learner "
                  f"{beside:.1f} s: x{beside / limit.engine_s:.2f} (what sharing the machine costs the engine)",
                  flush=True)
        return
    limit, sides = measure_limit(args.overrides, args.steps, args.rollout_cpus, args.learner_cpus, root)
    print(json.dumps(limit.as_dict(), indent=1))
    if args.beside_engine:
        alone = sides["learner"]["learner_s"]
        beside = learner_beside_engine(args.overrides, args.steps, args.rollout_cpus, args.learner_cpus, root,
                                       sides["engine"]["engine_s"], alone)
        print(f"[limit] learner alone {alone:.1f} s; beside a generating engine {beside:.1f} s: "
              f"x{beside / alone:.2f} (what sharing the machine costs the update)", flush=True)


if __name__ == "__main__":
    main()
