"""Microbatches in flight on a pipeline rank at its activation peak, by schedule."""

from __future__ import annotations


def _in_flight(
    schedule, pp_rank: int, stage_ids: list[int], n_mb: int, pp: int, act: dict[int, int]
) -> tuple[list[int], int]:
    """Per local stage, the microbatches whose activations are alive at this rank's
    activation peak, and that peak."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if not isinstance(schedule, PipelineScheduleSingle):
        return _walk_order(schedule.pipeline_order[pp_rank], stage_ids, act)
    name = type(schedule).__name__
    if name == "ScheduleGPipe":
        alive = n_mb
    elif name == "Schedule1F1B":  # warm-up forwards, then one backward per forward
        alive = min(n_mb, pp - stage_ids[0])
    else:
        raise ValueError(f"dry run: no in-flight rule for pipeline schedule {name}")
    return [alive], alive * act[stage_ids[0]]


def _walk_order(actions, stage_ids: list[int], act: dict[int, int]) -> tuple[list[int], int]:
    """Walk a multi-stage schedule's action list: F adds a microbatch to its stage; B
    frees it, or W when the schedule splits backward into I and W."""
    splits = any(a is not None and a.computation_type.value == "W" for a in actions)
    free_on = "W" if splits else "B"
    alive = dict.fromkeys(stage_ids, 0)
    best, best_alive = 0, dict(alive)
    for a in actions:
        if a is None:
            continue
        kind = a.computation_type.value
        if kind == "F":
            alive[a.stage_index] += 1
        elif kind == free_on:
            alive[a.stage_index] -= 1
        total = sum(alive[s] * act[s] for s in stage_ids)
        if total > best:
            best, best_alive = total, dict(alive)
    return [best_alive[s] for s in stage_ids], best
