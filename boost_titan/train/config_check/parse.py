"""Parsing a config: the config file (exists, valid TOML and ``extends`` chain) and the
command-line flags (a value after a boolean flag) are checked before torchtitan's
parser reads them; the parsed config then goes through :func:`check_config`."""

from __future__ import annotations

import dataclasses
import os
import tomllib

from boost_titan.train import specs
from boost_titan.train.config_check.check import check_config
from boost_titan.train.config_check.common import ConfigPathError, bad, config_class
from boost_titan.train.config_file import (
    ConfigFileError,
    config_file_arg,
    config_manager,
    load_config_toml,
)


def _check_config_file(path: str) -> None:
    if not os.path.isfile(path):
        why = "is a folder, not a TOML file" if os.path.isdir(path) else "does not exist"
        raise bad("job", "config_file", path, f"{why} (cwd {os.getcwd()!r})", ConfigPathError)
    try:
        load_config_toml(path)  # the whole `extends` chain
    except ConfigFileError as e:
        raise bad("job", "config_file", path, str(e)) from None
    except tomllib.TOMLDecodeError as e:
        raise bad("job", "config_file", path, f"is not valid TOML: {e}") from None
    except UnicodeDecodeError as e:
        raise bad("job", "config_file", path, f"is not a UTF-8 TOML file: {e}") from None


def _check_flag_values(args: list[str], cls) -> None:
    """``--section.flag true`` is not tyro syntax (tyro would say only "Unrecognized
    options: true"): name the flag and its two spellings."""
    hints = {}
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(f.type):
            for g in dataclasses.fields(f.type):
                hints[f"{f.name}.{g.name}"] = g.type
    for i, arg in enumerate(args[:-1]):
        if not arg.startswith("--") or "=" in arg:
            continue
        dotted = arg[2:].replace("-", "_")
        if dotted.split(".", 1)[-1].startswith("no_"):
            continue
        nxt = args[i + 1]
        if hints.get(dotted) in (bool, "bool") and not nxt.startswith("--"):
            section, key = dotted.split(".", 1)
            raise ValueError(
                f"[{section}] {key} is a flag and takes no value (got {nxt!r}): write "
                f"--{section}.{key} to set it or --{section}.no-{key.replace('_', '-')} to clear it"
            )


def parse_config(args: list[str], *, layout: bool = True, shapes=None):
    """CLI + TOML -> checked JobConfig (``layout``, ``shapes``: see :func:`check_config`). Registers
    boost_titan's train specs and datasets with torchtitan first (idempotent): the
    config names them."""
    specs.register_all()
    path = config_file_arg(args)
    if path is not None:
        _check_config_file(path)
    _check_flag_values(args, config_class())
    config = config_manager(config_class()).parse_args(args)
    check_config(config, layout=layout, shapes=shapes)
    return config
