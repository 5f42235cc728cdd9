"""Parse and check a training config: every bad value fails here, before a process
group or a weight exists, with an error naming the key, the value and what is valid.

It imports torchtitan: import it after ``boost_titan.cpu_runtime.activate()``
(torchtitan fixes its device type at import), as ``boost_titan.train`` does.
"""

from __future__ import annotations

import boost_titan.specs  # noqa: F401  (registers the train specs checked below)
from boost_titan import config as boost_config
from boost_titan.compile import check_compile_config
from boost_titan.pipeline import check_pipeline_config


def config_class():
    from torchtitan.config import ConfigManager, JobConfig

    return ConfigManager._merge_configs(JobConfig, boost_config.JobConfig)


def parse_config(args: list[str]):
    from torchtitan.config import ConfigManager

    config = ConfigManager(config_cls=config_class()).parse_args(args)
    check_config(config)
    return config


def check_config(config) -> None:
    """Fail early, with the valid choices: [boost] values, selective AC option, model
    name and flavor, pipeline split and microbatching."""
    from torchtitan.models import _supported_models  # noqa: F401 (registers)
    from torchtitan.protocols.train_spec import _extra_train_specs

    boost_config.validate_boost_config(config.boost)
    check_compile_config(config)
    ac = config.activation_checkpoint  # (the mode itself is a Literal: the parser checks it)
    if ac.mode == "selective" and not (ac.selective_ac_option == "op" or ac.selective_ac_option.isdigit()):
        raise ValueError(
            f"[activation_checkpoint] selective_ac_option = {ac.selective_ac_option!r} is not "
            "valid; use 'op' or a positive integer (every n-th block)"
        )
    name, flavor = config.model.name, config.model.flavor
    ours = sorted(_extra_train_specs)
    if name not in _extra_train_specs and name not in _supported_models:
        raise ValueError(
            f"unknown model name {name!r}; boost_titan models: {ours}, "
            f"torchtitan models: {sorted(_supported_models)}"
        )
    if name in _extra_train_specs:
        table = _extra_train_specs[name].model_args
        if flavor not in table:
            raise ValueError(
                f"unknown flavor {flavor!r} for model {name!r}; valid flavors: {sorted(table)}"
            )
        check_pipeline_config(config, table[flavor].n_layers)
