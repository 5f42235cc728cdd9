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

import bisect
import contextlib
import itertools
import re
import time
from dataclasses import dataclass, field

import torch

from boost_titan.comm_stats import COLLECTIVES, allreduce_equivalent, profiled_bytes, profiler_op

STEP = "boost/step"
WINDOW = "boost/forward_backward"
BACKWARD = "autograd::engine::evaluate_function"
TP_NAMESPACE = "_c10d_functional::"
OTHER_NAMESPACE = "c10d::"
MIB = 2**20
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


# ---------------------------------------------------------------- interval arithmetic
def union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted, non-overlapping intervals covering ``spans``."""
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(spans: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in union(spans))


def minus(spans, holes) -> float:
    """Length of ``spans`` not covered by ``holes``."""
    total = 0.0
    holes = union(holes)
    for s, e in union(spans):
        covered = sum(max(0.0, min(e, he) - max(s, hs)) for hs, he in holes)
        total += (e - s) - covered
    return total


# ---------------------------------------------------------------- events -> scalars
@dataclass
class Event:
    """One profiler event, as much of it as the scalars need (times in us)."""

    name: str
    start: float
    end: float
    thread: int = 0
    device: bool = False  # a device activity (kernel, memcpy, annotation), not a host op
    # host ops: their own id; device activities and runtime calls: the id of the host op
    # they were launched from (kineto's linked correlation id)
    correlation: int = 0
    shapes: list = field(default_factory=list)
    dtypes: list = field(default_factory=list)
    concrete: list = field(default_factory=list)
    annotation: bool = False
    flops: int = 0  # the profiler's count (matmuls only, with_flops=True)
    sequence_nr: int = -1  # autograd's: a forward op and its backward node share it
    # a device runtime/driver call on the host (cudaLaunchKernel), not an op: its own
    # correlation id comes from CUPTI's counter, not the ops', so it is never keyed on
    runtime: bool = False


RUNTIME = ("_runtime", "_driver")  # kineto's activity types cuda_runtime, cuda_driver, ...


def from_kineto(prof) -> list[Event]:
    """The raw kineto events of a finished ``torch.profiler.profile``. Much cheaper than
    ``prof.events()``, which builds a FunctionEvent tree (~0.1 ms per op)."""
    cpu = torch.autograd.DeviceType.CPU
    out = []
    for e in prof.profiler.kineto_results.events():
        if e.is_async():
            continue
        device = e.device_type() != cpu
        linked = e.linked_correlation_id()
        # CPU ops and record_function ranges have no linked id; the device runtime's
        # host calls link to the op they ran in, as torch's own parser tells them apart
        runtime = not device and (linked > 0 or e.activity_type().endswith(RUNTIME))
        out.append(
            Event(
                e.name(),
                e.start_ns() / 1e3,
                e.end_ns() / 1e3,
                e.start_thread_id(),
                device,
                linked if device or runtime else e.correlation_id(),
                e.shapes(),
                e.dtypes(),
                e.concrete_inputs(),
                e.is_user_annotation(),
                e.flops(),
                e.sequence_nr(),
                runtime,
            )
        )
    return out


MATMULS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _flops(e: Event) -> float | None:
    """FLOPs of a matmul or attention op, None for any other op."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if e.name in MATMULS:
        return e.flops
    if e.name.startswith("aten::_scaled_dot_product_") and "attention" in e.name:
        if e.name.endswith("_backward"):  # (grad_out, q, k, v, ...)
            return sdpa_backward_flop_count(*e.shapes[:4])
        return sdpa_flop_count(*e.shapes[:3])  # (q, k, v, ...)
    return None


def executed_flops(host: list[Event]) -> float:
    """Matmul and attention FLOPs of the host ops. The profiler counts matmuls at the
    shapes they ran with (recomputation included); attention kernels, which it does not
    count, get ``torch.utils.flop_counter``'s formulas (no causal discount, as MFU's
    model FLOPs; backward recomputes the scores). An op on DTensors is recorded twice,
    at the global shape and, inside it, at the local shard's: only innermost ops count."""
    total = 0.0
    for evs in _threads(host).values():
        stack: list[Event] = []
        wrappers: set[int] = set()
        counted = []
        for e in sorted(evs, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1].end <= e.start:
                stack.pop()
            if _flops(e) is not None:
                wrappers.update(id(a) for a in stack if _flops(a) is not None)
                counted.append(e)
            stack.append(e)
        total += sum(_flops(e) for e in counted if id(e) not in wrappers)
    return total


def _threads(host: list[Event]) -> dict[int, list[Event]]:
    by_thread: dict[int, list[Event]] = {}
    for e in host:
        by_thread.setdefault(e.thread, []).append(e)
    return by_thread


def _is_comm(name: str) -> bool:
    return name.startswith((TP_NAMESPACE, OTHER_NAMESPACE))


def _nesting(events: list[Event]) -> dict[int, tuple[Event | None, bool]]:
    """Per host event (by ``id``): its outermost enclosing collective op (itself if it is
    one and none encloses it) and whether it runs inside autograd's backward. Ranges of
    one thread nest; each thread is walked once with a stack."""
    out: dict[int, tuple[Event | None, bool]] = {}
    for evs in _threads([e for e in events if not e.device]).values():
        stack: list[tuple[float, Event | None, bool]] = []  # (end, owner, in_backward)
        for e in sorted(evs, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1][0] <= e.start:
                stack.pop()
            owner, in_bwd = (stack[-1][1], stack[-1][2]) if stack else (None, False)
            if owner is None and _is_comm(e.name):
                owner = e
            out[id(e)] = (owner, in_bwd)
            stack.append((e.end, owner, in_bwd or e.name.startswith(BACKWARD)))
    return out


@dataclass
class StepEvents:
    """The events of one profiled step that the scalars are computed from."""

    step: tuple[float, float]  # the whole train_step (us)
    windows: list[tuple[float, float]]  # boost/forward_backward ranges
    backward_starts: list[float]  # per window: its first autograd evaluate_function
    backward: list[tuple[float, float]]  # every outermost evaluate_function range
    # (both on the device's side on GPU: :func:`collect`)
    tp: dict[str, list[tuple[float, float]]]  # phase -> TP collective time spans
    other: list[tuple[float, float]]  # every other collective time span
    compute: list[tuple[float, float]]  # device kernels that are not collectives (GPU)
    tp_bytes: int = 0
    tp_volume: float = 0.0
    tp_count: int = 0
    flops: float = 0.0  # executed matmul + attention FLOPs of the step on this rank


def collect(events: list[Event], device: bool) -> StepEvents:
    """Sort a profiled step's events into :class:`StepEvents`.

    ``device`` (GPU): collective time from device kernels instead of host ops, and the
    backward's boundaries (``backward_starts``, ``backward``) moved to the device's side
    (:func:`_device_clock`): the host queues kernels ahead of the device, so the host's
    first backward op starts while the forward's kernels still run."""
    host = [e for e in events if not e.device]
    step = next(e for e in host if e.name == STEP)
    windows = sorted((e.start, e.end) for e in host if e.name == WINDOW)
    nest = _nesting(host)
    backward = [
        (e.start, e.end) for e in host if e.name.startswith(BACKWARD) and not nest[id(e)][1]
    ]

    def kind(op: Event) -> str:
        """'tp' | 'other' for an outermost collective host op."""
        in_window = any(ws <= op.start <= we for ws, we in windows)
        return "tp" if op.name.startswith(TP_NAMESPACE) and in_window else "other"

    out = StepEvents(
        (step.start, step.end), windows, [], backward, {"forward": [], "backward": []}, [], []
    )
    out.flops = executed_flops(host)
    for e in host:
        owner, in_bwd = nest[id(e)]
        if owner is not e:
            continue
        op = profiler_op(e.name)
        if kind(e) == "tp" and op.startswith(COLLECTIVES):
            nbytes = profiled_bytes(e.name, e.shapes, e.dtypes, e.concrete)
            out.tp_count += 1
            out.tp_bytes += nbytes
            out.tp_volume += allreduce_equivalent(op, nbytes)
        if not device:
            phase = "backward" if in_bwd else "forward"
            (out.tp[phase] if kind(e) == "tp" else out.other).append((e.start, e.end))
    if device:
        # a kernel links to the CPU op it was launched from; runtime calls carry ids of
        # another counter (CUPTI's), which would collide with the ops' ids
        launches = {e.correlation: e for e in host if not e.runtime}
        phase_work = []  # (launch op's host start, kernel's device end)
        for k in events:
            if not k.device or k.annotation or k.name.startswith(("Memcpy", "Memset")):
                continue
            launch = launches.get(k.correlation)
            if "nccl" not in k.name.lower():
                out.compute.append((k.start, k.end))
                if launch is not None:
                    phase_work.append((launch.start, k.end))
                continue
            owner, in_bwd = nest[id(launch)] if launch is not None else (None, False)
            if owner is not None and kind(owner) == "tp":
                out.tp["backward" if in_bwd else "forward"].append((k.start, k.end))
                phase_work.append((launch.start, k.end))
            else:
                out.other.append((k.start, k.end))
        clock = _device_clock(phase_work)
        out.backward = [(clock(s), clock(e)) for s, e in backward]
    for ws, we in windows:
        inside = [s for s, _ in out.backward if ws <= s <= we]
        out.backward_starts.append(min(inside) if inside else we)
    return out


def _device_clock(work: list[tuple[float, float]]):
    """Host time -> device time: ``t`` -> when the device has finished the phase work
    launched before ``t`` (``max(t, latest device end of it)``; ``work``: (launch op's
    host start, kernel's device end) of compute kernels and the TP collectives' kernels,
    which the phase waits for). Other collectives (pipeline send/recv, FSDP) run on
    their own streams, waiting for peers, and would move the boundary by that wait."""
    work = sorted(work)
    launched = [s for s, _ in work]
    done = list(itertools.accumulate((e for _, e in work), max))

    def clock(t: float) -> float:
        i = bisect.bisect_left(launched, t)  # the work launched strictly before t
        return max(t, done[i - 1]) if i else t

    return clock


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
        inside = [(max(s, ws), min(e, we)) for s, e in ev.backward for ws, we in ev.windows]
        backward = length([(s, e) for s, e in inside if s < e]) * ms
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


# ---------------------------------------------------------------- trace summary
LABEL = re.compile(r"^[a-z]+/layer\d+/")


def _walk(host: list[Event]):
    """Per host event: (innermost collective-point label, innermost backward node)."""
    out: dict[int, tuple[str, Event | None]] = {}
    for evs in _threads(host).values():
        stack: list[tuple[float, str, Event | None]] = []
        for e in sorted(evs, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1][0] <= e.start:
                stack.pop()
            label, node = (stack[-1][1], stack[-1][2]) if stack else ("", None)
            out[id(e)] = (label, node)
            if LABEL.match(e.name):
                label = e.name
            if e.name.startswith(BACKWARD):
                node = e
            stack.append((e.end, label, node))
    return out


def summary(events: list[Event], top: int = 12) -> str:
    """Markdown: the profiled step's TP collectives by block and collective point
    (forward in its ``LatentComm.scope``; backward named after the forward op that made
    its autograd node), then the ``top`` host ops by self time."""
    host = [e for e in events if not e.device]
    nest, walk = _nesting(host), _walk(host)
    windows = [(e.start, e.end) for e in host if e.name == WINDOW]
    # the collective point of every forward op autograd recorded
    point_of_seq = {}
    for e in host:
        label, node = walk[id(e)]
        if e.sequence_nr >= 0 and node is None and label and e.sequence_nr not in point_of_seq:
            point_of_seq[e.sequence_nr] = label
    rows: dict[tuple[str, str], list] = {}  # (point, phase) -> [count, volume, us, ops]
    for e in host:
        owner, in_bwd = nest[id(e)]
        op = profiler_op(e.name)
        if owner is not e or not op or not any(ws <= e.start <= we for ws, we in windows):
            continue
        label, node = walk[id(e)]
        if in_bwd and node is not None:
            label = point_of_seq.get(node.sequence_nr, "")
        key = (label or "(outside the blocks)", "backward" if in_bwd else "forward")
        row = rows.setdefault(key, [0, 0.0, 0.0, set()])
        row[2] += e.end - e.start  # collectives and their waits
        if op.startswith(COLLECTIVES):
            nbytes = profiled_bytes(e.name, e.shapes, e.dtypes, e.concrete)
            row[0] += 1
            row[1] += allreduce_equivalent(op, nbytes)
            row[3].add(next(c for c in COLLECTIVES if op.startswith(c)))
    lines = [
        "TP collectives of the forward/backward by block and collective point (MiB "
        "all-reduce-equivalent; ms: the calling thread's time in them and their waits):",
        "",
        "| point | phase | collectives | count | MiB | ms |",
        "|---|---|---|---|---|---|",
    ]
    for (label, phase), (count, volume, us, ops) in sorted(rows.items(), key=_natural):
        lines.append(
            f"| {label} | {phase} | {', '.join(sorted(ops))} | {count} | {volume / MIB:.3f} "
            f"| {us / 1e3:.2f} |"
        )
    lines += [
        "",
        f"Top {top} host ops by self time:",
        "",
        "| op | calls | self ms |",
        "|---|---|---|",
    ]
    for name, (calls, us) in _self_times(host)[:top]:
        lines.append(f"| {name} | {calls} | {us / 1e3:.2f} |")
    return "\n".join(lines)


def _natural(item):
    (label, phase), _ = item
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)], phase


def _self_times(host: list[Event]) -> list[tuple[str, tuple[int, float]]]:
    """(op, (calls, self time us)) by self time, ranges of annotations left out."""
    totals: dict[str, list[float]] = {}
    for evs in _threads(host).values():
        stack: list[list] = []  # [end, name, child time]

        def close(frame):
            end, name, start, children = frame
            row = totals.setdefault(name, [0, 0.0])
            row[0] += 1
            row[1] += (end - start) - children

        for e in sorted(evs, key=lambda e: (e.start, -e.end)):
            while stack and stack[-1][0] <= e.start:
                close(stack.pop())
            if stack:
                stack[-1][3] += e.end - e.start
            stack.append([e.end, e.name, e.start, 0.0])
        while stack:
            close(stack.pop())
    skip = (STEP, WINDOW)
    rows = [
        (n, (int(c), t)) for n, (c, t) in totals.items() if n not in skip and not LABEL.match(n)
    ]
    return sorted(rows, key=lambda r: -r[1][1])


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
        raw = from_kineto(prof)
        events = collect(raw, device)
        self.flops_per_step = events.flops
        self.last_summary = summary(raw)
        result.update(scalars(events, device, self.interleaved))
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
