"""``asyncppo launch --config-file FILE.yaml``: one YAML file of values (for instance the output of
``asyncppo convert``, or of ``--dry-run``) run as it is.

The file is composed through Hydra like every other config, so overrides, presets and validation behave the same:
it becomes the ``_self_`` of a temporary primary config whose defaults list is the schema followed by every preset
group set to null. The order is therefore schema defaults < presets named on the command line (``algorithm=grpo``)
< the file < ``KEY=VALUE`` overrides. No preset applies unless named: a converted file says everything it means,
and the rest is the schema's defaults, not the ``ppo``/``addition`` presets of a bare ``asyncppo launch``.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import yaml

from asyncppo.config.keys import check_override_key
from asyncppo.config.validate import ConfigError


def _leaf_keys(node: dict, prefix: str = "") -> Iterator[str]:
    for key, value in node.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from _leaf_keys(value, path + ".")
        else:
            yield path


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The file's mapping, refused with a clear message when it is not one or names keys the schema lacks."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError([f"--config-file {str(p)!r}: no such file"])
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError([f"--config-file {str(p)!r}: not valid YAML ({' '.join(str(exc).split())})"]) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError([f"--config-file {str(p)!r}: expected a mapping of options, got {type(data).__name__}"])
    for reserved in ("defaults", "hydra"):
        if reserved in data:
            raise ConfigError([f"--config-file {str(p)!r}: '{reserved}' is not an option; a file with a defaults "
                               "list is a primary config: put it in a folder as config.yaml and use --config-dir"])
    problems = [f"--config-file {p.name}: {msg}" for key in _leaf_keys(data)
                if (msg := check_override_key(key, add=False))]
    if problems:
        raise ConfigError(problems)
    return data


@contextlib.contextmanager
def file_config_dir(path: str | Path, source_dir: Path, groups: Sequence[str]) -> Iterator[Path]:
    """A temporary config folder whose ``config.yaml`` is the file under a defaults list of null presets; the
    preset folders of ``source_dir`` are copied next to it so that ``GROUP=PRESET`` overrides still resolve."""
    data = read_config_file(path)
    with tempfile.TemporaryDirectory(prefix="asyncppo-config-") as tmp:
        root = Path(tmp)
        present = []
        for sub in sorted(source_dir.iterdir()):
            if sub.is_dir():
                shutil.copytree(sub, root / sub.name)
                if sub.name in groups:
                    present.append(sub.name)
        defaults: list[Any] = ["asyncppo_schema"] + [{g: None} for g in present] + ["_self_"]
        text = yaml.safe_dump({"defaults": defaults}, sort_keys=False)
        if data:
            text += yaml.safe_dump(data, sort_keys=False, allow_unicode=True)
        (root / "config.yaml").write_text(text, encoding="utf-8")
        yield root

