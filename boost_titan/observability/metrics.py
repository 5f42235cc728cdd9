"""torchtitan's MetricsProcessor, with every pipeline rank logging the true loss.

Under PP only the rank holding the last stage computes the loss; torchtitan's trainer
logs ``-1`` on every other rank and its validator ``-1 / tokens``, and the console
shows rank 0 (``LOG_RANK``), which holds the first stage: ``loss: -1.00000``. Here the
last stage's figures are handed to every pipeline rank just before they are printed or
written: one all-reduce of two float64 scalars over the PP mesh per logged step (and
one per validation), the other ranks contributing zeros, so the result is the last
stage's value exactly. The gradient norm needs nothing: ``clip_grad_norm_`` already
reduces it over the PP mesh.

On CPU, MFU's peak is no datasheet figure but an estimate (:func:`cpu_peak`), kept an
upper bound of every rate the run logs, so no MFU or HFU above 100% is printed.

It adds the HFU (``throughput/hfu_pct``) beside torchtitan's ``mfu(%)`` once the
trainer has counted the executed FLOPs (:mod:`boost_titan.observability.step_profile`),
writes the BOOST
dashboard (``boost_titan.observability.dashboard``) into the run's TensorBoard event file, once, on
the rank(s) that write TensorBoard, and writes every scalar whose tag has parentheses a
second time under the dashboard's paren-free alias (``dashboard.AliasingLogger``).

Each run writes TensorBoard events under ``<dump_folder>/tb/<YYYYmmdd-HHMMSS>-<6 hex>``
(:func:`run_folder_name`): torchtitan names the folder to the minute, so two runs
started in the same minute (a restart, a sweep) became one TensorBoard run.
"""

from __future__ import annotations

import time
import uuid
from datetime import datetime

import torch
import torchtitan.components.metrics as titan_metrics
from torch.distributed.device_mesh import DeviceMesh
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools import utils
from torchtitan.tools.logging import logger

from boost_titan.observability.step_profile import HFU_TAG


def cpu_peak(estimate: float, achieved: float) -> float:
    """A CPU's peak FLOP/s, MFU's base: the highest rate seen in this process.

    A GPU has a datasheet peak that no kernel exceeds; a CPU has none that torch can look
    up. Its peak is taken to be the best rate observed: the start-up estimate (the best
    fp32 matmul of a short measurement, or ``[boost] cpu_peak_flops`` / the
    ``BOOST_CPU_PEAK_FLOPS`` environment variable), raised to any achieved rate above it.
    The start-up measurement is only a lower bound of the machine's peak: on a machine
    busy with other jobs (or the run's other ranks starting) it catches a slow moment,
    and a bf16 or fused kernel can outrun an fp32 matmul; MFU against it read 259-271%.
    With the raise, MFU and HFU are at most 100%, and 100% means "as fast as anything
    measured here", not the hardware's limit."""
    return max(estimate, achieved)


class BoostMetricsProcessor(MetricsProcessor):
    _pp_mesh: DeviceMesh | None = None
    _has_last_stage = True
    _across_groups = None  # torchft replica groups: (avg, max) -> the job's (avg, max)
    executed_flops_per_token: float | None = None  # set by the trainer's profiled steps
    # None: gpu_peak_flops is a datasheet figure; else what the CPU estimate is (cpu_peak)
    cpu_peak_source: str | None = None
    _cpu_peak_raised = False

    def __init__(self, job_config, parallel_dims, tag=None):
        # torchtitan names the run folder datetime.now().strftime("%Y%m%d-%H%M")
        titan_metrics.datetime = _Stamp(run_folder_name())
        try:
            super().__init__(job_config, parallel_dims, tag)
        finally:
            titan_metrics.datetime = datetime
        from boost_titan.observability import dashboard

        self.logger = dashboard.AliasingLogger(self.logger)
        dashboard.write_layout(self.logger, job_config)

    def share_pipeline_loss(self, pp_mesh: DeviceMesh, has_last_stage: bool) -> None:
        """Called by the trainer once the stages are placed."""
        self._pp_mesh, self._has_last_stage = pp_mesh, has_last_stage

    def _last_stage(self, *values: float) -> list[float]:
        if self._pp_mesh is None:
            return list(values)
        mine = [float(v) for v in values] if self._has_last_stage else [0.0] * len(values)
        t = torch.tensor(mine, dtype=torch.float64, device=utils.device_type)
        torch.distributed.all_reduce(t, group=self._pp_mesh.get_group())
        return t.tolist()

    def share_replica_loss(self, across_groups) -> None:
        """torchft replica groups: ``across_groups(avg, max)`` is the job's loss (the
        groups' average and largest), logged by every group alike."""
        self._across_groups = across_groups

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        global_avg_loss, global_max_loss = self._last_stage(global_avg_loss, global_max_loss)
        if self._across_groups is not None:
            global_avg_loss, global_max_loss = self._across_groups(global_avg_loss, global_max_loss)
        if self.cpu_peak_source is not None:
            self._keep_cpu_peak_an_upper_bound(step)
        if self.executed_flops_per_token is not None:
            extra_metrics = {**(extra_metrics or {}), HFU_TAG: self._hfu()}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    def achieved_flops(self) -> float:
        """FLOP/s per device since the last log, on MFU's footing (torchtitan's tokens
        and time window): the model's FLOPs, or the executed ones where counted, the
        larger."""
        elapsed = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (elapsed * self.parallel_dims.non_data_parallel_size)
        return tps * max(self.num_flops_per_token, self.executed_flops_per_token or 0.0)

    def _keep_cpu_peak_an_upper_bound(self, step: int) -> None:
        """:func:`cpu_peak`. MFU and HFU are computed after this, over a window a little
        longer, so at most 100%."""
        achieved = self.achieved_flops()
        peak = cpu_peak(self.gpu_peak_flops, achieved)
        if peak == self.gpu_peak_flops:
            return
        said = f"{achieved:.3e} FLOP/s per device achieved at step {step}"
        if self._cpu_peak_raised:  # the warning said it once
            logger.info(f"CPU peak for MFU raised to {said}")
        else:
            logger.warning(
                f"{said}, above the CPU peak estimate {self.gpu_peak_flops:.3e} "
                f"({self.cpu_peak_source}); MFU's peak is now the highest rate the run "
                "achieves (a CPU's peak: the highest rate seen)"
            )
        self.gpu_peak_flops, self.cpu_peak_source, self._cpu_peak_raised = peak, said, True

    def _hfu(self) -> float:
        """torchtitan's MFU formula (same tokens, same time window) on executed FLOPs."""
        elapsed = time.perf_counter() - self.time_last_log
        tps = self.ntokens_since_last_log / (elapsed * self.parallel_dims.non_data_parallel_size)
        return 100 * self.executed_flops_per_token * tps / self.gpu_peak_flops

    def log_validation(self, loss, step, extra_metrics=None):
        (loss,) = self._last_stage(loss)
        super().log_validation(loss, step, extra_metrics)


def run_folder_name() -> str:
    """``YYYYmmdd-HHMMSS-<6 hex>``: unique per run, and the same on every rank (rank 0's,
    broadcast: ranks reach this at different moments, and with ``save_for_all_ranks``
    each writes ``<run>/rank_<r>``)."""
    name = [f"{datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    return name[0]


class _Stamp:
    """Stands in for ``datetime`` in torchtitan's metrics module while it names the run."""

    def __init__(self, name: str):
        self.name = name

    def now(self) -> _Stamp:
        return self

    def strftime(self, fmt: str) -> str:
        return self.name
