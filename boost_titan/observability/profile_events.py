"""A profiled step's events, read from ``torch.profiler``: the interval arithmetic, the
events each thread and the device ran, which of them are collectives and which belong
to forward, backward or the optimizer (:func:`collect`), the FLOPs the hardware executed
(:func:`executed_flops`), and the readable summary of a trace (:func:`summary`).

What becomes a scalar, and when a step is profiled: :mod:`boost_titan.observability.step_profile`.
"""

from __future__ import annotations

import bisect
import itertools
import operator
import re
from dataclasses import dataclass, field

import torch

from boost_titan.observability.comm_stats import (
    COLLECTIVES,
    allreduce_equivalent,
    profiled_bytes,
    profiler_op,
)

STEP = "boost/step"
WINDOW = "boost/forward_backward"
BACKWARD = "autograd::engine::evaluate_function"
TP_NAMESPACE = "_c10d_functional::"
OTHER_NAMESPACE = "c10d::"
MIB = 2**20


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


def _covered(spans, holes) -> list[tuple[float, float, float]]:
    """(start, end, length covered by ``holes``) of each interval of ``union(spans)``.
    One sweep over both merged lists: a hole is visited for each span it overlaps, and
    two disjoint sorted lists have fewer than ``len(spans) + len(holes)`` such pairs
    (comparing every span with every hole took ~90 s per rank per profiled step at 4k
    collectives beside 50k kernels, #48)."""
    holes = union(holes)
    out = []
    first = 0  # the first hole that may overlap this span or a later one
    for s, e in union(spans):
        while first < len(holes) and holes[first][1] <= s:
            first += 1
        covered = 0.0
        k = first
        while k < len(holes) and holes[k][0] < e:
            covered += min(e, holes[k][1]) - max(s, holes[k][0])
            k += 1
        out.append((s, e, covered))
    return out


def minus(spans, holes) -> float:
    """Length of ``spans`` not covered by ``holes``."""
    return sum((e - s) - covered for s, e, covered in _covered(spans, holes))


def overlap(spans, holes) -> float:
    """Length of ``spans`` covered by ``holes``."""
    return sum(covered for _, _, covered in _covered(spans, holes))


def within(spans: list[tuple[float, float]]):
    """``t -> any(s <= t <= e for s, e in spans)`` by bisection on the merged spans."""
    merged = union(spans)
    starts = [s for s, _ in merged]

    def inside(t: float) -> bool:
        i = bisect.bisect_right(starts, t)  # the last span starting at or before t
        return i > 0 and t <= merged[i - 1][1]

    return inside


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
    if e.name in MATMULS:
        return e.flops
    if e.name.startswith("aten::_scaled_dot_product_") and "attention" in e.name:
        from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

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
    return _executed_flops(_walk_order(host))


def _executed_flops(threads: list[list[Event]]) -> float:
    """:func:`executed_flops` of host ops in :func:`_walk_order`."""
    total = 0.0
    for evs in threads:
        # (end, innermost counted op enclosing or being this range); a counted op marks
        # only the nearest counted op around it as a wrapper: that one, when it was
        # walked, marked the next one out, so every wrapper is found in one pass
        stack: list[tuple[float, Event | None]] = []
        wrappers: set[int] = set()
        counted = []
        for e in evs:
            while stack and stack[-1][0] <= e.start:
                stack.pop()
            nearest = stack[-1][1] if stack else None
            flops = _flops(e)
            if flops is not None:
                if nearest is not None:
                    wrappers.add(id(nearest))
                counted.append((e, flops))
                nearest = e
            stack.append((e.end, nearest))
        total += sum(flops for e, flops in counted if id(e) not in wrappers)
    return total


_START, _END = operator.attrgetter("start"), operator.attrgetter("end")
COMM_NAMESPACES = (TP_NAMESPACE, OTHER_NAMESPACE)


def _walk_order(host: list[Event]) -> list[list[Event]]:
    """The host events of each thread, each range before the ranges it encloses: by
    start, the longer first at equal starts (two stable sorts on attributes instead of
    one on built tuples: one sort per analysis, shared by its walks)."""
    by_thread: dict[int, list[Event]] = {}
    for e in host:
        by_thread.setdefault(e.thread, []).append(e)
    for evs in by_thread.values():
        evs.sort(key=_END, reverse=True)  # stable: equal ranges keep the trace's order
        evs.sort(key=_START)
    return list(by_thread.values())


def _nesting(threads: list[list[Event]]) -> dict[int, tuple[Event | None, bool]]:
    """Per host event (by ``id``) of :func:`_walk_order`: its outermost enclosing
    collective op (itself if it is one and none encloses it) and whether it runs inside
    autograd's backward. Ranges of one thread nest; each thread is walked once with a
    stack."""
    out: dict[int, tuple[Event | None, bool]] = {}
    for evs in threads:
        stack: list[tuple[float, Event | None, bool]] = []  # (end, owner, in_backward)
        for e in evs:
            while stack and stack[-1][0] <= e.start:
                stack.pop()
            owner, in_bwd = (stack[-1][1], stack[-1][2]) if stack else (None, False)
            if owner is None and e.name.startswith(COMM_NAMESPACES):
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


@dataclass
class HostTree:
    """A step's host events, walked once for :func:`collect` and :func:`summary` both:
    per thread in :func:`_walk_order`, and each one's :func:`_nesting`."""

    host: list[Event]
    threads: list[list[Event]]
    nest: dict[int, tuple[Event | None, bool]]


def host_tree(events: list[Event]) -> HostTree:
    host = [e for e in events if not e.device]
    threads = _walk_order(host)
    return HostTree(host, threads, _nesting(threads))


def collect(events: list[Event], device: bool, tree: HostTree | None = None) -> StepEvents:
    """Sort a profiled step's events into :class:`StepEvents`.

    ``device`` (GPU): collective time from device kernels instead of host ops, and the
    backward's boundaries (``backward_starts``, ``backward``) moved to the device's side
    (:func:`_device_clock`): the host queues kernels ahead of the device, so the host's
    first backward op starts while the forward's kernels still run. ``tree``:
    :func:`host_tree` of ``events``, if made already."""
    tree = tree or host_tree(events)
    host, nest = tree.host, tree.nest
    step = next(e for e in host if e.name == STEP)
    windows = sorted((e.start, e.end) for e in host if e.name == WINDOW)
    backward = [
        (e.start, e.end) for e in host if e.name.startswith(BACKWARD) and not nest[id(e)][1]
    ]

    in_window = within(windows)

    def kind(op: Event) -> str:
        """'tp' | 'other' for an outermost collective host op."""
        return "tp" if op.name.startswith(TP_NAMESPACE) and in_window(op.start) else "other"

    out = StepEvents(
        (step.start, step.end), windows, [], backward, {"forward": [], "backward": []}, [], []
    )
    out.flops = _executed_flops(tree.threads)
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
    out.backward_starts = _first_starts(windows, out.backward)
    return out


def _first_starts(windows, spans) -> list[float]:
    """Per window: the earliest start of ``spans`` inside it (ends included), else the
    window's end. By bisection on the sorted starts, not a scan of them per window."""
    starts = sorted(s for s, _ in spans)
    out = []
    for ws, we in windows:
        i = bisect.bisect_left(starts, ws)
        out.append(starts[i] if i < len(starts) and starts[i] <= we else we)
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


# ---------------------------------------------------------------- trace summary
LABEL = re.compile(r"^[a-z]+/layer\d+/")


def _walk(threads: list[list[Event]]):
    """Per host event of :func:`_walk_order`: (innermost collective-point label,
    innermost backward node)."""
    out: dict[int, tuple[str, Event | None]] = {}
    for evs in threads:
        stack: list[tuple[float, str, Event | None]] = []
        for e in evs:
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


def summary(events: list[Event], top: int = 12, tree: HostTree | None = None) -> str:
    """Markdown: the profiled step's TP collectives by block and collective point
    (forward in its ``LatentComm.scope``; backward named after the forward op that made
    its autograd node), then the ``top`` host ops by self time. ``tree``:
    :func:`host_tree` of ``events``, if made already."""
    tree = tree or host_tree(events)
    host, nest, threads = tree.host, tree.nest, tree.threads
    walk = _walk(threads)
    in_window = within([(e.start, e.end) for e in host if e.name == WINDOW])
    # the collective point of every forward op autograd recorded
    point_of_seq = {}
    for e in host:
        if e.sequence_nr < 0 or e.sequence_nr in point_of_seq:
            continue
        label, node = walk[id(e)]
        if node is None and label:
            point_of_seq[e.sequence_nr] = label
    rows: dict[tuple[str, str], list] = {}  # (point, phase) -> [count, volume, us, ops]
    for e in host:
        owner, in_bwd = nest[id(e)]
        if owner is not e:  # most events: not an outermost collective
            continue
        op = profiler_op(e.name)
        if not op or not in_window(e.start):
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
    for name, (calls, us) in _self_times(threads)[:top]:
        lines.append(f"| {name} | {calls} | {us / 1e3:.2f} |")
    return "\n".join(lines)


def _natural(item):
    (label, phase), _ = item
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)], phase


def _self_times(threads: list[list[Event]]) -> list[tuple[str, tuple[int, float]]]:
    """(op, (calls, self time us)) by self time of host events in :func:`_walk_order`,
    ranges of annotations left out."""
    totals: dict[str, list[float]] = {}
    for evs in threads:
        stack: list[list] = []  # [end, name, child time]

        def close(frame):
            end, name, start, children = frame
            row = totals.setdefault(name, [0, 0.0])
            row[0] += 1
            row[1] += (end - start) - children

        for e in evs:
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
