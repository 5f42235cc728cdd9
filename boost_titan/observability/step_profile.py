"""Per-step profiling scalars: where a training step's time goes, in every run.

One step in every ``[boost] profile_freq`` (step 2, then every ``profile_freq``-th step)
runs under ``torch.profiler`` (CPU ops with their shapes, plus device kernels on GPUs; no
stacks, no memory). The trainer marks each forward/backward call with a
``boost/forward_backward`` range (device-synchronised at both ends on profiled steps);
autograd's ``autograd::engine::evaluate_function`` events tell backward from forward.
On GPUs the host queues kernels ahead of the device, so that boundary is taken on the
device's side: when the device has finished the kernels launched before the host's
first backward op.
From the events, written to TensorBoard at that step and printed on the console:

============================  =================================================================
tag                           what
============================  =================================================================
time/step_ms                  the profiled step, wall (profiler on)
time/forward_ms               forward (+ loss) of all microbatches
time/backward_ms              backward of all microbatches
time/optimizer_ms             after the last backward: grad clipping, optimizer, logging
tp/comm_forward_ms            time in tensor-parallel collectives during forward
tp/comm_backward_ms           ... during backward
tp/compute_forward_ms         forward minus its TP collectives (same for backward)
tp/comm_share_pct            TP collective time / step time, %
tp/bytes_MiB                  TP volume of the forward/backward, all-reduce-equivalent
tp/collectives                TP collectives issued by the forward/backward
comm/other_ms                 every other collective of the step (FSDP, PP send/recv, grad norm)
comm/exposed_ms               collective time not overlapped by compute
time/profiler_overhead_ms     what profiling added after the step: kineto's stop, the analysis
throughput/hfu_pct            hardware FLOPs utilisation, % (every logged step, beside MFU)
============================  =================================================================

"TP collectives" are the functional collectives (``_c10d_functional::*``, which DTensor
and every plan's ``LatentComm`` issue) inside the forward/backward; FSDP2 and pipeline
send/recv go through ``c10d::*`` directly and count as ``comm/other``.

Collective *time* depends on the device. On CPU (gloo) a collective blocks the calling
thread while gloo's threads move the data, so its time is the calling thread's time
inside collective ops and their waits, all of it exposed. On GPUs it is the NCCL kernels'
time on the device, and the exposed part is the NCCL kernel time not covered by any
other kernel.

HFU counts the FLOPs the hardware executes, where MFU counts the model's (``6 N +
attention`` per token): activation recomputation, work every TP rank repeats, and
attention's backward recomputation of the scores count here. The profiled step's
matmuls are counted by the profiler at the shapes they ran with (``with_flops``: local
shards, compiled graphs' extern matmuls included) and its attention kernels by
``torch.utils.flop_counter``'s formulas (:func:`executed_flops`). Every logged step then
writes the HFU: MFU's formula (same tokens, same time window) on the executed FLOPs
per token of the latest profiled step.
"""

from __future__ import annotations

import contextlib
import gc
import time

import torch

from boost_titan.observability.profile_events import (
    MIB,
    STEP,
    WINDOW,
    Event,
    StepEvents,
    collect,
    from_kineto,
    host_tree,
    length,
    minus,
    overlap,
    summary,
)

FIRST_PROFILED_STEP = 2

# tag -> one-line meaning; the dashboard's charts and the tests read these names
TAGS = (
    "time/step_ms",
    "time/forward_ms",
    "time/backward_ms",
    "time/optimizer_ms",
    "tp/comm_forward_ms",
    "tp/comm_backward_ms",
    "tp/compute_forward_ms",
    "tp/compute_backward_ms",
    "tp/comm_share_pct",
    "tp/bytes_MiB",
    "tp/collectives",
    "comm/other_ms",
    "comm/exposed_ms",
    "time/profiler_overhead_ms",
)
OVERHEAD_TAG = "time/profiler_overhead_ms"  # the profiler's stop and this module's analysis
HFU_TAG = "throughput/hfu_pct"
SUMMARY_TAG = "profile/summary"  # TensorBoard TEXT: :func:`summary` of each profiled step


def scalars(ev: StepEvents, device: bool, interleaved: bool = False) -> dict[str, float]:
    """The per-step scalars (``TAGS``) of one profiled step, in ms.

    A forward/backward call is forward until its first backward op, backward after
    (device-synchronised ends; on GPU the boundary is on the device's side, see
    :func:`collect`, so a GPU's queued work lands in the right phase).
    ``interleaved`` (pipeline schedules, whose microbatches alternate forward and
    backward): backward is the time inside autograd's ops, forward the rest."""
    ms = 1e-3
    step = (ev.step[1] - ev.step[0]) * ms
    fb = sum(w[1] - w[0] for w in ev.windows) * ms
    if interleaved:
        backward = overlap(ev.backward, ev.windows) * ms
        forward = fb - backward
    else:
        forward = sum(b - w[0] for w, b in zip(ev.windows, ev.backward_starts)) * ms
        backward = fb - forward
    optimizer = (ev.step[1] - ev.windows[-1][1]) * ms if ev.windows else 0.0
    tp_f = length(ev.tp["forward"]) * ms
    tp_b = length(ev.tp["backward"]) * ms
    comm = ev.tp["forward"] + ev.tp["backward"] + ev.other
    exposed = minus(comm, ev.compute) * ms if device else length(comm) * ms
    return {
        "time/step_ms": step,
        "time/forward_ms": forward,
        "time/backward_ms": backward,
        "time/optimizer_ms": optimizer,
        "tp/comm_forward_ms": tp_f,
        "tp/comm_backward_ms": tp_b,
        "tp/compute_forward_ms": forward - tp_f,
        "tp/compute_backward_ms": backward - tp_b,
        "tp/comm_share_pct": 100 * (tp_f + tp_b) / step if step else 0.0,
        "tp/bytes_MiB": ev.tp_volume / MIB,
        "tp/collectives": float(ev.tp_count),
        "comm/other_ms": length(ev.other) * ms,
        "comm/exposed_ms": exposed,
    }


def console_line(step: int, s: dict[str, float]) -> str:
    return (
        f"profile step {step}: {s['time/step_ms']:.0f} ms = forward {s['time/forward_ms']:.0f} "
        f"(TP comm {s['tp/comm_forward_ms']:.0f}) + backward {s['time/backward_ms']:.0f} "
        f"(TP comm {s['tp/comm_backward_ms']:.0f}) + optimizer {s['time/optimizer_ms']:.0f}; "
        f"TP {s['tp/collectives']:.0f} collectives, {s['tp/bytes_MiB']:.1f} MiB "
        f"(all-reduce-equivalent), {s['tp/comm_share_pct']:.1f}% of the step; other comm "
        f"{s['comm/other_ms']:.0f} ms; exposed comm {s['comm/exposed_ms']:.0f} ms"
    )


def analyze(
    raw: list[Event], device: bool, interleaved: bool = False
) -> tuple[StepEvents, str, dict[str, float]]:
    """What a profiled step computes from its events, once the profiler has stopped:
    (:func:`collect`'s events, :func:`summary`, :func:`scalars`)."""
    with _gc_paused():
        tree = host_tree(raw)
        events = collect(raw, device, tree)
        return events, summary(raw, tree=tree), scalars(events, device, interleaved)


@contextlib.contextmanager
def _gc_paused():
    """The analysis allocates a few objects per event (~10^5 in a large step) and frees
    them all at its end: the collector's full passes over the whole process that the
    allocations would trigger find nothing to free and cost more than the analysis."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---------------------------------------------------------------- the trainer's side
def _sync(device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.synchronize()


class StepProfiler:
    """Decides which steps are profiled, profiles them, turns them into scalars."""

    def __init__(
        self, freq: int, device_type: str, interleaved: bool = False, profiling_config=None
    ) -> None:
        self.freq = freq
        self._titan_schedule = None
        if profiling_config is not None and profiling_config.enable_profiling:
            # torchtitan's [profiling] schedule (torchtitan/tools/profiling.py)
            warmup, active = profiling_config.profiler_warmup, profiling_config.profiler_active
            self._titan_schedule = torch.profiler.schedule(
                wait=profiling_config.profile_freq - (warmup + active),
                warmup=warmup,
                active=active,
            )
        self.device_type = device_type
        self.interleaved = interleaved  # pipeline schedules (see :func:`scalars`)
        self.flops_per_step = 0.0  # executed FLOPs of the latest profiled step, this rank
        self.last_summary = ""  # markdown of the latest profiled step (:func:`summary`)
        self._active = False

    def wants(self, step: int) -> bool:
        # not step 1: it compiles and fills DTensor's sharding cache, whose meta-tensor
        # runs of each op the profiler records as ops
        if not self.freq or not (step == FIRST_PROFILED_STEP or step % self.freq == 0):
            return False
        # kineto allows one session at a time: steps on which torchtitan's [profiling]
        # profiler warms up or records (its step counter is the step before) are not
        # sampled here; nor is a step under any other running profiler.
        if self._titan_schedule is not None:
            if self._titan_schedule(step - 1) != torch.profiler.ProfilerAction.NONE:
                return False
        return not torch.autograd.profiler._is_profiler_enabled

    @contextlib.contextmanager
    def profile(self):
        """Profile the step inside; yields a dict filled with the scalars on exit."""
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU]
        device = self.device_type == "cuda"
        if device:
            activities.append(ProfilerActivity.CUDA)
        result: dict[str, float] = {}
        _sync(self.device_type)
        with profile(activities=activities, record_shapes=True, with_flops=True) as prof:
            self._active = True
            try:
                with record_function(STEP):
                    yield result
                    _sync(self.device_type)
            finally:
                self._active = False
                stop = time.perf_counter()
        events, self.last_summary, step_scalars = analyze(
            from_kineto(prof), device, self.interleaved
        )
        self.flops_per_step = events.flops
        result.update(step_scalars)
        result[OVERHEAD_TAG] = (time.perf_counter() - stop) * 1e3

    @contextlib.contextmanager
    def forward_backward(self):
        """Around each forward/backward call: a marked range on profiled steps only."""
        if not self._active:
            yield
            return
        from torch.profiler import record_function

        _sync(self.device_type)
        with record_function(WINDOW):
            yield
            _sync(self.device_type)


# ---------------------------------------------------------------- [profiling] traces
TRACE_SUFFIX = ".pt.trace.json"  # what TensorBoard's PyTorch profiler plugin looks for


@contextlib.contextmanager
def maybe_enable_profiling(profiling_config, *, global_step=0, base_folder="", leaf_folder=""):
    """torchtitan's ``[profiling]`` profiler, its traces written as
    ``<save_traces_folder>/iteration_N/rank<r>.pt.trace.json``: the name
    torch-tb-profiler finds under ``tensorboard --logdir <dump_folder>`` (one run per
    iteration, one worker per rank); chrome://tracing and Perfetto open it too."""
    import os

    from torchtitan.tools import profiling

    with profiling.maybe_enable_profiling(
        profiling_config, global_step=global_step, base_folder=base_folder, leaf_folder=leaf_folder
    ) as prof:
        if prof is not None:
            folder = os.path.join(base_folder, profiling_config.save_traces_folder)
            rank = torch.distributed.get_rank()

            def write_trace(p) -> None:
                out = os.path.join(folder, f"iteration_{p.step_num}", leaf_folder)
                os.makedirs(out, exist_ok=True)
                p.export_chrome_trace(os.path.join(out, f"rank{rank}{TRACE_SUFFIX}"))

            prof.on_trace_ready = write_trace
        yield prof
