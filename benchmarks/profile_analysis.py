"""How long the analysis of a profiled step takes once the profiler stops (#48's bound:
well under a second for 4,000 collectives beside 40,000 compute kernels).

    PYTHONPATH=. .venv/bin/python benchmarks/profile_analysis.py [--reps 5]

Builds the synthetic step of ``large_step`` (the one tests/test_profile_intervals.py
checks figure by figure), then prints, for each size, the median and the best of
``--reps`` runs of :func:`~boost_titan.observability.step_profile.analyze` in this
thread's CPU time, and the ratio of the largest size's to the smallest's against the
ratio of their event counts: a linear analysis keeps the two close, a quadratic one
multiplies the first by the second."""

from __future__ import annotations

import argparse
import statistics
import time

from boost_titan.observability.profile_events import BACKWARD, STEP, WINDOW, Event
from boost_titan.observability.step_profile import analyze


def large_step(n_comm: int, n_compute: int, n_windows: int = 8) -> list[Event]:
    """A GPU step of ``n_compute`` matmuls and ``n_comm`` TP all-reduces (one after every
    ``n_compute // n_comm`` matmuls), each a host op launching one device kernel; the
    second half of each forward/backward window runs inside autograd's ops.

    Op ``i`` runs at [2i, 2i+1] on the host; a matmul's kernel at [2i, 2i+1.5] on the
    device, an all-reduce's at [2i-1, 2i+1]: the previous matmul's kernel covers half a
    unit of it, so 1.5 us of each collective is exposed."""
    per = n_compute // n_comm
    n = n_compute + n_comm
    events = [Event(STEP, -10, 2 * n + 100, thread=1)]
    per_window = -(-n // n_windows)
    for w in range(n_windows):
        first, last = w * per_window, min(n, (w + 1) * per_window) - 1
        events.append(Event(WINDOW, 2 * first - 0.5, 2 * last + 1.5, thread=1))
    ar = dict(shapes=[[4, 8], [], []], dtypes=["float", "", ""], concrete=[None, "sum", "0"])
    for i in range(n):
        t = 2 * i
        if i % per_window >= per_window // 2:  # backward half of its window
            events.append(Event(f"{BACKWARD}: MmBackward0", t - 0.25, t + 1.25, thread=1))
        if i % (per + 1) == per:
            events.append(Event("_c10d_functional::all_reduce", t, t + 1, 1, False, i + 1, **ar))
            events.append(Event("ncclDevKernel_AllReduce", t - 1, t + 1, 0, True, i + 1))
        else:
            events.append(Event("aten::mm", t, t + 1, 1, False, i + 1, flops=100))
            events.append(Event("sm90_xmma_gemm", t, t + 1.5, 0, True, i + 1))
    return events


def _seconds(n_comm: int, n_compute: int, reps: int) -> list[float]:
    events = large_step(n_comm, n_compute)
    out = []
    for _ in range(reps):
        t0 = time.thread_time()  # this thread's CPU: other processes do not count
        analyze(events, device=True)
        out.append(time.thread_time() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="runs per size (default 5)")
    args = parser.parse_args()
    if args.reps < 1:
        parser.error(f"--reps {args.reps}: give at least 1")
    sizes = [(500, 5_000), (1_000, 10_000), (4_000, 40_000)]
    medians = {}
    print("| collectives | compute kernels | median s | best s |")
    print("|---:|---:|---:|---:|")
    for n_comm, n_compute in sizes:
        s = _seconds(n_comm, n_compute, args.reps)
        medians[n_comm] = statistics.median(s)
        print(f"| {n_comm:,} | {n_compute:,} | {medians[n_comm]:.3f} | {min(s):.3f} |")
    small, large = sizes[0][0], sizes[-1][0]
    print(
        f"time ratio {large:,}/{small:,} collectives: {medians[large] / medians[small]:.1f}x "
        f"for {large // small}x the events"
    )


if __name__ == "__main__":
    main()
