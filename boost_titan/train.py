"""Entry point: ``torchrun ... -m boost_titan.train --job.config_file X.toml``.

Behaves exactly like ``torchtitan.train`` (same Trainer, same TOML and CLI), plus:
CPU/gloo support when no GPU is visible, boost_titan's train specs and datasets, and
the ``[boost]`` config section.
"""

from __future__ import annotations

from boost_titan import cpu_runtime

cpu_runtime.activate()  # before torchtitan is imported: it fixes device_type at import

import os  # noqa: E402

import torch  # noqa: E402
from torchtitan.config import ConfigManager, JobConfig  # noqa: E402
from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

import boost_titan.specs  # noqa: E402,F401  (registers train specs and datasets)
from boost_titan import config as boost_config  # noqa: E402
from boost_titan.compile import check_compile_config  # noqa: E402
from boost_titan.pipeline import check_pipeline_config, pipeline_forward_backward  # noqa: E402


class BoostTrainer(Trainer):
    """torchtitan's Trainer, with two changes:

    * pipeline steps divide each microbatch loss by the step's token count before
      backward (``boost_titan.pipeline``), so PP gradients equal non-PP gradients;
    * ``[boost] log_comm`` counts the collectives of the first forward/backward (count
      and bytes per op and phase, one block in detail), logs them, writes
      ``<dump_folder>/comm_stats.json`` and TensorBoard scalars."""

    _comm_logged = False

    def _forward_backward(self, input_dict, labels, global_valid_tokens):
        if not self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(input_dict, labels)
        return pipeline_forward_backward(self, inputs, labels, extra_inputs, extra_kwargs,
                                         global_valid_tokens)

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self._comm_logged or not self.job_config.boost.log_comm:
            return self._forward_backward(input_dict, labels, global_valid_tokens)
        from boost_titan.comm_stats import CommCounter

        with CommCounter() as counter:
            loss = self._forward_backward(input_dict, labels, global_valid_tokens)
        self._comm_logged = True
        report = counter.report()
        logger.info("Collectives of one forward/backward:\n" + counter.format())
        if torch.distributed.get_rank() == 0:
            import json

            os.makedirs(self.job_config.job.dump_folder, exist_ok=True)
            with open(os.path.join(self.job_config.job.dump_folder, "comm_stats.json"), "w") as f:
                json.dump(report, f, indent=2)
        self.metrics_processor.logger.log(
            {f"comm/{k}": v for k, v in report["totals"].items()}, step=self.step
        )
        return loss


def config_class():
    return ConfigManager._merge_configs(JobConfig, boost_config.JobConfig)


def parse_config(args: list[str]):
    config = ConfigManager(config_cls=config_class()).parse_args(args)
    check_config(config)
    return config


def check_config(config) -> None:
    """Fail early, with the valid choices: [boost] values, selective AC option, model
    name and flavor, pipeline split and microbatching."""
    from torchtitan.models import _supported_models
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


def main(argv: list[str] | None = None) -> None:
    import sys

    init_logger()
    config = parse_config(sys.argv[1:] if argv is None else argv)
    trainer = None
    try:
        trainer = BoostTrainer(config)
        if config.checkpoint.create_seed_checkpoint:
            if int(os.environ.get("WORLD_SIZE", "1")) != 1:
                raise ValueError("create a seed checkpoint with a single process (NGPU=1)")
            trainer.checkpointer.save(curr_step=0, last_step=True)
            logger.info("Created seed checkpoint")
        else:
            trainer.train()
    except Exception:
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")


if __name__ == "__main__":
    main()
    if cpu_runtime.is_active():  # gloo's threads must not meet interpreter shutdown
        cpu_runtime.exit_after_clean_shutdown()
