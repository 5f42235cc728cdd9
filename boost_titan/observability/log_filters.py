"""Warnings and log lines that are wrong or irrelevant on boost_titan's paths, dropped
by their exact text (and, for Python warnings, the module they are attributed to).

Each entry says why it is harmless here. Everything else is left as it is: a warning
not listed here still prints, and a listed one raised from another place (another
module) still prints too.

* :func:`install_for_training`: from ``boost_titan.train.trainer.main``, after torchtitan's
  ``init_logger``;
* :func:`install_for_dry_run`: from the dry run's entry and its role processes;
* :func:`drop_torchtitan_mixed_precision_lines`: from ``boost_titan.parallel.parallelize`` when
  it takes over mixed precision (TP or PP without FSDP).
"""

from __future__ import annotations

import logging
import os
import re
import warnings

# (exact message start, module the warning is attributed to (a regex)): UserWarnings
_WARNINGS = (
    # torch's DTensor manual_seed() on a CPU mesh returns early (no RNG tracker), warning
    # through is_rng_supported_mesh. torchtitan's set_determinism has already called
    # torch.manual_seed(seed), which is all DTensor's manual_seed does on any mesh ("manual
    # seed on dtensor is the same thing as manual seed on torch"). Random ops on DTensors
    # are what the missing tracker affects: weight init (normal_/uniform_, trunc_normal_
    # via uniform_) is drawn like one device by cpu_runtime's handlers; the boost_titan
    # models have no dropout and no other random op on DTensors. Only the manual_seed
    # call sites are dropped: a random op that DTensor dispatches on a CPU mesh warns
    # from torch.distributed.tensor._dispatch, which still prints.
    (
        "DTensor random operators may not have complete support on cpu device mesh",
        r"torch\.distributed\.tensor\._random",
    ),
    (
        "DTensor manual_seed() may not have complete support on cpu device mesh",
        r"torchtitan\.distributed\.utils",
    ),
    # torchdata's StatefulDataLoader calls torch.set_vital (usage telemetry, now a no-op
    # that returns None) each time a dataloader is built
    (
        "'set_vital' is deprecated, please do not call",
        r"torchdata\.stateful_dataloader\.stateful_dataloader",
    ),
    # one process (or DDP): torchtitan's maybe_enable_amp wraps each step in
    # torch.autocast(dtype=mixed_precision_param); on CPU that dtype can only be float32
    # to be refused (CPU autocast takes bfloat16 and float16, the other two choices), and
    # autocast to float32 is no autocast: fp32 is what the config asked for
    (
        "In CPU autocast, but the target dtype is not supported. Disabling autocast.",
        r"torchtitan\.distributed\.utils",
    ),
    # torchtitan's set_pg_timeouts sets the training timeout on every mesh's group: the
    # groups of degree-1 (and 'batch') mesh dimensions are torchtitan's fake groups
    # (ParallelDims backend_override "fake"), which never communicate and take no
    # timeout; the gloo (and NCCL) groups do get it
    (
        "Set timeout is now only supported for either nccl or gloo",
        r"torchtitan\.distributed\.utils",
    ),
)

# torchtitan's (root logger) lines, by exact start of the message
_TRAINING_LINES = (
    # torchrun's agent gives every worker TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless it is
    # set; torchtitan sets 3 (what its NCCL flight recorder needs) and warns whenever the
    # variable exists. On gloo nothing reads it; on NCCL 3 is torchtitan's intended value.
    # Any other value (the user's own) still warns.
    "ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
    # BoostTrainer.train replaces this sleep with a barrier: nothing sleeps
    "Sleeping 2 seconds for other ranks to complete",
)

_MIXED_PRECISION_LINES = (
    "Mixed precision training with TP or PP is only supported when FSDP/HSDP/CP is enabled.",
    "Mixed precision training is disabled",
)

_DRY_RUN_LINES = (
    # the dry run traces the model with a placeholder vocabulary and reads no tokenizer:
    # torchtitan's config manager checks hf_assets_path on every parse
    "HF assets path ",
    "Temporarily switching to previous default tokenizer path",
)

# kineto's log level: torchtitan's init_logger sets 5 ("suppress verbose torch.profiler
# logging"), which kineto still prints its USDT markers at ("USDT: ...
# SyncActivityProfilerHandler.cpp:52] profiler_start" / profiler_stop, on every
# profiled step): they are its level 5, the highest. At 5 nothing else passes, so 6
# silences exactly those lines. Read by kineto when a profiler starts.
KINETO_LOG_LEVEL = "6"


class DropLines(logging.Filter):
    """Drops records whose message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


_TRAINING_FILTER = DropLines(_TRAINING_LINES)
_MIXED_PRECISION_FILTER = DropLines(_MIXED_PRECISION_LINES)
_DRY_RUN_FILTER = DropLines(_DRY_RUN_LINES)


def _torchtitan_logger() -> logging.Logger:
    from torchtitan.tools.logging import logger

    return logger


def _install_warning_filters() -> None:
    for message, module in _WARNINGS:
        warnings.filterwarnings(
            "ignore", message=re.escape(message), category=UserWarning, module=module + r"\Z"
        )


def install_for_training() -> None:
    """Call after torchtitan's ``init_logger`` (it sets KINETO_LOG_LEVEL itself)."""
    _install_warning_filters()
    _torchtitan_logger().addFilter(_TRAINING_FILTER)  # idempotent: one filter object
    os.environ["KINETO_LOG_LEVEL"] = KINETO_LOG_LEVEL


def install_for_dry_run() -> None:
    _install_warning_filters()
    _torchtitan_logger().addFilter(_DRY_RUN_FILTER)


def drop_torchtitan_mixed_precision_lines() -> None:
    """torchtitan's maybe_enable_amp logs, for TP or PP without FSDP, that mixed
    precision is unsupported and disabled: boost_titan.parallel.parallelize applies it there
    itself (``apply_autocast_without_fsdp``), and with float32 asked for there is no
    mixed precision to disable."""
    _torchtitan_logger().addFilter(_MIXED_PRECISION_FILTER)
