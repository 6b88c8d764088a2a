"""The resolved launch plan: every fact the launcher acts on, and every check a launch makes, in one place.

A run goes config -> :class:`LaunchPlan` -> actors started (launch/start.py) -> supervision (launch/supervise.py).
Each check is made here once, in this order, and a refusal is a :class:`LaunchError` whose message the user can act
on (the runner prints it and exits 2):

* the output directory does not already hold another run (resuming in place continues it);
* embodied runs: the gymnasium env exists and its spaces are supported (and resuming is refused);
* LLM runs: the data files are readable, the model path resolves (the built-in model is built here, once, so the
  actors do not race to build it), one max-length sequence fits its context and a CPU engine's KV cache
  (launch/context_check.py), and a resume checkpoint fits the configured model and leaves steps to train;
* once Ray is up (:func:`check_cluster`): the GPUs and custom resources the bundles ask for exist, and one rollout
  engine's TP x PP GPUs fit on one node.

Where each role listens is decided later, inside the learner actor (launch/addresses.py), because only it knows the
node Ray placed it on; what the plan fixes beforehand is the address rule of Ray itself (a local cluster talks over
loopback) and the bundles each role is placed in. :func:`plan_launch` builds the plan from the config alone, with no
check that touches files or devices, so ``asyncppo launch --dry-run`` prints it in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

from asyncppo.config.checks import uses_critic
from asyncppo.config.hosts import is_loopback
from asyncppo.config.devices import engines_on_gpu
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.launch.context_check import check_sequence_fits
from asyncppo.launch.disk_plan import disk_lines
from asyncppo.launch.text_env_check import check_text_env_launch
from asyncppo.launch.shared_device import SharedSplitError, check_shared_split
from asyncppo.launch.plan import (
    PlacementPlan, check_engine_fits, make_placement_plan, num_rollout_engines, rollout_bundle,
)

# Passed on from the driver's environment to every actor when set (threads, CPU pinning, caches, offline hub).
_PASSED_ENV = ("ASYNCPPO_LEARNER_THREADS", "ASYNCPPO_LEARNER_CPUS", "ASYNCPPO_ROLLOUT_CPUS", "ASYNCPPO_CACHE",
               "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE", "HF_HUB_OFFLINE")


class LaunchError(RuntimeError):
    """A launch problem the user can fix (resources, paths); printed without a traceback."""


@dataclasses.dataclass(frozen=True)
class LaunchPlan:
    """What the launcher starts, where, with which model and environment; built by :func:`plan_launch`, its paths
    filled by :func:`resolve_plan` once every check passed."""

    output_dir: str  # absolute: actors need not share the driver's cwd
    embodied: bool  # env.id set: env workers and the embodied learner (docs/embodied.md)
    placement: PlacementPlan
    num_learners: int
    num_workers: int  # one rollout actor per engine: rollout_gpus / (TP x PP) on GPUs (launch/plan.py)
    learner_bundle: dict[str, float]
    worker_bundle: dict[str, float]  # one bundle per engine with all its GPUs (TP x PP)
    ray_init: dict[str, Any]  # ray.init keyword arguments, the actors' environment included
    ray_on_loopback: bool  # a local (or loopback) Ray cluster: Ray's own control plane stays on loopback
    replace_dead_workers: bool  # a dead rollout (or env) worker is replaced (cluster.max_worker_restarts > 0)
    max_worker_restarts: int
    worker_restart_window_s: Optional[float]  # the window max_worker_restarts counts over (None: the whole run)
    timeout_s: float
    model_source: str  # model.path as configured, or the gymnasium env id of an embodied run
    model_path: str = ""  # the learner's model ("" for embodied runs, and before resolve_plan)
    worker_model_path: str = ""  # the rollout engines' starting weights: the checkpoint's actor when resuming
    resume_note: Optional[str] = None  # "resuming from PATH (step N)", printed when the run starts
    max_learner_restarts: int = 0  # learner deaths restarted from the latest checkpoint (0: a death ends the run)
    shared_devices: int = 0  # --gpus N: bundle i holds learner rank i and engine i (launch/shared_device.py)
    memory_lines: tuple[str, ...] = ()  # the shared device's memory split (launch/memory_plan.py)
    disk_lines: tuple[str, ...] = ()  # the checkpoints' disk against the space free (launch/disk_plan.py)
    disk_warning: Optional[str] = None  # printed when a run starts: they need more than is free

    def bundles(self) -> list[dict[str, float]]:
        """The placement group's bundles: one per role, or one per shared device."""
        if self.shared_devices:
            return [self.worker_bundle] * self.shared_devices
        return [self.learner_bundle] * self.num_learners + [self.worker_bundle] * self.num_workers

    def learner_slot(self, rank: int) -> tuple[int, dict[str, float]]:
        """Learner rank ``rank``'s bundle index and the resources it asks for there."""
        if self.shared_devices:
            return rank, self._half()
        return rank, self.learner_bundle

    def worker_slot(self, index: int) -> tuple[int, dict[str, float]]:
        """Rollout worker ``index``'s bundle index and the resources it asks for there."""
        if self.shared_devices:
            return index, self._half()
        return self.num_learners + index, self.worker_bundle

    def _half(self) -> dict[str, float]:
        """One of the two actors of a shared bundle: half its CPUs and half its GPU (Ray's fractional GPUs give both
        the same device)."""
        return {k: v / 2 for k, v in self.worker_bundle.items()}

    def describe(self) -> list[str]:
        """The resolved facts beyond the placement table, one line each (``--dry-run`` prints them)."""
        init = {k: v for k, v in self.ray_init.items() if k != "runtime_env"}
        env = self.ray_init.get("runtime_env", {}).get("env_vars", {})
        bundles = (f"bundles: {self.num_learners} x learner {self.learner_bundle}, {self.num_workers} x rollout "
                   f"{self.worker_bundle} (placement group, PACK)")
        if self.shared_devices:
            bundles = (f"bundles: {self.shared_devices} x shared device {self.worker_bundle}, its learner rank and its "
                       f"engine asking for {self._half()} each (placement group, PACK)")
        lines = [
            f"run directory: {self.output_dir}",
            f"ray.init: {init}" + ("; Ray's control plane on loopback" if self.ray_on_loopback else ""),
            bundles,
            f"actor environment: {' '.join(f'{k}={v}' for k, v in sorted(env.items()))}",
            "dead rollout workers: " + (f"replaced, up to {self.max_worker_restarts} restart(s) "
                                        + ("in the run" if self.worker_restart_window_s is None
                                           else f"within any {self.worker_restart_window_s:g} s")
                                        if self.replace_dead_workers else "end the run"),
            "a dead learner: " + (f"restarted from the latest checkpoint, up to {self.max_learner_restarts} time(s)"
                                  if self.max_learner_restarts else "ends the run (trainer.auto_resume off)"),
        ]
        if self.embodied:
            lines.append(f"model: the MLP actor-critic of env {self.model_source} (no model directory)")
        elif self.model_path:
            lines.append(f"model: {self.model_path}; rollout engines start from {self.worker_model_path}")
        else:
            lines.append(f"model: {self.model_source}, resolved (and the data files and resume checkpoint checked) "
                         "when the run starts")
        if self.resume_note:
            lines.append(self.resume_note)
        return lines + list(self.memory_lines) + list(self.disk_lines) + ([self.disk_warning] if self.disk_warning
                                                                         else [])


def actor_env(cfg: AsyncPPOConfig) -> dict[str, str]:
    """The environment every actor starts with."""
    # One OpenMP/MKL thread per actor: several processes share the cores, and oversubscription is slower than none.
    env = {
        "OMP_NUM_THREADS": os.environ.get("ASYNCPPO_THREADS", "1"),
        "MKL_NUM_THREADS": os.environ.get("ASYNCPPO_THREADS", "1"),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY", "PASSIVE"),  # threads sleep, not spin (cli.py)
        "TOKENIZERS_PARALLELISM": "false",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
        "WANDB_SILENT": "true",
        "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "PYTHONWARNINGS": "ignore",
    }
    if not engines_on_gpu(cfg):
        env["VLLM_TARGET_DEVICE"] = "cpu"
    env.update({key: os.environ[key] for key in _PASSED_ENV if key in os.environ})
    return env


def ray_on_loopback(cfg: AsyncPPOConfig) -> bool:
    """Whether Ray's control plane (GCS, raylet, workers) must stay on loopback: a local Ray cluster (no
    ``cluster.address``), or one joined at a loopback address (every node is this machine, as in Ray's
    ``cluster_utils`` simulator). Ray would otherwise advertise this machine's outward-facing address even on one
    machine; any other address leaves Ray's own choice alone."""
    address = cfg.cluster.address
    return not address or (address != "auto" and is_loopback(address.rsplit(":", 1)[0]))


def _bundles(cfg: AsyncPPOConfig) -> tuple[dict[str, float], dict[str, float]]:
    """The learner's and one rollout engine's Ray bundle; custom Ray resources pin roles to nodes
    (``cluster.learner_resources`` / ``rollout_resources``)."""
    cl = cfg.cluster
    if cl.shared_gpus > 0:  # one bundle per device, for its learner rank and its engine (LaunchPlan._half)
        both = {"CPU": 2.0 * float(cl.cpus_per_worker), **({"GPU": 1.0} if cl.shared_device == "cuda" else {})}
        both.update({k: float(v) for k, v in {**cl.learner_resources, **cl.rollout_resources}.items()})
        return both, both
    learner = {"CPU": 1.0, "GPU": 1.0} if cl.train_gpus > 0 else {"CPU": 1.0}
    learner.update({k: float(v) for k, v in cl.learner_resources.items()})
    worker = {**rollout_bundle(cfg), **{k: float(v) for k, v in cl.rollout_resources.items()}}
    return learner, worker


def plan_launch(cfg: AsyncPPOConfig) -> LaunchPlan:
    """The plan from the config alone: no file, device or cluster is looked at (``--dry-run``)."""
    cl = cfg.cluster
    placement = make_placement_plan(cfg)
    num_learners, num_workers = len(placement.learners), len(placement.rollouts)
    learner_bundle, worker_bundle = _bundles(cfg)
    # Actors write their output to <run_dir>/logs/ (launch/console.py); the driver prints clean lines from there.
    init: dict[str, Any] = dict(include_dashboard=False, log_to_driver=False, logging_level="WARNING")
    if cl.address:
        init["address"] = cl.address
    else:
        needed = max(1, cl.train_gpus) + rollout_bundle(cfg)["CPU"] * num_workers  # the placement group's CPUs
        if cl.shared_gpus:
            needed = worker_bundle["CPU"] * cl.shared_gpus
        init["num_cpus"] = max(os.cpu_count() or 1, int(math.ceil(needed)))
    init["runtime_env"] = {"env_vars": actor_env(cfg)}
    return LaunchPlan(
        output_dir=os.path.abspath(cfg.trainer.output_dir), embodied=bool(cfg.env.id), placement=placement,
        num_learners=num_learners, num_workers=num_workers, learner_bundle=learner_bundle,
        worker_bundle=worker_bundle, ray_init=init, ray_on_loopback=ray_on_loopback(cfg),
        replace_dead_workers=cl.max_worker_restarts > 0,
        max_worker_restarts=cl.max_worker_restarts, worker_restart_window_s=cl.worker_restart_window_s,
        timeout_s=cl.timeout_s,
        model_source=cfg.env.id or cfg.model.path, shared_devices=cl.shared_gpus,
        max_learner_restarts=learner_restarts(cfg),
    )


def learner_restarts(cfg: AsyncPPOConfig) -> int:
    """How many learner deaths the launcher restarts: ``trainer.auto_resume`` (on by default when checkpoints are
    written) caps it at ``trainer.max_learner_restarts``; without checkpoints a restart would start over."""
    tr = cfg.trainer
    on = tr.save_every > 0 if tr.auto_resume is None else bool(tr.auto_resume)
    return tr.max_learner_restarts if on else 0


def resolve_plan(cfg: AsyncPPOConfig) -> LaunchPlan:
    """The plan with every check made that needs no cluster (module docstring); raises :class:`LaunchError`."""
    plan = plan_launch(cfg)
    try:  # --gpus N: the model and its optimizer must fit beside the engine (launch/memory_plan.py)
        plan = dataclasses.replace(plan, memory_lines=tuple(check_shared_split(cfg)))
    except SharedSplitError as exc:
        raise LaunchError(str(exc)) from None
    _check_output_dir(cfg, plan.output_dir)
    disk, warning = disk_lines(cfg, plan.output_dir)
    plan = dataclasses.replace(plan, disk_lines=tuple(disk), disk_warning=warning)
    if plan.embodied:
        _check_env(cfg)
        return dataclasses.replace(plan, resume_note=_embodied_resume_note(cfg))
    _check_data(cfg)
    model_path = _resolve_model(cfg)
    try:
        check_sequence_fits(cfg, model_path)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    if cfg.env.text_env:
        try:
            check_text_env_launch(cfg, model_path)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    worker_model_path, note = _resolve_resume(cfg, model_path)
    return dataclasses.replace(plan, model_path=model_path, worker_model_path=worker_model_path, resume_note=note)


def _check_output_dir(cfg: AsyncPPOConfig, output_dir: str) -> None:
    """Refuse a directory that already holds a run's records: a second run there would append its metrics to the
    first one's ``metrics.jsonl`` (and the console, which follows that file, would print both runs' lines), and its
    checkpoints would prune the first one's. Resuming in place (``trainer.resume_from`` inside it) continues it."""
    if not os.path.exists(os.path.join(output_dir, "metrics.jsonl")):
        return
    resume = cfg.trainer.resume_from and os.path.abspath(cfg.trainer.resume_from)
    if resume and (resume == output_dir or resume.startswith(output_dir + os.sep)):
        return
    raise LaunchError(
        f"trainer.output_dir={output_dir!r} already holds a run (metrics.jsonl): choose a new directory, or continue "
        f"that run with trainer.resume_from={output_dir}")


def _check_env(cfg: AsyncPPOConfig) -> None:
    """Embodied runs: the env id exists and its spaces are supported, checked before Ray starts. No model path."""
    from asyncppo.envs.spaces import EnvError, describe_env  # heavy: gymnasium

    try:
        describe_env(cfg.env)
    except EnvError as exc:
        raise LaunchError(str(exc)) from None


def _embodied_resume_note(cfg: AsyncPPOConfig) -> Optional[str]:
    """An embodied resume: its checkpoint exists and leaves steps to train (learner/embodied_checkpoint.py)."""
    if not cfg.trainer.resume_from:
        return None
    from asyncppo.learner.checkpoint import CheckpointError  # heavy: torch
    from asyncppo.learner.embodied_checkpoint import resolve_embodied  # heavy: torch

    try:
        path, version = resolve_embodied(cfg.trainer.resume_from)
    except CheckpointError as exc:
        raise LaunchError(str(exc)) from None
    return _resume_note(path, version, cfg.trainer.total_steps)


def _resume_note(ckpt_path: str, version: int, total_steps: int) -> str:
    """The line a resume prints; refused when the checkpoint leaves nothing to do. A checkpoint at ``total_steps``
    of a run that has no ``final/`` (it stopped, or its launch died, in the final evaluation or save) is finished:
    no step is trained, the weights are evaluated and ``final/`` is written. ``total_steps`` is the total, not the
    steps to add."""
    run_dir = os.path.dirname(os.path.dirname(os.path.abspath(ckpt_path)))  # <run>/checkpoints/step_N
    if version > total_steps or (version == total_steps and os.path.isdir(os.path.join(run_dir, "final"))):
        raise LaunchError(
            f"trainer.resume_from: the checkpoint {ckpt_path!r} is at step {version}, but trainer.total_steps="
            f"{total_steps} is the total number of steps (not the steps to add), so there is nothing left to train")
    if version == total_steps:
        return (f"resuming from {ckpt_path} (step {version}): no step left to train, finishing the run (its final "
                f"evaluation and model)")
    return f"resuming from {ckpt_path} (step {version})"


def _check_data(cfg: AsyncPPOConfig) -> None:
    for path in list(cfg.data.train_files) + list(cfg.data.eval_files):
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise LaunchError(f"data file {path!r} does not exist or is not readable (data.train_files/eval_files)")


def _resolve_model(cfg: AsyncPPOConfig) -> str:
    from asyncppo.data.tiny import model_of  # heavy: torch, transformers (builds the built-in model)

    path = model_of(cfg)
    if not os.path.isdir(path):
        raise LaunchError(f"model.path={cfg.model.path!r}: no such model directory")
    _check_routing_model(cfg, path)
    return path


#: config.json keys that give a mixture of experts' expert count (Qwen-MoE, Mixtral / GPT-OSS, DeepSeek)
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def _check_routing_model(cfg: AsyncPPOConfig, path: str) -> None:
    """``algorithm.routing_replay`` needs a mixture of experts: a model whose config names no experts is refused
    before anything starts (the learner checks its routers again when it loads the model)."""
    mode = cfg.algorithm.routing_replay
    config = os.path.join(path, "config.json")
    if mode == "off" or not os.path.isfile(config):
        return
    with open(config, encoding="utf-8") as f:
        hf = json.load(f)
    text = hf.get("text_config", {}) if isinstance(hf.get("text_config"), dict) else {}
    if not any(int(src.get(k) or 0) > 0 for src in (hf, text) for k in _EXPERT_KEYS):
        raise LaunchError(f"algorithm.routing_replay={mode}: model.path={cfg.model.path!r} is not a mixture of "
                          f"experts (its config.json has none of {', '.join(_EXPERT_KEYS)}); set "
                          "algorithm.routing_replay=off")


def _resolve_resume(cfg: AsyncPPOConfig, model_path: str) -> tuple[str, Optional[str]]:
    """The weights the rollout engines start from and the line that says so: the checkpoint's actor when resuming
    (checked against the configured model first, so a mismatch fails before any actor starts), else ``model_path``
    (also when resuming under LoRA: the engines merge every pushed adapter onto the base, sync/adapter.py)."""
    if not cfg.trainer.resume_from:
        return model_path, None
    # only when resuming: checkpoint reading brings torch
    from asyncppo.learner.checkpoint import CheckpointError, check_compatible, resolve_checkpoint  # heavy: torch

    try:
        ckpt = resolve_checkpoint(cfg.trainer.resume_from)
        check_compatible(ckpt, model_path, needs_critic=uses_critic(cfg))
    except CheckpointError as exc:
        raise LaunchError(str(exc)) from None
    note = _resume_note(ckpt.path, ckpt.version, cfg.trainer.total_steps)
    if cfg.model.lora_rank > 0:  # engines keep the base to merge adapters onto; the first push brings the adapter
        return model_path, note
    return ckpt.actor_dir, note


def check_cluster(cfg: AsyncPPOConfig, resources: dict[str, float], node_gpus: list[float]) -> None:
    """The checks that need Ray up: ``resources`` is ``ray.cluster_resources()``, ``node_gpus`` the GPUs of each
    alive node. Refused here, before a placement group would wait for what no node holds."""
    want_gpus = cfg.cluster.rollout_gpus + cfg.cluster.train_gpus
    if cfg.cluster.shared_gpus and cfg.cluster.shared_device == "cuda":
        want_gpus = cfg.cluster.shared_gpus
    have_gpus = int(resources.get("GPU", 0))
    if want_gpus > have_gpus:
        raise LaunchError(
            f"asked for {cfg.cluster.rollout_gpus} rollout + {cfg.cluster.train_gpus} train GPUs = {want_gpus}, "
            f"but the Ray cluster has {have_gpus} GPU(s). Lower --rollout-gpus/--train-gpus "
            "(0 and 0 run everything on CPU) or join a bigger cluster with cluster.address=HOST:PORT."
        )
    _check_custom_resources(cfg, resources)
    try:  # an engine's TP x PP GPUs are one bundle, which Ray keeps on one node
        check_engine_fits(cfg, node_gpus)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None


def _check_custom_resources(cfg: AsyncPPOConfig, resources: dict[str, float]) -> None:
    """Every learner rank and every rollout engine is one bundle asking for its role's custom resources."""
    bundles = {"learner_resources": max(1, cfg.cluster.train_gpus), "rollout_resources": num_rollout_engines(cfg)}
    for key, count in bundles.items():
        for name, amount in getattr(cfg.cluster, key).items():
            if resources.get(name, 0) < amount * count:
                raise LaunchError(
                    f"cluster.{key} asks for {amount:g} of the Ray resource {name!r} per bundle, {amount * count:g} "
                    f"for its {count} bundle(s), but the Ray cluster has {resources.get(name, 0):g}; start the nodes "
                    f"with --resources='{{\"{name}\": ...}}' or remove the key")
