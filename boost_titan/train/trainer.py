"""The trainer: torchtitan's ``Trainer`` with boost_titan's run behaviour, and
:func:`main`, what ``torchrun ... -m boost_titan.train --job.config_file X.toml`` runs.

Behaves exactly like ``torchtitan.train`` (same Trainer, same TOML and CLI), plus:
CPU/gloo support when no GPU is visible, boost_titan's train specs and datasets, the
``[boost]`` config section, and what :func:`install` puts into torchtitan's and DCP's
code (the one place a training process patches anything; :func:`main` calls it).

Import this module after ``cpu_runtime.activate()`` (``boost_titan.train``'s
``__main__`` does): torchtitan fixes its device type when it is first imported.
"""

from __future__ import annotations

import os
import time

import torch
import torchtitan.train
from torchtitan.distributed import utils as titan_dist_utils
from torchtitan.tools.logging import init_logger, logger
from torchtitan.train import Trainer

from boost_titan.checkpoint import integrity, safe_metadata
from boost_titan.checkpoint import lock as checkpoint_lock
from boost_titan.checkpoint import manager as checkpoint_manager
from boost_titan.checkpoint import save as checkpoint_save
from boost_titan.checkpoint.data_position import DataResumeError
from boost_titan.checkpoint.hf import adapters as hf_adapters
from boost_titan.data.local_text import CorpusError
from boost_titan.observability import comm_traces, dashboard, log_filters
from boost_titan.observability.step_profile import (
    SUMMARY_TAG,
    StepProfiler,
    console_line,
    maybe_enable_profiling,
)
from boost_titan.parallel import cpu_runtime
from boost_titan.parallel.pipeline import pipeline_forward_backward
from boost_titan.train import fault, launch_check, replicas, specs


def _pp_loss_is_visible(*args, **kwargs) -> None:
    """torchtitan warns in red "Pipeline Parallel loss is not visible. Please add rank N
    to LOG_RANK" unless LOG_RANK names the last stage's first rank. Here every pipeline
    rank logs the last stage's loss (``boost_titan.observability.metrics``): rank 0's
    console shows the true loss, so the warning is wrong and nothing replaces it."""


def install() -> None:
    """Everything a training process changes in torchtitan and DCP (idempotent)."""
    # no-op when `python -m boost_titan.train` activated it first, as it must; on a CPU
    # machine where torchtitan was imported before, a clear error instead of CUDA calls
    cpu_runtime.activate()
    # boost_titan's models and datasets, by name, for the TOML's [model] / [training]
    specs.register_all()
    # every checkpoint this process loads (resume, initial_load_path) has its .metadata
    # unpickled with an allowlist: a crafted checkpoint cannot run code
    safe_metadata.install()
    # every checkpoint it saves is sealed and every one it loads verified first and as read
    integrity.install()
    # Hugging Face saves (last_save_in_hf) write {"format": "pt"} safetensors metadata
    hf_adapters.install()
    # the log names the checkpoint loaded (or none); runs end with keep_latest_k steps
    checkpoint_manager.install()
    # [profiling] traces named for TensorBoard's profiler plugin (Trainer.train opens it)
    torchtitan.train.maybe_enable_profiling = maybe_enable_profiling
    torchtitan.train.ensure_pp_loss_visible = _pp_loss_is_visible
    # the train step's total gradient norm also goes to the NaN guard, which then judges
    # the gradients without a pass over them of its own (boost_titan.train.fault)
    titan_dist_utils.clip_grad_norm_ = fault.reporting_grad_norm(titan_dist_utils.clip_grad_norm_)


#: between two attempts at a step the replica groups did not commit
RETRY_PAUSE_S = 0.5


class _NoSleep:
    """``time`` as torchtitan.train sees it during training: its only sleep is the
    one after the last step (see :meth:`BoostTrainer.train`)."""

    perf_counter = staticmethod(time.perf_counter)

    @staticmethod
    def sleep(seconds: float) -> None:
        pass


class BoostTrainer(Trainer):
    """torchtitan's Trainer, with these changes:

    * pipeline steps divide each microbatch loss by the step's token count before
      backward (``boost_titan.parallel.pipeline``), so PP gradients equal non-PP gradients, and
      every PP rank logs the last stage's loss (``boost_titan.observability.metrics``);
    * ``[boost] log_comm`` counts the collectives of the first forward/backward (count
      and bytes per op and phase, one block in detail), logs them, writes
      ``<dump_folder>/comm_stats.json`` and TensorBoard scalars;
    * ``[boost] profile_freq``: step 2 and every k-th step run under torch.profiler
      and write where their time went (``boost_titan.observability.step_profile``): time/, tp/ and
      comm/ scalars and a text summary (collectives per block, top ops) in
      TensorBoard, one console line, and HFU beside MFU;
    * faults (``boost_titan.train.fault``): a non-finite step is never applied
      (``[boost] nan_policy``), SIGTERM saves a checkpoint of the current step and ends
      the run cleanly (async saves waited for), cut-off checkpoints are set aside before
      resuming, damaged newer steps (``boost_titan.checkpoint.integrity``) are set aside
      and the newest one that opens loaded on every rank, a damaged or refused checkpoint
      the user named ends the run on its line (exit 1, ``trainer.close()`` run), a save
      that fails on the disk ends the run on one line
      (``boost_titan.checkpoint.save``), and
      ``BOOST_TITAN_INJECT`` injects faults to rehearse all of this;

    * a checkpoint of another data-parallel degree resumes exactly: training data is one
      order of windows of tokenized corpora (``boost_titan.data.order``) with one saved
      position for all ranks,
      checked before DCP reads it (``boost_titan.checkpoint.data_position``)."""

    _comm_logged = False
    _last_run_step = -1  # the last step this process trained (fault injection fires after it)
    replicas: replicas.ReplicaGroups | None = None  # [fault_tolerance]: torchft's groups
    _microbatches = 0  # backward passes of the current step so far

    def init_distributed(self):
        parallel_dims = super().init_distributed()
        # before the checkpointer is built: only replica group 0 writes checkpoints
        self.replicas = replicas.build(
            self.job_config,
            group_rank=torch.distributed.get_rank(),
            group_world_size=torch.distributed.get_world_size(),
        )
        return parallel_dims

    def __init__(self, job_config):
        super().__init__(job_config)
        if self.replicas is not None:
            self.replicas.attach(self)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.injector = fault.FaultInjector(os.environ.get(fault.INJECT_ENV, ""), rank)
        self.preemption = fault.Preemption() if self.checkpointer.enable else None
        # corrupted newest step, full disk, another dp degree: boost_titan.checkpoint.manager
        self.checkpointer.attach(self, self.injector)
        boost = job_config.boost
        self.guard = fault.StepGuard(
            self, boost.nan_policy, boost.nan_max_consecutive_skips, self.preemption
        )
        from torchtitan.tools import utils

        self.step_profiler = StepProfiler(
            boost.profile_freq,
            utils.device_type,
            interleaved=self.parallel_dims.pp_enabled,
            profiling_config=job_config.profiling,
        )
        if self.parallel_dims.pp_enabled:  # every PP rank logs the last stage's loss
            self.metrics_processor.share_pipeline_loss(
                self.parallel_dims.get_mesh("pp"), self.pp_has_last_stage
            )

    def train(self):
        ckpt = self.checkpointer
        if ckpt.enable and ckpt.writes and torch.distributed.get_rank() == 0:
            for old, new in fault.quarantine_incomplete_checkpoints(self.checkpointer.folder):
                logger.warning(
                    f"checkpoint {old} is incomplete (no .metadata: its save was cut off) and "
                    f"will not be loaded; moved to {new}"
                )
        # torchtitan's Trainer.train ends with rank 0 sleeping 2 s "for other ranks to
        # complete" (rank 0 hosts the store the others still use to shut down): a
        # barrier waits exactly as long as that takes
        torchtitan.train.time = _NoSleep
        try:
            super().train()
        except BaseException as e:
            # a refused or damaged checkpoint ends the run on its own line, not on DCP's
            # per-rank report
            refused = safe_metadata.refusal_in(e) or integrity.mismatch_in(e)
            if refused is None or refused is e:
                raise
            raise refused from None
        finally:
            torchtitan.train.time = time
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def train_step(self, data_iterator):
        self._microbatches = 0
        if self.replicas is not None:
            self.replicas.step_started(self)
        with fault.grad_norms_to(self.guard):
            if self.step_profiler.wants(self.step):
                self._profiled_train_step(data_iterator)
            else:
                super().train_step(data_iterator)
        if self.replicas is not None:
            self._until_committed(data_iterator)
            # (semi-sync: every sync_steps steps, a sync)
            self.replicas.step_finished(self.step, self.metrics_processor.logger)
        self._last_run_step = self.step

    def _until_committed(self, data_iterator) -> None:
        """A step the replica groups did not commit (too few live groups, a group died
        during it) is run again on the same batch, until it is: the step count stays the
        count of applied steps, and no window is skipped."""
        tokens = self.ntokens_seen
        while not self.replicas.committed:
            time.sleep(RETRY_PAUSE_S)  # (a group relaunching takes seconds)
            self.ntokens_seen = tokens - self._step_tokens()
            self.replicas.retry_from(self.dataloader)
            self._microbatches = 0
            super().train_step(data_iterator)
        self.replicas.digest(self.model_parts, self.optimizers, self.step)

    def _step_tokens(self) -> int:
        t = self.job_config.training
        return t.local_batch_size * t.seq_len * self.gradient_accumulation_steps

    def _profiled_train_step(self, data_iterator):
        tokens_before = self.ntokens_seen
        with self.step_profiler.profile() as scalars:
            super().train_step(data_iterator)
        # executed FLOPs per token on MFU's footing (per device of one model replica)
        tokens = max(self.ntokens_seen - tokens_before, 1)
        self.metrics_processor.executed_flops_per_token = (
            self.step_profiler.flops_per_step * self.parallel_dims.non_data_parallel_size / tokens
        )
        self.metrics_processor.logger.log(scalars, step=self.step)
        dashboard.write_text(
            self.metrics_processor.logger, SUMMARY_TAG, self.step_profiler.last_summary, self.step
        )
        logger.info(console_line(self.step, scalars))

    def should_continue_training(self) -> bool:
        if self._last_run_step == self.step:
            self.injector.after_step(self.step)
        if not super().should_continue_training():
            return False
        if self.guard.preempt_agreed:
            self._save_for_preemption()
            return False
        return True

    def close(self) -> None:
        super().close()
        if self.replicas is not None:
            self.replicas.shutdown()

    def _save_for_preemption(self) -> None:
        """A full checkpoint of this step, on disk before the status file says so: an
        async save in flight (``[checkpoint] async_mode``) is waited for first (an
        interval save of this very step is not saved again), and the preemption save
        is waited for before the process group ends. Whether this step is already
        saved is rank 0's reading, broadcast (ranks must agree on a collective save)."""
        ckpt = self.checkpointer
        path = ckpt._create_checkpoint_id(self.step)
        ckpt._async_wait()
        saved = [os.path.isfile(os.path.join(path, ".metadata"))]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(saved, src=0)
        if not saved[0]:
            interval, ckpt.interval = ckpt.interval, 1  # a full (not last-step) save, now
            try:
                ckpt.save(self.step)
            finally:
                ckpt.interval = interval
            ckpt._async_wait()
        logger.warning(
            f"Preempted (SIGTERM): checkpoint of step {self.step} at {path}; "
            "run the same command again to resume from it"
        )
        status_file = os.environ.get(fault.STATUS_FILE_ENV)
        distributed = torch.distributed.is_initialized()
        if status_file and (not distributed or torch.distributed.get_rank() == 0):
            with open(status_file, "w") as f:
                f.write(f"preempted step={self.step} checkpoint={path}\n")

    def _forward_backward(self, input_dict, labels, global_valid_tokens):
        global_valid_tokens = self.injector.poison_loss_scale(self.step, global_valid_tokens)
        with self.step_profiler.forward_backward():
            loss = self._forward_backward_impl(input_dict, labels, global_valid_tokens)
        self.injector.poison_grads(self.step, self.model_parts)
        self.guard.record_loss(loss)
        self._microbatches += 1
        if self.replicas is not None and self._microbatches == self.gradient_accumulation_steps:
            # the step's last backward: the cross-group all-reduce, before clipping
            self.replicas.last_backward_done(self.model_parts)
        return loss

    def _forward_backward_impl(self, input_dict, labels, global_valid_tokens):
        if not self.parallel_dims.pp_enabled:
            return super().forward_backward_step(
                input_dict=input_dict, labels=labels, global_valid_tokens=global_valid_tokens
            )
        inputs, labels, extra_inputs, extra_kwargs = self.post_dataloading_process(
            input_dict, labels
        )
        return pipeline_forward_backward(
            self, inputs, labels, extra_inputs, extra_kwargs, global_valid_tokens
        )

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens):
        if self._comm_logged or not self.job_config.boost.log_comm:
            return self._forward_backward(input_dict, labels, global_valid_tokens)
        from boost_titan.observability.comm_stats import CommCounter

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
    install()
    log_filters.install_for_training()  # wrong or irrelevant warnings on our paths
    # a config error: one line, exit 2, no traceback (as run_train.sh's pre-check)
    config = launch_check.parse_or_exit(sys.argv[1:] if argv is None else argv)
    if "LOCAL_RANK" not in os.environ:
        raise RuntimeError(
            "boost_titan.train runs under torchrun: launch it with `NGPU=1 ./run_train.sh "
            "--job.config_file X.toml` (or `torchrun --nproc_per_node=N -m boost_titan.train ...`)"
        )
    fault.clear_failure()  # (a line from an earlier attempt of a restarted run)
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
    except (checkpoint_save.CheckpointSaveError, checkpoint_lock.FolderRefused) as e:
        # a failed save, a checkpoint folder another run holds: the whole story on one
        # line; a SystemExit(1): no traceback
        logger.error(e.line)
        fault.report_failure(e.line)
        if trainer:
            trainer.close()
        if cpu_runtime.is_active():  # no gloo teardown at interpreter exit (as a finished run)
            cpu_runtime.exit_after_clean_shutdown(1)
        raise
    except (integrity.ChecksumMismatch, safe_metadata.UntrustedCheckpointError, CorpusError) as e:
        # a damaged or refused checkpoint, data that cannot be read as asked (every rank
        # raises it: boost_titan.data.loader.agree): its one line, exit 1, no traceback
        logger.error(str(e))
        fault.report_failure(str(e))
        if trainer:
            trainer.close()
        if cpu_runtime.is_active():
            cpu_runtime.exit_after_clean_shutdown(1)
        raise SystemExit(1) from None
    except BaseException as e:  # a refusal raised as SystemExit (data_position) closes too
        if isinstance(e, DataResumeError):
            fault.report_failure(str(e))
        if trainer:
            trainer.close()
        raise
    else:
        trainer.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        logger.info("Process group destroyed")
        comm_traces.remove_if_empty(config)  # every rank is past its last collective
