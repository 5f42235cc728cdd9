"""What every check shares: the one error format (``bad``), the JobConfig class
torchtitan's and boost_titan's sections merge into, and small helpers."""

from __future__ import annotations

from boost_titan import config as boost_config

# Errors are plain ValueError (FileNotFoundError for a missing file or folder), as
# torchtitan's own and existing callers expect; the message carries the detail.
ConfigError = ValueError
ConfigPathError = FileNotFoundError


def bad(section: str, key: str, value, why: str, cls: type[Exception] = ValueError) -> Exception:
    """``[section] key = value <why>``: the one error format of these checks."""
    return cls(f"[{section}] {key} = {value!r} {why}")


def config_class():
    from torchtitan.config import ConfigManager, JobConfig

    return ConfigManager._merge_configs(JobConfig, boost_config.JobConfig)


def _at_least(section: str, key: str, value, low, extra: str = "") -> None:
    if value < low:
        raise bad(section, key, value, f"must be >= {low}{extra}")


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def _ours(config) -> bool:
    from torchtitan.protocols.train_spec import _extra_train_specs

    return config.model.name in _extra_train_specs
