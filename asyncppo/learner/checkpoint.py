"""Learner checkpoints: write them atomically, find the newest good one, and load it back for a resume.

Layout of ``<output_dir>/checkpoints/``::

    step_300/
      actor/                  HF format (save_pretrained + tokenizer): usable as ``model.path`` or by vLLM as is
      critic.safetensors      the value model's state dict (only when the run trains a critic; one learner rank)
      sharded/                several learner ranks: actor, critic and optimiser states as torch.distributed.checkpoint
                              shards, each rank writing its own (loadable by any number of ranks)
      trainer_state.pt        version, optimiser/scheduler states, KL controller, reward stats, RNG states, and in
                              ``extra`` the data position (data/position.py: the prompts each worker trained)
      meta.json               version, architecture summary; written last
    latest                    the name of the newest complete checkpoint dir ("step_300")

Why this shape. A run can die at any moment, including in the middle of a save. Everything is written into a hidden
``.tmp-step_N`` directory first and renamed to ``step_N`` only when complete (a rename within one directory is atomic
on POSIX), and ``latest`` is replaced (write + ``os.replace``) only after that rename, so ``latest`` never names a
half-written checkpoint. The trainer state goes through ``torch.save`` and is read back with ``weights_only=True``:
a checkpoint file never executes code when loaded (it holds only tensors, numbers, strings, lists and dicts).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_model, save_model
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from asyncppo.learner.run_files import CHECKPOINTS_DIR, LATEST_FILE, disk_usage_near, read_latest, step_of
from asyncppo.learner.value_head import shares_actor_body

ACTOR_DIR = "actor"
CRITIC_FILE = "critic.safetensors"
STATE_FILE = "trainer_state.pt"
SHARDED_DIR = "sharded"
META_FILE = "meta.json"
FORMAT = 1
# The config.json keys that must agree between a checkpoint's actor and the model a run is configured with.
ARCH_KEYS = (
    "model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "vocab_size", "tie_word_embeddings", "head_dim",
)


class CheckpointError(RuntimeError):
    """No usable checkpoint at a path, or one that does not fit the configured run."""


class CheckpointWriteError(CheckpointError):
    """A checkpoint could not be written (a full disk, a file too large, a path that is not a directory): its
    unfinished directory is gone and ``latest`` still names the newest complete checkpoint (a ``step_N`` renamed
    just before ``latest`` failed to be written is complete, only not named)."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint directory and the policy version it holds."""

    path: str
    version: int

    @property
    def actor_dir(self) -> str:
        return os.path.join(self.path, ACTOR_DIR)

    @property
    def critic_file(self) -> str:
        return os.path.join(self.path, CRITIC_FILE)

    @property
    def state_file(self) -> str:
        return os.path.join(self.path, STATE_FILE)

    @property
    def has_critic(self) -> bool:
        if os.path.isfile(self.critic_file):
            return True
        try:
            with open(os.path.join(self.path, META_FILE), encoding="utf-8") as f:
                return bool(json.load(f).get("has_critic")) and os.path.isdir(os.path.join(self.path, SHARDED_DIR))
        except (OSError, ValueError):
            return False

    @property
    def critic_kind(self) -> Optional[str]:
        """``head`` (a value head on the actor, ``model.shared_backbone``) or ``model`` (a value model); None when
        the checkpoint predates the record (those hold value models) or has no critic."""
        try:
            with open(os.path.join(self.path, META_FILE), encoding="utf-8") as f:
                return json.load(f).get("critic_kind")
        except (OSError, ValueError):
            return None


def checkpoints_root(output_dir: str) -> str:
    return os.path.join(output_dir, CHECKPOINTS_DIR)


# ---------------------------------------------------------------------------------------------------------- saving
def trainer_state(updater, version: int, extra: Optional[dict] = None, sharded: bool = False) -> dict[str, Any]:
    """Everything of a :class:`~asyncppo.learner.ppo.PPOUpdate` that is not a model weight, plus the RNG states.
    ``sharded``: the optimiser states are in the ``sharded/`` shards instead (several learner ranks)."""
    state: dict[str, Any] = {
        "format": FORMAT,
        "version": int(version),
        "sharded": bool(sharded),
        "actor_opt": updater.actor_opt.state_dict() if not sharded else None,
        "actor_sched": updater.actor_sched.state_dict(),
        "critic_opt": updater.critic_opt.state_dict() if updater.critic_opt is not None and not sharded else None,
        "critic_sched": updater.critic_sched.state_dict() if updater.critic_sched is not None else None,
        "kl_ctrl": updater.kl_ctrl.state_dict(),
        "reward_stats": updater.reward_stats.state_dict() if updater.reward_stats is not None else None,
        "generator": updater.generator.get_state(),
        "torch_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "extra": dict(extra or {}),
    }
    return state


def _write_state(state: dict, path: str) -> None:
    torch.save(state, path)


def _arch_summary(config_path: str) -> dict:
    with open(config_path, encoding="utf-8") as f:
        cfg = json.load(f)
    return {k: cfg.get(k) for k in ARCH_KEYS}


def save_checkpoint(
    output_dir: str,
    version: int,
    *,
    actor: nn.Module,
    tokenizer,
    updater,
    critic: Optional[nn.Module] = None,
    keep: int = 2,
    extra: Optional[dict] = None,
    sharded=None,
) -> Checkpoint:
    """Write ``<output_dir>/checkpoints/step_<version>`` atomically, point ``latest`` at it, prune old ones.

    ``actor`` must be an unsharded model (rank 0's plain copy on a multi-rank learner). ``keep`` >= 1 checkpoints
    are kept, newest first; an unfinished ``.tmp-*`` directory left by a crash is removed by the next save.
    ``sharded(path)``: several learner ranks; called with the ``sharded/`` directory inside the unfinished checkpoint,
    it must have every rank write its shards there (:func:`save_sharded`, collective) before it returns.
    """
    if keep < 1:
        raise ValueError(f"keep must be >= 1, got {keep}")
    with writing(output_dir, version) as (root, name, tmp):
        actor_dir = os.path.join(tmp, ACTOR_DIR)
        actor.save_pretrained(actor_dir)
        tokenizer.save_pretrained(actor_dir)
        if sharded is not None:
            sharded(os.path.join(tmp, SHARDED_DIR))
        elif critic is not None:
            save_model(critic, os.path.join(tmp, CRITIC_FILE))
        _write_state(trainer_state(updater, version, extra, sharded=sharded is not None),
                     os.path.join(tmp, STATE_FILE))
        meta = {
            "format": FORMAT,
            "version": int(version),
            "has_critic": critic is not None,
            "critic_kind": critic_kind(critic),
            "arch": _arch_summary(os.path.join(actor_dir, "config.json")),
            "saved_at": time.time(),
        }
        with open(os.path.join(tmp, META_FILE), "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
        return Checkpoint(publish(root, tmp, name, keep), int(version))


@contextlib.contextmanager
def writing(output_dir: str, version: int):
    """``with writing(output_dir, version) as (root, name, tmp):`` write the checkpoint's files into ``tmp`` and
    :func:`publish` it. Any failure on the way becomes a :class:`CheckpointWriteError` naming the checkpoint, the
    error and the free space there, after the unfinished directory is removed (a full disk gets its space back).

    Why these types and not only ``OSError``: the writers report the same full disk differently (measured under a
    file-size limit: ``OSError`` from ``open``, ``SafetensorError`` from safetensors, ``RuntimeError`` from
    ``torch.save``; ``CheckpointException``, a ``BaseException``, from a sharded save on every rank alike). Anything
    else (a ``TypeError`` in our own code, a device out of memory, a broken collective) is not a disk's refusal and
    is raised as it is, after the unfinished directory is removed."""
    root, name = checkpoints_root(output_dir), f"step_{int(version)}"
    tmp = os.path.join(root, f".tmp-{name}")
    try:
        yield unfinished(output_dir, version)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _refused_write(exc):
            raise
        raise CheckpointWriteError(f"checkpoint {name} could not be written to {root}: {type(exc).__name__}: "
                                   f"{str(exc)[:300]}{_free_space(root)}") from exc


def _refused_write(exc: BaseException) -> bool:
    """The storage refused the write (the types :func:`writing` names), not a bug, an out-of-memory or a failed
    collective, which must not be turned into a warning on every save."""
    from safetensors import SafetensorError  # light: the writer's own error type

    if isinstance(exc, (torch.OutOfMemoryError, torch.distributed.DistBackendError)):
        return False
    return isinstance(exc, (OSError, SafetensorError, RuntimeError, CheckpointException))


def _free_space(path: str) -> str:
    """`` (12.3 GiB free of 50.0 GiB there)`` for the filesystem that holds ``path``, or nothing."""
    usage = disk_usage_near(path)
    return f" ({usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB there)" if usage else ""


def unfinished(output_dir: str, version: int) -> tuple[str, str, str]:
    """``(checkpoints root, step name, empty temporary directory)`` for writing the checkpoint of ``version``."""
    root = checkpoints_root(output_dir)
    os.makedirs(root, exist_ok=True)
    name = f"step_{int(version)}"
    tmp = os.path.join(root, f".tmp-{name}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return root, name, tmp


def publish(root: str, tmp: str, name: str, keep: int) -> str:
    """Rename the finished ``tmp`` to ``root/name``, point ``latest`` at it and prune; returns its path."""
    final = os.path.join(root, name)
    if os.path.exists(final):  # e.g. a resumed run writing into the run dir it resumed from
        trash = os.path.join(root, f".old-{name}-{os.getpid()}")
        os.rename(final, trash)
        shutil.rmtree(trash, ignore_errors=True)
    os.rename(tmp, final)
    _write_latest(root, name)
    _prune(root, keep)
    return final


def _write_latest(root: str, name: str) -> None:
    tmp = os.path.join(root, f".{LATEST_FILE}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(root, LATEST_FILE))


def _complete_steps(root: str) -> list[tuple[int, str]]:
    out = []
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        step = step_of(entry)
        if step is not None and os.path.isfile(os.path.join(root, entry, META_FILE)):
            out.append((step, entry))
    return sorted(out)


def _prune(root: str, keep: int) -> None:
    """Keep the newest ``keep`` checkpoints (and whatever ``latest`` names); drop leftovers of crashed saves."""
    latest = read_latest(root)
    steps = _complete_steps(root)
    for _, entry in steps[:-keep]:
        if entry != latest:
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    for entry in os.listdir(root):
        if entry.startswith((".tmp-", ".old-")):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------- finding
def resolve_checkpoint(path: str) -> Checkpoint:
    """``path`` is a checkpoint dir (``.../step_N``), a run's ``checkpoints/`` dir, or a run dir (its ``latest``).

    Raises :class:`CheckpointError` naming what was looked for when there is no complete checkpoint there.
    """
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(path):
        raise CheckpointError(f"trainer.resume_from={path!r}: no such directory")
    if os.path.isfile(os.path.join(path, META_FILE)):
        return _open(path)
    for root in (checkpoints_root(path), path):
        if not os.path.isdir(root):
            continue
        name = read_latest(root)
        if name is not None:
            target = os.path.join(root, name)
            if not os.path.isfile(os.path.join(target, META_FILE)):
                raise CheckpointError(
                    f"trainer.resume_from={path!r}: {os.path.join(root, LATEST_FILE)} names {name!r}, which is not "
                    "a complete checkpoint"
                )
            return _open(target)
        steps = _complete_steps(root)
        if steps:  # 'latest' lost (e.g. a crash between the rename and its update): the newest complete one
            return _open(os.path.join(root, steps[-1][1]))
    raise CheckpointError(
        f"trainer.resume_from={path!r}: no checkpoint found (looked for {META_FILE} there, and for "
        f"{CHECKPOINTS_DIR}/{LATEST_FILE} or {CHECKPOINTS_DIR}/step_N/); runs write checkpoints when "
        "trainer.save_every > 0"
    )


def _open(path: str) -> Checkpoint:
    with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path!r} has format {meta.get('format')!r}; this asyncppo reads {FORMAT}")
    for needed in (os.path.join(path, ACTOR_DIR, "config.json"), os.path.join(path, STATE_FILE)):
        if not os.path.isfile(needed):
            raise CheckpointError(f"checkpoint {path!r} is incomplete: {needed!r} is missing")
    return Checkpoint(path, int(meta["version"]))


def critic_kind(critic: Optional[nn.Module]) -> Optional[str]:
    if critic is None:
        return None
    return "head" if shares_actor_body(critic) else "model"


def check_compatible(ckpt: Checkpoint, model_path: str, *, needs_critic: bool, wanted_critic: Optional[str] = None) \
        -> None:
    """The checkpoint's actor must have the architecture of ``model_path`` (the run's configured model), and hold a
    critic when the run trains one, of the kind it trains (``wanted_critic``: ``head`` or ``model``). Raises
    :class:`CheckpointError` listing every difference."""
    have = _arch_summary(os.path.join(ckpt.actor_dir, "config.json"))
    want_file = os.path.join(model_path, "config.json")
    if os.path.isfile(want_file):
        want = _arch_summary(want_file)
        diffs = [f"{k}: checkpoint {have[k]!r} vs model {want[k]!r}" for k in ARCH_KEYS if have[k] != want[k]]
        if diffs:
            raise CheckpointError(
                f"checkpoint {ckpt.path!r} does not fit model.path={model_path!r} (different architecture: "
                + "; ".join(diffs) + ")"
            )
    if needs_critic and not ckpt.has_critic:
        raise CheckpointError(
            f"checkpoint {ckpt.path!r} has no critic, but this run trains one (algorithm.adv_estimator / use_critic); "
            "resume with the configuration that wrote it"
        )
    have_critic = ckpt.critic_kind or ("model" if ckpt.has_critic else None)
    if needs_critic and wanted_critic and have_critic and have_critic != wanted_critic:
        names = {"head": "a value head on the actor", "model": "a separate value model"}
        raise CheckpointError(
            f"checkpoint {ckpt.path!r} holds {names[have_critic]} as its critic, but this run trains "
            f"{names[wanted_critic]} (model.shared_backbone, which one learner rank honours); resume with the "
            f"model.shared_backbone={have_critic == 'head'} that wrote it"
        )


# ---------------------------------------------------------------------------------------------------------- loading
def load_trainer_state(path: str) -> dict[str, Any]:
    """Read ``trainer_state.pt`` with ``weights_only=True`` (no code runs while loading)."""
    return torch.load(path, map_location="cpu", weights_only=True)


def restore(ckpt: Checkpoint, updater, critic: Optional[nn.Module] = None) -> dict[str, Any]:
    """Load the critic weights and every optimiser/scheduler/controller/RNG state into a freshly built updater (whose
    actor was loaded from ``ckpt.actor_dir``). Returns the trainer state (its ``version`` and ``extra``)."""
    state = load_trainer_state(ckpt.state_file)
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{ckpt.state_file!r} has format {state.get('format')!r}; this asyncppo reads {FORMAT}")
    if state.get("sharded"):  # collective: every learner rank calls restore()
        load_sharded(os.path.join(ckpt.path, SHARDED_DIR), updater, critic)
    else:
        if critic is not None:
            load_model(critic, ckpt.critic_file, strict=True, device=str(next(critic.parameters()).device))
        updater.actor_opt.load_state_dict(state["actor_opt"])
        if updater.critic_opt is not None:
            if state["critic_opt"] is None:
                raise CheckpointError(
                    f"checkpoint {ckpt.path!r} has no critic optimiser state, but this run trains a critic")
            updater.critic_opt.load_state_dict(state["critic_opt"])
    updater.actor_sched.load_state_dict(state["actor_sched"])
    if updater.critic_sched is not None and state["critic_sched"] is not None:
        updater.critic_sched.load_state_dict(state["critic_sched"])
    updater.kl_ctrl.load_state_dict(state["kl_ctrl"])
    if updater.reward_stats is not None and state["reward_stats"] is not None:
        updater.reward_stats.load_state_dict(state["reward_stats"])
    updater.generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    if state["cuda_rng"] and torch.cuda.is_available() and len(state["cuda_rng"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    return state


# ---------------------------------------------------------------------------------------------------------- sharded
def sharded_tmp_dir(output_dir: str, version: int) -> str:
    """Where the ranks of a multi-rank learner write their shards of checkpoint ``version`` (inside the unfinished
    checkpoint that rank 0 renames when complete); every rank computes it alike from the run's output dir."""
    return os.path.join(checkpoints_root(output_dir), f".tmp-step_{int(version)}", SHARDED_DIR)


def _dcp_state(updater, critic: Optional[nn.Module]) -> dict[str, Any]:
    actor_sd, actor_osd = get_state_dict(updater.actor, updater.actor_opt)
    state: dict[str, Any] = {"actor": actor_sd, "actor_opt": actor_osd}
    if critic is not None and updater.critic_opt is not None:
        critic_sd, critic_osd = get_state_dict(critic, updater.critic_opt)
        state.update(critic=critic_sd, critic_opt=critic_osd)
    return state


def save_sharded(path: str, updater, critic: Optional[nn.Module] = None) -> None:
    """Collective (every learner rank, in step): each rank writes its own shards of the (FSDP) actor, critic and
    their optimiser states to ``path`` with torch.distributed.checkpoint; no rank gathers a full copy."""
    dcp.save(_dcp_state(updater, critic), checkpoint_id=path)


def load_sharded(path: str, updater, critic: Optional[nn.Module] = None) -> None:
    """Collective: load what :func:`save_sharded` wrote into this rank's shards (the world size may differ)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path!r} is missing: the checkpoint was written by several learner ranks")
    state = _dcp_state(updater, critic)
    dcp.load(state, checkpoint_id=path)
    set_state_dict(updater.actor, updater.actor_opt, model_state_dict=state["actor"],
                   optim_state_dict=state["actor_opt"])
    if "critic" in state:
        set_state_dict(critic, updater.critic_opt, model_state_dict=state["critic"],
                       optim_state_dict=state["critic_opt"])
