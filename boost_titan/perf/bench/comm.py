"""Collectives of a variant's step, counted and timed in instrumented (untimed) steps.

Eager variants go through ``boost_titan.observability.comm_stats``' dispatch-mode hook:
one step under
``CommCounter`` counts collectives and bytes, then ``--comm-steps`` steps time them (on
CPU under ``CollectiveHook(timed=True)``: the same hook, timing only, so no module tracking
slows those steps). Compiled variants refuse dispatch modes: torch.profiler counts and times
their functional collectives, named as ``comm_stats`` names them.

Collective *time* depends on the device. On CPU (gloo) a collective blocks the calling
thread, so its time is the host's wall time in collectives and their waits. On GPUs
(NCCL) a collective and its wait only enqueue work and return at once: the time is the
NCCL kernels' time on the device (:func:`device_comm_seconds`), from torch.profiler's
CUDA activity in the timed steps, eager and compiled alike.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from boost_titan.observability.comm_stats import (
    COLLECTIVES,
    CollectiveHook,
    CommCounter,
    allreduce_equivalent,
    profiled_bytes,
    profiler_op,
)
from boost_titan.observability.profile_events import length
from boost_titan.perf.bench.variants import sync, train_step


@dataclass
class CommMeasurement:
    collectives_per_step: int = 0
    bytes_per_step: int = 0  # raw payload, as counted
    volume_per_step: float = 0.0  # all-reduce-equivalent bytes (comm_stats.allreduce_equivalent)
    by_op: dict = field(default_factory=dict)  # op -> {"count", "bytes"} per step
    step_times: list[float] = field(
        default_factory=list
    )  # wall time of each timed instrumented step
    # time in collectives during it: host time in them and their waits (gloo), NCCL
    # kernel time on the device (GPU)
    comm_times: list[float] = field(default_factory=list)


def measure_comm(built, compiled: bool, comm_steps: int, tokens, labels, device) -> CommMeasurement:
    """Collectives per step and bytes (counted), and ``comm_steps`` steps with the time
    spent in collectives, of a built variant."""
    if compiled:
        return _profiled(built, comm_steps, tokens, labels, device)
    model, opt, _, loss_fn = built
    res = CommMeasurement()
    with CommCounter() as counter:
        train_step(model, opt, tokens, labels, loss_fn)
    res.collectives_per_step, res.bytes_per_step = counter.total()
    for r in counter.records:
        res.volume_per_step += r.volume
        _add(res.by_op, r.op, r.nbytes)
    if device.type == "cuda":
        for _ in range(comm_steps):
            step_s, kernels = _device_profiled_step(model, opt, tokens, labels, loss_fn, device)
            res.step_times.append(step_s)
            res.comm_times.append(device_comm_seconds(kernels))
        return res
    for _ in range(comm_steps):
        sync(device)
        timer = CollectiveHook(timed=True)
        t0 = time.perf_counter()
        with timer:
            train_step(model, opt, tokens, labels, loss_fn)
        sync(device)
        res.step_times.append(time.perf_counter() - t0)
        res.comm_times.append(timer.seconds)
    return res


def _profiled(built, comm_steps: int, tokens, labels, device) -> CommMeasurement:
    """Collectives of a compiled variant, counted and timed under torch.profiler:
    torch.compile refuses the dispatch mode (comm_stats.CollectiveHook) that
    counts and times the eager variants' collectives, but the compiled graphs' functional
    collectives still pass the dispatcher, where the profiler records them. Bytes as
    CommCounter counts them: the input, an all-gather's output."""
    from torch.profiler import ProfilerActivity, profile

    model, opt, _, loss_fn = built
    res = CommMeasurement()
    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    for i in range(max(comm_steps, 1)):  # the first profiled step also counts
        sync(device)
        with profile(activities=activities, record_shapes=True) as prof:
            t0 = time.perf_counter()
            train_step(model, opt, tokens, labels, loss_fn)
            sync(device)
            step_s = time.perf_counter() - t0
        events = [
            e
            for e in prof.events()
            if profiler_op(e.name) and not (e.cpu_parent and profiler_op(e.cpu_parent.name))
        ]
        collectives = [e for e in events if profiler_op(e.name).startswith(COLLECTIVES)]
        if i == 0:
            res.collectives_per_step = len(collectives)
            for e in collectives:
                op, nbytes = (
                    profiler_op(e.name),
                    profiled_bytes(e.name, e.input_shapes, e.input_dtypes, e.concrete_inputs),
                )
                res.bytes_per_step += nbytes
                res.volume_per_step += allreduce_equivalent(op, nbytes)
                _add(res.by_op, op, nbytes)
        if i < comm_steps:
            res.step_times.append(step_s)
            if device.type == "cuda":
                res.comm_times.append(device_comm_seconds(prof.profiler.kineto_results.events()))
            else:
                res.comm_times.append(sum(e.cpu_time_total for e in events) / 1e6)
    return res


def _device_profiled_step(model, opt, tokens, labels, loss_fn, device):
    """One training step under torch.profiler's CUDA activity (kernels only, no host
    ops): its wall time (s) and its kineto events."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        train_step(model, opt, tokens, labels, loss_fn)
        sync(device)
        step_s = time.perf_counter() - t0
    return step_s, prof.profiler.kineto_results.events()


def device_comm_seconds(kineto_events) -> float:
    """Seconds the device spent in NCCL kernels: the union of their spans, so kernels
    that overlap on several streams count once. Host events (a ``nccl:all_reduce``
    range, the runtime's launch calls) take no device time and are left out."""
    cpu = torch.autograd.DeviceType.CPU
    spans = [
        (e.start_ns(), e.end_ns())
        for e in kineto_events
        if e.device_type() != cpu and "nccl" in e.name().lower()
    ]
    return length(spans) / 1e9


def _add(by_op: dict, op: str, nbytes: int) -> None:
    row = by_op.setdefault(op, {"count": 0, "bytes": 0})
    row["count"] += 1
    row["bytes"] += nbytes
