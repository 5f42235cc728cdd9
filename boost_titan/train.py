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
from torchtitan.tools.logging import init_logger, logger  # noqa: E402
from torchtitan.train import Trainer  # noqa: E402

import boost_titan.specs  # noqa: E402,F401  (registers train specs and datasets)
from boost_titan.config_check import check_config, parse_config  # noqa: E402,F401
from boost_titan.pipeline import pipeline_forward_backward  # noqa: E402


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
