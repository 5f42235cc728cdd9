"""Run torchtitan 0.2.2 on CPU / gloo when no accelerator is present.

torchtitan assumes an accelerator: it picks ``device_type`` at import time (falling back
to "cuda"), calls ``torch.cuda``-style memory APIs on ``torch.cpu``, asks FSDP2 for a
PREMUL_SUM reduction that gloo refuses, and hands ``None`` to the profiler. Everything
this project changes to make a CPU run a first-class mode lives in this module, and
``activate()`` does nothing when CUDA is available, so GPU runs are untouched.

``activate()`` must run before the first ``import torchtitan``: ``boost_titan.train``
(the entry point used by ``run_train.sh``) calls it first thing.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

_ACTIVE = False


def cpu_mode() -> bool:
    """True when this process runs torchtitan on CPU (no CUDA device visible)."""
    return not torch.cuda.is_available()


def is_active() -> bool:
    return _ACTIVE


def activate() -> bool:
    """Install the CPU shims; returns whether CPU mode is on. Idempotent."""
    global _ACTIVE
    if _ACTIVE:
        return True
    if not cpu_mode():
        return False
    import sys

    if "torchtitan.tools.utils" in sys.modules:
        from torchtitan.tools import utils as tt_utils

        if tt_utils.device_type != "cpu":
            raise RuntimeError(
                "boost_titan.parallel.cpu_runtime.activate() must run before torchtitan is "
                "imported (torchtitan fixed device_type="
                f"{tt_utils.device_type!r} at import time). Launch training with "
                "`python -m boost_titan.train` / run_train.sh."
            )

    # 1. torchtitan computes device_type = _get_available_device_type() or "cuda".
    torch._utils._get_available_device_type = lambda: "cpu"
    # 2. the torch.cpu gaps torchtitan's trainer and metrics touch.
    _patch_torch_cpu_module()
    # 3. torchtitan passes activities=[CPU, None] to the profiler when CUDA is absent.
    _patch_profiler()
    # 4. DTensor's random ops give every shard of a CPU mesh the same numbers.
    _shard_random_init_like_one_device()
    # 5. context parallelism's ring knows only the CUDA attention kernels.
    from boost_titan.parallel import cpu_ring_attention

    cpu_ring_attention.install()
    _ACTIVE = True
    return True


# --------------------------------------------------------------------------- torch.cpu
def _meminfo_total_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


class _CPUProperties:
    def __init__(self) -> None:
        self.name = cpu_device_name()
        self.total_memory = _meminfo_total_bytes()


def cpu_device_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return "CPU " + line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "CPU"


def _patch_torch_cpu_module() -> None:
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: cpu_device_name()
    cpu.get_device_properties = lambda device=None: _CPUProperties()
    cpu.reset_peak_memory_stats = lambda device=None: reset_peak_rss()
    cpu.empty_cache = lambda: None
    cpu.memory_stats = lambda device=None: {}
    # barrier(device_ids=[current_device()]) needs an int; torch.cpu returns "cpu".
    cpu.current_device = lambda: 0


# --------------------------------------------------------------------------- profiler
def _patch_profiler() -> None:
    base = torch.profiler.profile
    if getattr(base, "_boost_filters_none", False):
        return

    class _Profile(base):  # type: ignore[misc, valid-type]
        _boost_filters_none = True

        def __init__(self, *args: Any, activities=None, **kwargs: Any) -> None:
            if activities is not None:
                activities = [a for a in activities if a is not None]
            super().__init__(*args, activities=activities, **kwargs)

    torch.profiler.profile = _Profile


# --------------------------------------------------------------------------- memory
def _shard_random_init_like_one_device() -> None:
    """In-place ``normal_`` / ``uniform_`` on a DTensor (weight init) draw the whole
    tensor on every rank, as one device would, and keep this rank's shard.

    DTensor offsets the RNG per shard only on accelerator meshes (its
    ``OffsetBasedRNGTracker`` moves the CUDA Philox offset); on a CPU mesh it warns
    ("DTensor random operators may not have complete support") and runs the op on each
    local shard with the local generator. Every rank of a TP group is seeded alike, so
    every shard drew the same numbers: the two halves of a TP2 weight were copies (e.g.
    the two heads' halves of wq, both halves of an embedding row), a degenerate start
    for every CPU run trained from scratch. Drawing the global tensor costs its size
    on each rank, nothing at CPU debug shapes, and makes a sharded init equal the
    1-process init with the same seed, bit for bit, under any placements (TP, FSDP2,
    both: ``distribute_tensor`` keeps the shard, no communication)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    aten = torch.ops.aten

    def draw_global_then_shard(op_call, args, kwargs):
        target = args[0]
        whole = torch.empty(target.shape, dtype=target.dtype, device=target._local_tensor.device)
        op_call(whole, *args[1:], **kwargs)
        mine = distribute_tensor(
            whole, target.device_mesh, target.placements, src_data_rank=None
        ).to_local()
        target._local_tensor.copy_(mine)
        return target

    handlers = DTensor._op_dispatcher._custom_op_handlers
    for op in (aten.normal_.default, aten.uniform_.default):
        handlers[op] = draw_global_then_shard


def _read_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} field")


def current_rss_bytes() -> int:
    return _read_status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    return _read_status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Reset VmHWM to the current RSS (Linux: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not permitted: the peak then covers the whole process lifetime


class RSSMemoryMonitor:
    """Drop-in for torchtitan's DeviceMemoryMonitor that reports process RSS.

    ``max_active`` is the RSS now, ``max_reserved`` the peak RSS since the last reset;
    percentages are of the machine's physical memory.
    """

    def __init__(self) -> None:
        self.device_name = cpu_device_name()
        self.device_capacity = _meminfo_total_bytes()
        self.device_capacity_gib = self.device_capacity / 2**30
        self.reset_peak_stats()

    def _pct(self, nbytes: int) -> float:
        return 100.0 * nbytes / self.device_capacity if self.device_capacity else 0.0

    def get_peak_stats(self):
        from torchtitan.components.metrics import DeviceMemStats

        now, peak = current_rss_bytes(), peak_rss_bytes()
        return DeviceMemStats(now / 2**30, self._pct(now), peak / 2**30, self._pct(peak), 0, 0)

    def reset_peak_stats(self) -> None:
        reset_peak_rss()


# --------------------------------------------------------------------------- peak FLOP/s
def measure_matmul_peak_flops(
    n: int = 1024, dtype: torch.dtype = torch.float32, seconds: float = 1.0
) -> float:
    """Best achieved FLOP/s of an n x n x n matmul in this process (its threads)."""
    a = torch.randn(n, n, dtype=dtype)
    b = torch.randn(n, n, dtype=dtype)
    for _ in range(2):
        a @ b
    best = float("inf")
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def resolve_peak_flops(configured: float) -> float:
    """Peak FLOP/s for MFU on CPU: the configured value, else a quick measurement."""
    if configured > 0:
        return configured
    env = os.environ.get("BOOST_CPU_PEAK_FLOPS")
    if env:
        return float(env)
    return measure_matmul_peak_flops(seconds=0.5)


def build_metrics_processor(job_config, parallel_dims, model_args=None, tag=None):
    """TrainSpec.build_metrics_processor_fn: ``BoostMetricsProcessor``, CPU-aware.

    On CPU the memory monitor reports RSS and MFU uses ``[boost] cpu_peak_flops``
    (0 = measure this process's fp32 matmul peak at start-up), raised to any higher rate
    the run achieves (:func:`boost_titan.observability.metrics.cpu_peak`).
    """
    from torchtitan.tools.logging import logger

    from boost_titan.observability.metrics import BoostMetricsProcessor as MetricsProcessor

    if not is_active():
        return MetricsProcessor(job_config, parallel_dims, tag)
    from torchtitan.tools import utils as tt_utils

    boost = getattr(job_config, "boost", None)
    configured = float(getattr(boost, "cpu_peak_flops", 0.0) or 0.0)
    peak = resolve_peak_flops(configured)
    # torchtitan looks peak FLOP/s up in a GPU table (and shells out to lspci)
    tt_utils.get_peak_flops = lambda device_name: peak
    processor = MetricsProcessor(job_config, parallel_dims, tag)
    processor.device_memory_monitor = RSSMemoryMonitor()
    # an estimate, not a datasheet bound: raised to any rate the run achieves above it
    # (boost_titan.observability.metrics.cpu_peak: what a CPU's peak is taken to be)
    processor.cpu_peak_source = (
        "configured"
        if configured > 0
        else "BOOST_CPU_PEAK_FLOPS"
        if os.environ.get("BOOST_CPU_PEAK_FLOPS")
        else "measured fp32 matmul"
    )
    logger.info(
        f"CPU run: memory metrics are process RSS; MFU uses peak {peak:.3e} FLOP/s "
        f"({processor.cpu_peak_source}; raised to any higher rate a logged step achieves)"
    )
    return processor


def fix_fsdp_reduce_for_gloo(model: torch.nn.Module) -> None:
    """FSDP2 reduces with PREMUL_SUM once a divide factor is set; gloo lacks it.

    torchtitan sets the factor to 1.0 (it scales the loss by the global token count
    itself), so a plain SUM is numerically identical.
    """
    if not is_active():
        return
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def exit_after_clean_shutdown(code: int = 0) -> None:
    """End a finished CPU run without Python's interpreter shutdown (exit ``code``: 1
    after a failure that every rank reached together, e.g. a failed checkpoint save;
    finalizing then also stalls ~5 s in gloo's teardown).

    gloo's worker threads outlive ``destroy_process_group()`` and still take the GIL
    now and then to release tensors of their last collectives. If one asks for it
    while the interpreter is finalizing, Python 3.11 ends the thread with
    ``pthread_exit`` from inside C++ code that may not unwind, and the rank aborts
    ("terminate called without an active exception", SIGABRT) after a successful
    run. Reproduced with two gloo ranks and a collective completing during shutdown
    (gdb: ProcessGroupGloo::runLoop -> Future::markCompleted -> take_gil ->
    pthread_exit -> std::terminate). The trainer has closed its checkpointer and
    metrics by now, so flushing the streams and leaving at once loses nothing."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
