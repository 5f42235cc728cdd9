"""Parse and check a training config: every bad value fails here, before a process
group or a weight exists, with an error naming the key, the value and what is valid.

It imports torchtitan: import it after ``boost_titan.parallel.cpu_runtime.activate()``
(torchtitan fixes its device type at import), as ``boost_titan.train`` does. Parsing
registers boost_titan's train specs with
torchtitan (``boost_titan.train.specs.register_all``).

Two kinds of checks:

* **config checks** (always): types of every value (a TOML file is not type-checked by
  torchtitan), ranges, names, the [boost] options against the model's shapes, the
  tensor-parallel degree against the model's dimensions, pipeline split, batch sizes.
* **launch checks** (when ``WORLD_SIZE`` is set, as torchrun sets it for every
  training process, or when ``check_config(config, world_size=N)`` is given one): the
  product of the parallel degrees against the world size, and the files a run reads
  (tokenizer folder with tokenizer.json, corpus / dataset path, schedule csv, the
  checkpoint a run would load). Tools
  that only parse a config (checkpoint export, tests) skip them.

One module per job:

    common     the error format (``bad``), the merged JobConfig class, small helpers
    parse      config file and command-line flags, then torchtitan's parser
    typecheck  the type of every value against its annotation
    training   [training] (with its dataloader and dataset), [optimizer], [lr_scheduler],
               [metrics], [profiling], [validation], [activation_checkpoint]
    checkpoint [checkpoint] options; at launch, what the run would load (the dump
               folder's checkpoints, initial_load_path, the step to resume)
    layout     [parallelism]: degrees against the world size, PP schedule, batch sizes
    model      model name and flavor, [boost] against the flavor's shapes, TP degree,
               latent checkpointing, pipeline split
    converters [model] converters: registered names, what they would convert in our
               models; at launch, the GPU and torchao they need
    files      what a launch reads from disk: tokenizer folder, datasets
    check      ``check_config``: every check above, in order
"""

from __future__ import annotations

from boost_titan.train.config_check.check import check_config
from boost_titan.train.config_check.common import ConfigError, ConfigPathError, bad, config_class
from boost_titan.train.config_check.model import config_args
from boost_titan.train.config_check.parse import parse_config

__all__ = [
    "ConfigError",
    "ConfigPathError",
    "bad",
    "check_config",
    "config_args",
    "config_class",
    "parse_config",
]
