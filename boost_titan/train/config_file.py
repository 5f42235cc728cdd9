"""Read a training TOML, following its ``extends`` chain.

A config may start with ``extends = "base/debug.toml"`` (a path relative to the file
itself): the base is read first and every section of the config overrides it key by
key. Bases may extend further bases. This is the only thing boost_titan adds to
torchtitan's TOML format; the merged result is what torchtitan's ConfigManager parses.
"""

from __future__ import annotations

import os
import tomllib
from typing import Any


class ConfigFileError(ValueError):
    pass


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config_toml(path: str, _seen: tuple[str, ...] = ()) -> dict[str, Any]:
    """The TOML at ``path`` merged over the bases it ``extends``."""
    real = os.path.realpath(path)
    if real in _seen:
        chain = " -> ".join((*_seen, real))
        raise ConfigFileError(f"[job] config_file: `extends` loops: {chain}")
    with open(path, "rb") as f:
        values = tomllib.load(f)
    base = values.pop("extends", None)
    if base is None:
        return values
    if not isinstance(base, str):
        raise ConfigFileError(f"{path}: extends = {base!r} must be a path (string)")
    base_path = os.path.join(os.path.dirname(path), base)
    if not os.path.isfile(base_path):
        raise ConfigFileError(
            f"{path}: extends = {base!r} does not exist (looked for {base_path}, relative "
            "to the config file)"
        )
    return _merge(load_config_toml(base_path, (*_seen, real)), values)


def config_file_arg(args: list[str]) -> str | None:
    """The ``--job.config_file`` value, found as torchtitan's ConfigManager finds it."""
    keys = {"--job.config-file", "--job.config_file"}
    for i, arg in enumerate(args):
        if "=" in arg:
            key, value = arg.split("=", 1)
            if key in keys:
                return value
        elif arg in keys and i < len(args) - 1:
            return args[i + 1]
    return None


def config_manager(config_cls):
    """torchtitan's ConfigManager, reading TOMLs through :func:`load_config_toml`."""
    from torchtitan.config import ConfigManager

    class _Manager(ConfigManager):
        def _maybe_load_toml(self, args: list[str]) -> dict[str, Any] | None:
            path = config_file_arg(args)
            return None if path is None else load_config_toml(path)

    return _Manager(config_cls=config_cls)
