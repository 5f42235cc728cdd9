"""The parallel layout: [parallelism] degrees (>= 1, their product against the world
size, DDP's and boost_titan models' limits), the pipeline schedule, and the batch sizes
and sequence lengths the degrees must divide."""

from __future__ import annotations

import math
import os

from boost_titan.config import CP_PP_REFUSED, CP_PP_SCHEDULES, PP_SCHEDULES
from boost_titan.train.config_check.common import (
    ConfigError,
    ConfigPathError,
    _at_least,
    _ours,
    bad,
)

_DEGREES = (
    "data_parallel_replicate_degree",
    "data_parallel_shard_degree",
    "context_parallel_degree",
    "tensor_parallel_degree",
    "pipeline_parallel_degree",
)


def _check_parallelism(config, world_size: int | None) -> dict[str, int]:
    """Degrees >= 1, their product against the world size, DDP's limits; returns the
    resolved degrees (data_parallel_shard_degree -1 filled in)."""
    p = config.parallelism
    for key in (*_DEGREES, "expert_parallel_degree", "expert_tensor_parallel_degree"):
        value = getattr(p, key)
        if key == "data_parallel_shard_degree" and value == -1:
            continue
        _at_least(
            "parallelism",
            key,
            value,
            1,
            " (data_parallel_shard_degree may be -1: the rest)"
            if key == "data_parallel_shard_degree"
            else "",
        )
    deg = {k: getattr(p, k) for k in _DEGREES}
    others = math.prod(v for k, v in deg.items() if k != "data_parallel_shard_degree")
    layout = " x ".join(f"{k} {v}" for k, v in deg.items())
    if world_size is not None:
        if deg["data_parallel_shard_degree"] == -1:
            if world_size % others:
                raise bad(
                    "parallelism",
                    "data_parallel_shard_degree",
                    -1,
                    f"cannot fill WORLD_SIZE {world_size}: the other degrees multiply to {others}, "
                    f"which does not divide it; launch a multiple of {others} processes "
                    f"or change the degrees",
                )
            deg["data_parallel_shard_degree"] = world_size // others
        elif math.prod(deg.values()) != world_size:
            raise ConfigError(
                f"[parallelism] degrees multiply to {math.prod(deg.values())} ({layout}) but "
                f"WORLD_SIZE = {world_size} processes were launched; launch "
                f"NGPU={math.prod(deg.values())} or set data_parallel_shard_degree = -1 (the rest)"
            )
    elif deg["data_parallel_shard_degree"] == -1:
        deg["data_parallel_shard_degree"] = 1
    if _ours(config):
        for key in (
            "expert_parallel_degree",
            "expert_tensor_parallel_degree",
        ):
            if getattr(p, key) != 1:
                raise bad(
                    "parallelism",
                    key,
                    getattr(p, key),
                    "is not supported by boost_titan models (dense blocks, no experts); use 1",
                )
    rep, shard = deg["data_parallel_replicate_degree"], deg["data_parallel_shard_degree"]
    if rep > 1 and shard == 1 and math.prod(deg.values()) != rep:
        raise bad(
            "parallelism",
            "data_parallel_replicate_degree",
            rep,
            f"without sharding is plain DDP, which torchtitan cannot combine with other "
            f"parallelism ({layout}); use data_parallel_shard_degree > 1 (HSDP/FSDP) instead",
        )
    if p.pipeline_parallel_degree > 1:
        if p.pipeline_parallel_schedule_csv:
            if world_size is not None and not os.path.isfile(p.pipeline_parallel_schedule_csv):
                raise bad(
                    "parallelism",
                    "pipeline_parallel_schedule_csv",
                    p.pipeline_parallel_schedule_csv,
                    "does not exist",
                    ConfigPathError,
                )
        elif p.pipeline_parallel_schedule.lower() not in {s.lower() for s in PP_SCHEDULES}:
            raise bad(
                "parallelism",
                "pipeline_parallel_schedule",
                p.pipeline_parallel_schedule,
                f"is not valid; choose one of {list(PP_SCHEDULES)}",
            )
        if p.context_parallel_degree > 1 and (
            p.pipeline_parallel_schedule_csv
            or p.pipeline_parallel_schedule.lower() not in {s.lower() for s in CP_PP_SCHEDULES}
        ):
            key = "schedule_csv" if p.pipeline_parallel_schedule_csv else "schedule"
            why = (
                "CP under a pipeline is tested with the named schedules only; use one of "
                f"{list(CP_PP_SCHEDULES)}"
            )
            if not p.pipeline_parallel_schedule_csv:  # a named schedule's own reason
                reasons = {s.lower(): r for s, r in CP_PP_REFUSED.items()}
                why = reasons.get(p.pipeline_parallel_schedule.lower(), why)
            raise bad(
                "parallelism",
                f"pipeline_parallel_{key}",
                getattr(p, f"pipeline_parallel_{key}"),
                f"with context_parallel_degree {p.context_parallel_degree} is not verified "
                f"against one process: {why}",
            )
        _at_least(
            "parallelism",
            "pipeline_parallel_microbatch_size",
            p.pipeline_parallel_microbatch_size,
            1,
        )
        _at_least(
            "parallelism",
            "pipeline_parallel_first_stage_less_layers",
            p.pipeline_parallel_first_stage_less_layers,
            0,
        )
        _at_least(
            "parallelism",
            "pipeline_parallel_last_stage_less_layers",
            p.pipeline_parallel_last_stage_less_layers,
            0,
        )
        if p.pipeline_parallel_layers_per_stage is not None:
            _at_least(
                "parallelism",
                "pipeline_parallel_layers_per_stage",
                p.pipeline_parallel_layers_per_stage,
                1,
            )
    return deg


def _check_batches(config, deg: dict[str, int]) -> None:
    t = config.training
    dp = deg["data_parallel_replicate_degree"] * deg["data_parallel_shard_degree"]
    if t.global_batch_size > 0 and t.global_batch_size % (t.local_batch_size * dp):
        good = [t.local_batch_size * dp * k for k in (1, 2, 4)]
        raise bad(
            "training",
            "global_batch_size",
            t.global_batch_size,
            f"must be a multiple of local_batch_size {t.local_batch_size} x data-parallel degree "
            f"{dp} (gradient accumulation); e.g. {good}, or -1",
        )
    div = deg["tensor_parallel_degree"] * 2 * deg["context_parallel_degree"]
    sections = [("training", t.seq_len)] + (
        [("validation", config.validation.seq_len)] if config.validation.enable else []
    )
    for section, seq_len in sections:
        if seq_len % div:
            raise bad(
                section,
                "seq_len",
                seq_len,
                f"must be divisible by {div} (2 x tensor_parallel_degree "
                f"{deg['tensor_parallel_degree']} x context_parallel_degree "
                f"{deg['context_parallel_degree']}); e.g. {seq_len - seq_len % div or div}",
            )
