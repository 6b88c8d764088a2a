"""Compose, type-check, validate: the one entry point that turns overrides into an :class:`AsyncPPOConfig`.

The YAML presets live inside the package (``asyncppo/configs``) so that a wheel install finds them next to the
code, exactly like an editable install; the repository's top-level ``configs`` is a link to that folder so the
files are also where users look for them. Hydra's compose API is used (not ``@hydra.main``) because the CLI
owns argument parsing and must not let Hydra change the working directory or create output folders.

Every failure - unknown key, bad type, unknown preset, a value validation rejects - surfaces as one
:class:`ConfigError` whose lines name the key, the value and what is allowed.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Sequence

from hydra import compose as hydra_compose
from hydra import initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, OverrideParseException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import MissingMandatoryValue, OmegaConfBaseException

from asyncppo.config.config_file import file_config_dir
from asyncppo.config.keys import CONFIG_GROUPS, check_override_key
from asyncppo.config.schema import AsyncPPOConfig
from asyncppo.config.store import register_schema
from asyncppo.config.validate import ConfigError, validate_config
from asyncppo.config.validate_window import keep_saved_tuning, resolve_window

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
#: ``env=<gymnasium id>`` without a preset of that name uses this preset with ``env.id=<id>`` (docs/embodied.md).
GENERIC_ENV_PRESET = "gym"


class ConfigWarning(UserWarning):
    """A legal but probably unintended combination of options."""


def check_override_keys(overrides: Sequence[str]) -> list[str]:
    """Parse overrides with Hydra's grammar and check every key against the schema, collecting all problems."""
    problems = []
    parser = OverridesParser.create()
    for text in overrides:
        try:
            (ov,) = parser.parse_overrides([text])
        except OverrideParseException as exc:
            problems.append(f"{text!r}: cannot parse override ({str(exc).splitlines()[0]}); expected key=value")
            continue
        if ov.is_delete():
            problems.append(f"{text!r}: deleting keys ('~') is not supported: every option has a default")
            continue
        problem = check_override_key(ov.key_or_group, add=ov.is_add() or ov.is_force_add())
        if problem:
            problems.append(problem)
    return problems


def _explain(exc: BaseException) -> str:
    """One readable line from a Hydra/OmegaConf exception chain, led by the key when one is known."""
    for err in (exc, exc.__cause__):
        key = getattr(err, "full_key", None)
        if key and isinstance(err, OmegaConfBaseException):
            first = str(getattr(err, "msg", None) or err).splitlines()[0].strip()
            return f"{key}: {first}"
    msg = " ".join(str(exc).split("Config search path")[0].split())
    cause = exc.__cause__
    if cause is not None and str(cause) and str(cause) not in msg:
        msg += " | " + " ".join(str(cause).split())
    return msg or type(exc).__name__


def _expand_env_id(overrides: list[str], cdir: Path) -> list[str]:
    """``env=HalfCheetah-v5`` (no preset file of that name) -> ``env=gym env.id=HalfCheetah-v5``."""
    out = []
    for text in overrides:
        name = text[len("env="):] if text.startswith("env=") else None
        if name and name != "null" and not (cdir / "env" / f"{name}.yaml").is_file():
            out += [f"env={GENERIC_ENV_PRESET}", f"env.id={name}"]
        else:
            out.append(text)
    return out


def compose(overrides: Sequence[str] = (), config_dir: Optional[str | Path] = None,
            config_name: str = "config") -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` (default: the packaged configs) with ``overrides``.

    Returns the typed DictConfig before validation; raises :class:`ConfigError` on any composition problem.
    """
    overrides = _expand_env_id(list(overrides), Path(config_dir or CONFIG_DIR))
    problems = check_override_keys(overrides)
    if problems:
        raise ConfigError(problems)
    register_schema()
    cdir = Path(config_dir or CONFIG_DIR).resolve()
    if not (cdir / f"{config_name}.yaml").is_file():
        raise ConfigError([f"config_dir={str(cdir)!r}: no {config_name}.yaml there"])
    if GlobalHydra.instance().is_initialized():  # e.g. called from inside a Hydra app; restored on exit
        GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(cdir), version_base="1.3", job_name="asyncppo"):
            return hydra_compose(config_name=config_name, overrides=overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        raise ConfigError([_explain(exc)]) from None


def to_dataclass(node: DictConfig | dict) -> AsyncPPOConfig:
    """Merge ``node`` onto the schema and convert to the dataclass (resolving interpolations)."""
    register_schema()
    try:
        merged = OmegaConf.merge(OmegaConf.structured(AsyncPPOConfig), node)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except MissingMandatoryValue as exc:
        key = getattr(exc, "full_key", None) or "?"
        raise ConfigError([f"{key}=???: required, no default; set it, e.g. {key}=..."]) from None
    except OmegaConfBaseException as exc:
        raise ConfigError([_explain(exc)]) from None


def _finish(cfg: AsyncPPOConfig) -> AsyncPPOConfig:
    for msg in validate_config(cfg):
        warnings.warn(msg, ConfigWarning, stacklevel=3)
    return cfg


def load_config(overrides: Sequence[str] = (), config_dir: Optional[str | Path] = None,
                config_name: str = "config", config_file: Optional[str | Path] = None) -> AsyncPPOConfig:
    """Compose presets + overrides, convert to the typed dataclass, validate and fill derived defaults.

    ``overrides`` use Hydra syntax: ``algorithm=grpo``, ``algorithm.pg_clip=0.28``, ``+extra.note=x``.
    ``config_file``: a YAML file of values (e.g. from ``asyncppo convert``) layered on the schema defaults, under
    the overrides; no preset applies unless named (see :mod:`asyncppo.config.config_file`).
    Raises :class:`ConfigError`; emits :class:`ConfigWarning` for suspicious but legal combinations.
    """
    if config_file is not None:
        source = Path(config_dir or CONFIG_DIR).resolve()
        with file_config_dir(config_file, source, CONFIG_GROUPS) as tmp:
            return _finish(_auto_from_preset(to_dataclass(compose(overrides, tmp, "config")), overrides, tmp, "config"))
    cfg = to_dataclass(compose(overrides, config_dir, config_name))
    return _finish(_auto_from_preset(cfg, overrides, config_dir, config_name))


_AUTO_KEYS = ("rollout.max_staleness", "rollout.admission_lookahead")


def _auto_from_preset(cfg: AsyncPPOConfig, overrides: Sequence[str], config_dir, config_name: str) -> AsyncPPOConfig:
    """``rollout.max_staleness=auto`` on the command line over a preset that set a number starts from that number
    (validate_window.py): the presets' windows were chosen for their task, a better start than a generic one. The
    preset's values are read by composing once more without the ``auto`` overrides (only when there are some).
    A saved config's tuning (``rollout.window_auto``) loses the knobs the overrides pin (keep_saved_tuning)."""
    words = dict(o.lstrip("+~").split("=", 1) for o in overrides if "=" in o)
    if cfg.rollout.window_auto:
        keep_saved_tuning(cfg.rollout, words.get(_AUTO_KEYS[0]), words.get(_AUTO_KEYS[1]))
    if not any(o.split("=", 1)[0].lstrip("+~") in _AUTO_KEYS and o.endswith("=auto") for o in overrides):
        return cfg
    rest = [o for o in overrides if not (o.split("=", 1)[0].lstrip("+~") in _AUTO_KEYS and o.endswith("=auto"))]
    preset = compose(rest, config_dir, config_name).rollout
    pk, pj = preset.max_staleness, preset.admission_lookahead
    resolve_window(cfg, pk if isinstance(pk, int) else None, pj if isinstance(pj, int) else None)
    return cfg


def config_to_yaml(cfg: AsyncPPOConfig) -> str:
    """The config as YAML; :func:`config_from_yaml` turns it back into an equal dataclass."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_from_yaml(text: str) -> AsyncPPOConfig:
    """Parse YAML (as written by :func:`config_to_yaml`, or any subset of keys) into a validated config."""
    try:
        node = OmegaConf.create(text)
    except OmegaConfBaseException as exc:
        raise ConfigError([f"cannot parse YAML: {_explain(exc)}"]) from None
    if not isinstance(node, DictConfig):
        raise ConfigError([f"YAML config must be a mapping at the top level, got {type(node).__name__}"])
    return _finish(to_dataclass(node))
