"""What every check shares: the one error format (``bad``, defined with the schema in
:mod:`boost_titan.config`), the JobConfig class
torchtitan's and boost_titan's sections merge into, and small helpers."""

from __future__ import annotations

from boost_titan import config as boost_config
from boost_titan.config import ConfigError, ConfigPathError, bad  # noqa: F401  (the checks' names)


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
