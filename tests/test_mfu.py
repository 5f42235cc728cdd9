"""MFU (and HFU) on CPU are at most 100%: a CPU's peak is an estimate (the start-up
matmul measurement, or a configured figure), and a logged step that achieves more raises
it (``boost_titan.observability.metrics.cpu_peak``) before torchtitan divides by it. A
GPU's datasheet peak is left as it is.

In this process: the metrics processor's ``log`` (ours, then torchtitan's) on a
processor whose parts are stand-ins, with the time window set so the achieved rate is
known."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest
from torchtitan.components.metrics import DeviceMemStats
from torchtitan.tools import utils

from boost_titan.observability.metrics import BoostMetricsProcessor, cpu_peak
from boost_titan.observability.step_profile import HFU_TAG


class _Logged:
    def __init__(self):
        self.rows: list[dict] = []

    def log(self, metrics, step):
        self.rows.append(dict(metrics))


class _Memory:
    def get_peak_stats(self):
        return DeviceMemStats(1.0, 1.0, 1.0, 1.0, 0, 0)

    def reset_peak_stats(self):
        pass


def _processor(peak: float, source: str | None, executed: float | None = None):
    p = object.__new__(BoostMetricsProcessor)  # no run folder, no process group
    p.job_config = SimpleNamespace(metrics=SimpleNamespace(log_freq=1))
    p.parallel_dims = SimpleNamespace(non_data_parallel_size=2)
    p.device_memory_monitor, p.color, p.logger = _Memory(), utils.NoColor(), _Logged()
    p.gpu_peak_flops, p.cpu_peak_source = peak, source
    p.num_flops_per_token, p.executed_flops_per_token = 1e6, executed
    return p


def _log_window(p, seconds: float, tokens: int) -> dict:
    """One logged step after ``tokens`` tokens in ``seconds``: what the loggers got."""
    p.ntokens_since_last_log, p.data_loading_times = tokens, [0.0]
    p.time_last_log = time.perf_counter() - seconds
    p.log(7, 2.0, 2.0, 1.0)
    return p.logger.rows[-1]


def test_cpu_peak_is_the_highest_rate_seen():
    assert cpu_peak(2e11, 5e11) == 5e11  # achieved above the estimate: it is the peak now
    assert cpu_peak(2e11, 1e11) == 2e11
    assert cpu_peak(2e11, 2e11) == 2e11


def test_cpu_mfu_and_hfu_stay_at_most_100_percent(caplog):
    # 2e6 tokens in ~1 s on 2 devices of a replica: 1e6 tokens/s per device, x 1e6 model
    # FLOPs = ~1e12 FLOP/s per device, against a measured estimate of 3.7e11 (270%)
    p = _processor(3.7e11, "measured fp32 matmul", executed=1.25e6)
    with caplog.at_level(logging.WARNING):
        row = _log_window(p, 1.0, 2_000_000)
    assert 0.99 * 1.25e12 < p.gpu_peak_flops <= 1.25e12  # raised to the executed rate
    assert 99 < row[HFU_TAG] <= 100  # executed FLOPs: the achieved rate itself
    assert 79 < row["mfu(%)"] <= 80  # the model's FLOPs: 1e6 / 1.25e6 of it
    assert row[HFU_TAG] / row["mfu(%)"] == pytest.approx(1.25, rel=1e-3)
    (warning,) = [r for r in caplog.records if "CPU peak" in r.getMessage()]
    assert warning.levelname == "WARNING"
    assert "achieved at step 7, above the CPU peak estimate 3.700e+11 (measured fp32 matmul)" in (
        warning.getMessage()
    )

    # a slower window: the raised peak stays, MFU is the rate against it (no new warning)
    caplog.clear()
    peak = p.gpu_peak_flops
    with caplog.at_level(logging.WARNING):
        row = _log_window(p, 1.0, 1_000_000)
    assert p.gpu_peak_flops == peak and not caplog.records
    assert row["mfu(%)"] == pytest.approx(100 * 0.5e12 / peak, rel=1e-2)
    # a faster one raises it again, said in one info line
    with caplog.at_level(logging.INFO):
        row = _log_window(p, 1.0, 4_000_000)
    assert 99 < row[HFU_TAG] <= 100 and p.gpu_peak_flops > 2 * peak
    assert [r.levelname for r in caplog.records if "CPU peak" in r.getMessage()] == ["INFO"]


def test_a_datasheet_peak_is_not_raised():
    p = _processor(3.7e11, None)  # a GPU's: what torchtitan's table says
    row = _log_window(p, 1.0, 2_000_000)
    assert p.gpu_peak_flops == 3.7e11 and row["mfu(%)"] > 260
