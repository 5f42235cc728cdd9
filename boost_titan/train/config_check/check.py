"""``check_config``: every check, in a fixed order (the first problem found is the one
reported); the launch checks only with a world size (``WORLD_SIZE`` or given)."""

from __future__ import annotations

import os

from boost_titan import config as boost_config
from boost_titan.parallel.compile import check_compile_config
from boost_titan.train import specs
from boost_titan.train.config_check.checkpoint import (
    _check_checkpoint,
    _check_checkpoint_files,
    _check_hf_layout,
)
from boost_titan.train.config_check.common import ConfigError
from boost_titan.train.config_check.fault_tolerance import _check_fault_tolerance
from boost_titan.train.config_check.files import _check_files, _check_writable
from boost_titan.train.config_check.layout import _check_batches, _check_parallelism
from boost_titan.train.config_check.model import _check_model
from boost_titan.train.config_check.training import (
    _check_lr_scheduler,
    _check_misc,
    _check_optimizer,
    _check_training,
)
from boost_titan.train.config_check.typecheck import _check_types


def _world_size(world_size: int | None) -> int | None:
    if world_size is not None:
        return world_size
    env = os.environ.get("WORLD_SIZE")
    if env is None:
        return None
    try:
        ws = int(env)
    except ValueError:
        raise ConfigError(f"environment WORLD_SIZE = {env!r} is not an integer") from None
    if ws < 1:
        raise ConfigError(f"environment WORLD_SIZE = {ws} must be >= 1")
    return ws


def check_config(
    config,
    world_size: int | None = None,
    *,
    layout: bool = True,
    files: bool = True,
    shapes=None,
) -> None:
    """Fail early, with the valid choices; see :mod:`boost_titan.train.config_check`.
    ``world_size``: the launch's process count (default: ``WORLD_SIZE`` from the
    environment; absent: the launch checks are skipped). ``layout=False`` (tools that
    only build the model, e.g. checkpoint export): the parallel layout, plan, batch and
    [checkpoint] checks are skipped. ``files=False`` (the dry run): the launch checks
    without the files (data, tokenizer, the checkpoint a run would load). ``shapes``
    (where, dense args): the model is checked at those shapes, not its flavor's
    (from-dense)."""
    specs.register_all()  # the model names checked below are the train specs'
    ws = _world_size(world_size)
    _check_types(config)
    boost_config.validate_boost_config(config.boost)
    _check_training(config)
    _check_optimizer(config)
    _check_lr_scheduler(config)
    _check_misc(config)
    if not layout:
        _check_model(config, None, shapes)
        return
    _check_checkpoint(config)  # (irrelevant to tools that only build the model)
    deg = _check_parallelism(config, ws)
    _check_fault_tolerance(config, ws if files else None)
    check_compile_config(config)
    _check_model(config, deg, shapes)
    _check_hf_layout(config)
    _check_batches(config, deg)
    if ws is not None and files:
        _check_writable(config)
        _check_checkpoint_files(config)
        _check_files(
            config, deg["data_parallel_replicate_degree"] * deg["data_parallel_shard_degree"]
        )
