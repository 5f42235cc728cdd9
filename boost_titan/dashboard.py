"""A BOOST dashboard on TensorBoard's CUSTOM SCALARS page, written by every run.

torchtitan writes its scalars flat (``loss_metrics/...``, ``throughput(tps)``,
``memory/...``, ``lr`` ...), so the SCALARS page scatters what one reads together:
train and validation loss land in separate sections, throughput/TFLOPs/MFU sit apart.
The custom-scalars layout below groups them (loss, throughput, memory, optimizer); it
costs one summary in the run's own event file, written once by each rank that writes
TensorBoard (the same ``SummaryWriter``, so the same folder).

The layout is built from ``CHARTS``, one list of the exact tags torchtitan 0.2.2's
``MetricsProcessor.log``/``log_validation`` and the trainer's ``extra_metrics`` write;
``tests/test_dashboard.py`` checks every one of them against a real run's event file,
so the layout cannot reference a tag that is not written. TensorBoard reads a chart's
tags as regular expressions matched at the start of a tag: each is escaped and
anchored (``throughput(tps)`` would otherwise match nothing, ``memory/...`` too much).
"""

from __future__ import annotations

import re

# (category, chart title, tags). Validation tags are dropped when validation is off.
CHARTS: list[tuple[str, str, list[str]]] = [
    (
        "loss",
        "loss (train avg/max, validation)",
        ["loss_metrics/global_avg_loss", "loss_metrics/global_max_loss", "validation_metrics/loss"],
    ),
    ("throughput", "tokens/s", ["throughput(tps)"]),
    ("throughput", "TFLOPs", ["tflops"]),
    ("throughput", "MFU (%)", ["mfu(%)"]),
    ("memory", "max memory (GiB)", ["memory/max_reserved(GiB)", "memory/max_active(GiB)"]),
    ("memory", "max memory (%)", ["memory/max_reserved(%)", "memory/max_active(%)"]),
    ("optimizer", "grad norm", ["grad_norm"]),
    ("optimizer", "learning rate", ["lr"]),
]

VALIDATION_PREFIX = "validation_metrics/"


def tag_regex(tag: str) -> str:
    """The chart pattern that selects exactly ``tag`` (TensorBoard uses ``re.match``)."""
    return re.escape(tag) + "$"


def layout(validation: bool = True, prefix: str | None = None) -> dict:
    """``SummaryWriter.add_custom_scalars`` layout: {category: {title: ["Multiline", regexes]}}.

    ``prefix`` is the MetricsProcessor's tag, which TensorBoardLogger puts before every tag.
    """
    out: dict[str, dict[str, list]] = {}
    for category, title, tags in CHARTS:
        tags = [t for t in tags if validation or not t.startswith(VALIDATION_PREFIX)]
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

    loggers = getattr(metric_logger, "_loggers", [metric_logger])
    written = 0
    for tb in loggers:
        if isinstance(tb, TensorBoardLogger):
            tb.writer.add_custom_scalars(layout(job_config.validation.enable, tb.tag))
            tb.writer.flush()
            written += 1
    return written
