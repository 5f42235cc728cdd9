"""A BOOST dashboard on TensorBoard's CUSTOM SCALARS page, written by every run.

torchtitan writes its scalars flat (``loss_metrics/...``, ``throughput(tps)``,
``memory/...``, ``lr`` ...), so the SCALARS page scatters what one reads together:
train and validation loss land in separate sections, throughput/TFLOPs/MFU sit apart.
The custom-scalars layout below groups them (loss, throughput, communication, step
time, memory, optimizer), with the profiled steps' scalars
(:mod:`boost_titan.observability.step_profile`); it
costs one summary in the run's own event file, written once by each rank that writes
TensorBoard (the same ``SummaryWriter``, so the same folder).

The layout is built from ``CHARTS``, one list of the exact tags torchtitan 0.2.2's
``MetricsProcessor.log``/``log_validation`` and the trainer's ``extra_metrics`` write;
``tests/test_dashboard.py`` checks every one of them against a real run's event file,
so the layout cannot reference a tag that is not written. TensorBoard reads a chart's
tags as regular expressions matched at the start of a tag: each is escaped and
anchored (``tflops`` would otherwise also match ``tflops_x``). Tags with parentheses
are charted under paren-free aliases (``ALIASES``): TensorBoard draws no line for them.
"""

from __future__ import annotations

import re

# (category, chart title, tags), in the order the page shows them. Validation tags are
# dropped when validation is off. The time/, tp/, comm/ and hfu tags are the profiled
# steps' (boost_titan.observability.step_profile).
CHARTS: list[tuple[str, str, list[str]]] = [
    (
        "loss",
        "loss (train avg/max, validation)",
        ["loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "validation_metrics/loss"],
    ),
    ("throughput", "tokens/s", ["throughput/tokens_per_s"]),
    ("throughput", "MFU and HFU (%)", ["throughput/mfu_pct", "throughput/hfu_pct"]),
    ("throughput", "TFLOPs", ["tflops"]),
    ("communication", "TP comm share of the step (%)", ["tp/comm_share_pct"]),
    ("communication", "TP volume per step (MiB, all-reduce-equivalent)", ["tp/bytes_MiB"]),
    ("communication", "TP collectives per step", ["tp/collectives"]),
    ("communication", "other and exposed comm (ms)", ["comm/other_ms", "comm/exposed_ms"]),
    (
        "step time",
        "step, forward, backward, optimizer (ms)",
        ["time/step_ms", "time/forward_ms", "time/backward_ms", "time/optimizer_ms"],
    ),
    (
        "step time",
        "TP comm vs compute (ms)",
        [
            "tp/comm_forward_ms",
            "tp/compute_forward_ms",
            "tp/comm_backward_ms",
            "tp/compute_backward_ms",
        ],
    ),
    ("step time", "profiler cost per profiled step (ms)", ["time/profiler_overhead_ms"]),
    ("memory", "max memory (GiB)", ["memory/max_reserved_GiB", "memory/max_active_GiB"]),
    ("memory", "max memory (%)", ["memory/max_reserved_pct", "memory/max_active_pct"]),
    ("optimizer", "grad norm", ["grad_norm"]),
    ("optimizer", "learning rate", ["lr"]),
]

# The benchmark's runs (boost-titan bench: one run per variant under one log
# dir, so TensorBoard overlays the plans in each chart).
BENCH_CHARTS: list[tuple[str, str, list[str]]] = [
    ("loss", "loss", ["loss_metrics/global_avg_loss"]),
    ("throughput", "tokens/s", ["throughput/tokens_per_s"]),
    ("communication", "TP comm share of the step (%)", ["tp/comm_share_pct"]),
    ("communication", "TP volume per step (MiB, all-reduce-equivalent)", ["tp/bytes_MiB"]),
    ("communication", "TP collectives per step", ["tp/collectives"]),
    ("step time", "step (ms)", ["time/step_ms"]),
    ("memory", "peak step memory (MiB)", ["memory/peak_step_MiB"]),
]

VALIDATION_PREFIX = "validation_metrics/"

# TensorBoard 2.21's CUSTOM SCALARS page draws no line for a tag with parentheses: the
# chart scales to the data and lists the match, but stays empty (seen in headless
# Chromium with `boost-titan screenshot`, on a run written here). The
# dashboard's own tags have none; torchtitan's are written a second time under these
# names (``aliased``), which the layout charts. The SCALARS page keeps the originals.
ALIASES = {
    "throughput(tps)": "throughput/tokens_per_s",
    "mfu(%)": "throughput/mfu_pct",
    "memory/max_reserved(GiB)": "memory/max_reserved_GiB",
    "memory/max_active(GiB)": "memory/max_active_GiB",
    "memory/max_reserved(%)": "memory/max_reserved_pct",
    "memory/max_active(%)": "memory/max_active_pct",
}


def aliased(metrics: dict) -> dict:
    """``metrics`` plus the dashboard's paren-free names of torchtitan's tags."""
    return {**metrics, **{ALIASES[k]: v for k, v in metrics.items() if k in ALIASES}}


class AliasingLogger:
    """torchtitan's metric logger, every ``log`` written with :func:`aliased` names."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def log(self, metrics: dict, step: int) -> None:
        self._inner.log(aliased(metrics), step)


def tag_regex(tag: str) -> str:
    """The chart pattern that selects exactly ``tag`` (TensorBoard uses ``re.match``)."""
    return re.escape(tag) + "$"


def layout(
    validation: bool = True, prefix: str | None = None, charts=None, profiled: bool = True
) -> dict:
    """``SummaryWriter.add_custom_scalars`` layout: {category: {title: ["Multiline", regexes]}}.

    ``prefix`` is the MetricsProcessor's tag, which TensorBoardLogger puts before every tag.
    ``charts``: ``CHARTS`` (a training run, the default) or ``BENCH_CHARTS``.
    ``profiled=False`` (``[boost] profile_freq = 0``) drops the profiled steps' charts.
    """
    from boost_titan.observability.step_profile import HFU_TAG, TAGS

    dropped = set() if profiled else {*TAGS, HFU_TAG}
    out: dict[str, dict[str, list]] = {}
    for category, title, tags in CHARTS if charts is None else charts:
        tags = [t for t in tags if validation or not t.startswith(VALIDATION_PREFIX)]
        tags = [t for t in tags if t not in dropped]
        if tags:
            full = [t if prefix is None else f"{prefix}/{t}" for t in tags]
            out.setdefault(category, {})[title] = ["Multiline", [tag_regex(t) for t in full]]
    return out


def write_layout(metric_logger, job_config) -> int:
    """Write the layout through every TensorBoardLogger in torchtitan's ``logger``.

    Ranks that do not write TensorBoard hold a plain ``BaseLogger`` and write nothing.
    Returns the number of writers written to.
    """
    from torchtitan.components.metrics import TensorBoardLogger

    metric_logger = getattr(metric_logger, "_inner", metric_logger)  # AliasingLogger
    loggers = getattr(metric_logger, "_loggers", [metric_logger])
    written = 0
    for tb in loggers:
        if isinstance(tb, TensorBoardLogger):
            profiled = job_config.boost.profile_freq > 0
            tb.writer.add_custom_scalars(
                layout(job_config.validation.enable, tb.tag, None, profiled)
            )
            tb.writer.flush()
            written += 1
    return written


def write_text(metric_logger, tag: str, markdown: str, step: int) -> None:
    """A markdown text (TensorBoard's TEXT page) through every TensorBoardLogger."""
    from torchtitan.components.metrics import TensorBoardLogger

    metric_logger = getattr(metric_logger, "_inner", metric_logger)  # AliasingLogger
    for tb in getattr(metric_logger, "_loggers", [metric_logger]):
        if isinstance(tb, TensorBoardLogger):
            tb.writer.add_text(tag if tb.tag is None else f"{tb.tag}/{tag}", markdown, step)
