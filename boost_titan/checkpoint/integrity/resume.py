"""The trainer's resume past a corrupted checkpoint: the newest step that fails its
checksums is set aside (``step_N.corrupt``) and the one before it loaded."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import cast

from boost_titan.checkpoint.integrity.trailer import ChecksumMismatch, mismatch_in

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault

# ---------------------------------------------------------------- the trainer's resume


def _reraise_as_one_line(exc: BaseException) -> None:
    bad = mismatch_in(exc)
    if bad is not None:
        raise bad from None


def _quarantine(path: str) -> str:
    """Rank 0 renames the step folder ``step-N`` to ``step_N.corrupt`` (torchtitan's
    ``step-(\\d+)`` no longer matches it: neither loaded nor counted by
    ``keep_latest_k``); every rank returns the new name once it is done."""
    import torch.distributed as dist

    distributed = dist.is_initialized()
    outcome: list[object] = [None]
    if not distributed or dist.get_rank() == 0:
        parent, name = os.path.split(path)
        target = os.path.join(parent, name.replace("step-", "step_", 1) + ".corrupt")
        if os.path.exists(target):
            target += f".{int(time.time())}"
        try:
            os.rename(path, target)
            outcome[0] = target
        except OSError as e:
            outcome[0] = e
    if distributed:
        dist.broadcast_object_list(outcome, src=0)  # the others wait for the rename
    if isinstance(outcome[0], OSError):
        raise ChecksumMismatch(
            f"checkpoint {path} is corrupted and could not be set aside: {outcome[0]}"
        )
    return cast(str, outcome[0])


def _reset_optimizer_state(checkpointer) -> None:
    """A model-only step (the seed checkpoint, step 0) loads no optimizer state: clear
    what the failed load put there (DCP copies into the state tensors as it reads, and
    ``get_optimizer_state_dict`` creates the state first), so that the optimizer starts
    empty, as it does when a run starts from its seed checkpoint."""
    optimizers = checkpointer.states.get("optimizer")
    for optimizer in [optimizers, *getattr(optimizers, "optimizers", [])]:
        state = getattr(optimizer, "state", None)
        if hasattr(state, "clear"):
            state.clear()


def load_past_corruption(checkpointer, load: Callable[[int], bool], step: int = -1) -> bool:
    """``load(step)`` (torchtitan's ``CheckpointManager.load``) surviving a corrupted
    newest checkpoint when it resumes from its own folder (the folder exists and no
    ``load_step`` is given: torchtitan then ignores ``initial_load_path``): a checksum
    mismatch on any rank (DCP gives every rank every rank's failure) sets that step
    folder aside as ``step_N.corrupt`` and the load is retried from the newest step
    left, with a warning that names the mismatch and the steps lost. With no older
    step, or when the user named the checkpoint (``initial_load_path``,
    ``load_step``), the load fails on the mismatch's one line.

    A failed load has already copied some items into the model and optimizer state
    (DCP loads in place); the retry overwrites all of them: the planner requires every
    key of the state dict from the older step (``allow_partial_load`` is off), and a
    run's steps hold the same keys; a model-only step 0 resets the optimizer state."""
    # (checkpointing off: torchtitan's manager has no folder, and load does nothing)
    resuming = step == -1 and checkpointer.enable and os.path.exists(checkpointer.folder)
    while True:
        newest = checkpointer._find_load_step() if resuming else -1
        try:
            return load(step)
        except BaseException as e:
            bad = mismatch_in(e)
            if not resuming or newest < 0 or bad is None:
                _reraise_as_one_line(e)
                raise
        moved = _quarantine(checkpointer._create_checkpoint_id(newest))
        older = checkpointer._find_load_step()
        if older < 0:
            raise ChecksumMismatch(
                f"{bad}. It was the only checkpoint left in {checkpointer.folder} (moved "
                f"to {moved}): no verified checkpoint to resume from. Restore a copy of "
                "it, or start over with a new --job.dump_folder"
            ) from None
        logger.warning(
            f"{bad}. Moved it to {moved}; resuming from step {older} instead: "
            f"{newest - older} steps ({older + 1}-{newest}) are trained again"
        )
        if older == 0:
            _reset_optimizer_state(checkpointer)
