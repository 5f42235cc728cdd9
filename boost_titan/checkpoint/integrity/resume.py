"""The trainer's resume past a damaged checkpoint: rank 0 picks the newest step of the
dump folder that opens (``step.open_step``) and belongs to the folder's run
(``checkpoint.run_id``), setting aside (``step_N.corrupt``) each newer one that does
not, and broadcasts its choice; a step that fails while it loads (an item's digest, a
file another rank cannot read) is set aside the same way and the choice made again."""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable

from boost_titan.checkpoint import run_id, safe_metadata
from boost_titan.checkpoint.integrity.blocks import ChecksumMismatch, mismatch_in
from boost_titan.checkpoint.integrity.manifest import METADATA
from boost_titan.checkpoint.integrity.step import HF_INDEX, open_step

logger = logging.getLogger()  # torchtitan's logger (the root logger), as boost_titan.train.fault


def _os_error(exc: BaseException | None) -> OSError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.filename:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _inside(path: str, folder: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(folder)
    return os.path.commonpath([real, base]) == base


def step_failure(exc: BaseException, folder: str | None) -> ChecksumMismatch | None:
    """The damaged step behind a failed load, as one line: a mismatch on any rank (DCP
    gives every rank every rank's failure), or a file inside the step ``folder`` that
    could not be read (a file elsewhere, a corpus file say, is not the step's fault)."""
    bad = mismatch_in(exc)
    if bad is not None:
        return bad
    failures = getattr(exc, "failures", None) or {}
    for e in [exc, *(f for f, _trace in failures.values())]:
        err = _os_error(e)
        if err is not None and folder and _inside(os.fspath(err.filename), folder):
            path = os.fspath(err.filename)
            return ChecksumMismatch(
                f"checkpoint {os.path.dirname(path)} is incomplete: {os.path.basename(path)} "
                f"cannot be read ({err.strerror}); not loaded"
            )
    return None


def _one_line(exc: BaseException, folder: str | None) -> BaseException | None:
    return step_failure(exc, folder) or safe_metadata.refusal_in(exc)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def _on_rank0(compute: Callable[[], object]) -> object:
    """``compute()`` on rank 0, its result on every rank (the others wait for it)."""
    import torch.distributed as dist

    box = [compute() if _rank() == 0 else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return box[0]


def _set_aside(path: str) -> str:
    """Rename the step folder ``step-N`` to ``step_N.corrupt`` (torchtitan's
    ``step-(\\d+)`` no longer matches it: neither loaded nor counted by
    ``keep_latest_k``); a link is renamed, never what it points to."""
    parent, name = os.path.split(path)
    target = os.path.join(parent, name.replace("step-", "step_", 1) + ".corrupt")
    if os.path.lexists(target):
        target += f".{int(time.time())}"
    os.rename(path, target)
    return target


def _complete_steps(folder: str) -> list[int]:
    steps = []
    for name in os.listdir(folder):
        m = re.fullmatch(r"step-(\d+)", name)
        if m and any(os.path.isfile(os.path.join(folder, name, f)) for f in (METADATA, HF_INDEX)):
            steps.append(int(m[1]))
    return sorted(steps, reverse=True)


def _whose(path: str, seal, folder: str, owner: str | None, allow_foreign: bool) -> str | None:
    """Whether the dump folder's step ``path`` (it opened, its manifest ``seal``) is the
    folder's run's: None (it is, or there is no ``owner`` to compare with), a warning
    to log (a step from before run ids; another run's, allowed), or ChecksumMismatch
    (another run's)."""
    if owner is None:
        return None
    recorded = seal.run_id if seal is not None else None
    if recorded is None:
        return (
            f"checkpoint {path} records no run id (saved before boost_titan recorded "
            "them): resumed as this checkpoint folder's own"
        )
    if recorded == owner:
        return None
    line = run_id.foreign_line(path, recorded, owner, folder, allow_foreign)
    if allow_foreign:
        return line
    raise ChecksumMismatch(line)


def _choose(
    folder: str, failed: tuple[str, str] | None, owner: str | None = None, allow: bool = False
) -> tuple:
    """Rank 0: ``("ok", exists, step, [(line, moved)], newest, remark)`` (step -1: none
    left; remark: a line to log about the chosen step, or None), or ``("refused" |
    "error", line)``. ``owner``: the folder's run id (None: not checked); ``allow``:
    ``[checkpoint] allow_foreign_steps``."""
    if failed is not None:  # the step that failed while loading: set aside first
        bad, path = failed
        try:
            notes = [(bad, _set_aside(path))]
        except OSError as e:
            return ("error", f"{bad}; it could not be set aside: {e}")
    else:
        notes = []
    if not os.path.isdir(folder):
        return ("ok", False, -1, notes, -1, None)
    steps = _complete_steps(folder)
    for n in steps:
        path = os.path.join(folder, f"step-{n}")
        try:
            # a link here would be saved through; every file present (rank 0 alone, one
            # listing of the folder, nothing parsed: a step missing a rank's file is passed
            # over here, not after every rank has begun to load it; a file of the wrong
            # size is found by the rank that reads it, and the step set aside the same way)
            opened = open_step(path, allow_link=False, files=True)
            remark = _whose(path, opened.seal, folder, owner, allow)
            return ("ok", True, n, notes, steps[0], remark)
        except ChecksumMismatch as e:
            try:
                notes.append((str(e), _set_aside(path)))
            except OSError as err:
                return ("error", f"{e}; it could not be set aside: {err}")
        except safe_metadata.UntrustedCheckpointError as e:
            return ("refused", str(e))
    return ("ok", True, -1, notes, steps[0] if steps else -1, None)


def _named_whose(path: str, folder: str, owner: str | None, allow: bool) -> str | None:
    """Rank 0, ``[checkpoint] load_step``: the line refusing another run's step (None:
    it is the folder's, or it does not open: the load then fails on that line)."""
    try:
        seal = open_step(path, allow_link=False).seal
    except (ChecksumMismatch, safe_metadata.UntrustedCheckpointError):
        return None
    try:
        remark = _whose(path, seal, folder, owner, allow)
    except ChecksumMismatch as e:
        return str(e)
    if remark:
        logger.warning(remark)
    return None


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


def _named(load: Callable[[int], bool], step: int, folder: str | None) -> bool:
    """A load of a checkpoint the user named (``folder``): any failure of the step is
    one line."""
    try:
        return load(step)
    except BaseException as e:
        line = _one_line(e, folder)
        if line is None or line is e:
            raise
        raise line from None


def load_past_corruption(checkpointer, load: Callable[[int], bool], step: int = -1) -> bool:
    """``load(step)`` (torchtitan's ``CheckpointManager.load``) surviving damaged steps
    when it resumes from its own folder (``step == -1`` and the folder exists; torchtitan
    then ignores ``initial_load_path``): rank 0 chooses the newest step that opens,
    setting aside each newer one with a warning that names the problem and the steps
    trained again, and every rank loads the step it broadcast (``checkpointer.
    _agreed_step``, which the checkpoint manager's ``_find_load_step`` returns). A step
    that fails while it loads is set aside and the choice made again. With no step
    left, or when the user named the checkpoint (``initial_load_path``, ``load_step``),
    the load fails on the problem's one line.

    A failed load has already copied some items into the model and optimizer state
    (DCP loads in place); the retry overwrites all of them: the planner requires every
    key of the state dict from the older step (``allow_partial_load`` is off), and a
    run's steps hold the same keys; a model-only step 0 resets the optimizer state."""
    # torchtitan sets initial_load_path only on an enabled manager
    named = getattr(checkpointer, "initial_load_path", None) or None
    owner = getattr(checkpointer, "run_id", None)  # None: run ids not checked
    allow = bool(getattr(checkpointer, "allow_foreign_steps", False))
    if step != -1 or not checkpointer.enable:
        if step != -1 and checkpointer.enable:
            named = checkpointer._create_checkpoint_id(step)
            line = _on_rank0(lambda: _named_whose(named, checkpointer.folder, owner, allow))
            if line is not None:
                raise ChecksumMismatch(line)
        return _named(load, step, named)
    folder = checkpointer.folder
    failed: tuple[str, str] | None = None
    newest, set_aside, loads_failed = None, [], False
    while True:
        outcome = _on_rank0(lambda f=failed: _choose(folder, f, owner, allow))
        if outcome[0] == "refused":
            raise safe_metadata.UntrustedCheckpointError(outcome[1])
        if outcome[0] == "error":
            raise ChecksumMismatch(outcome[1])
        _, exists, chosen, notes, newest_now, remark = outcome
        if not exists:
            return _named(load, -1, named)  # torchtitan's initial_load_path / fresh start
        newest = newest_now if newest is None else newest
        set_aside += notes
        for line, moved in notes:
            if chosen >= 0:
                logger.warning(
                    f"{line}. Moved it to {moved}; resuming from step {chosen} instead: "
                    f"{newest - chosen} steps ({chosen + 1}-{newest}) are trained again"
                )
        if remark and _rank() == 0:  # (about the step chosen: after those set aside)
            logger.warning(remark)
        if chosen < 0 and set_aside:
            line, moved = set_aside[-1]
            what = (
                f"It was the only checkpoint left in {folder} (moved to {moved})"
                if len(set_aside) == 1
                else f"No checkpoint left in {folder} verifies ({len(set_aside)} set aside as "
                "step_N.corrupt)"
            )
            raise ChecksumMismatch(
                f"{line}. {what}: no verified checkpoint to resume from. Restore a copy of "
                "it, or start over with a new --job.dump_folder"
            )
        if chosen == 0 and loads_failed:
            _reset_optimizer_state(checkpointer)
        checkpointer._agreed_step = chosen
        loading = checkpointer._create_checkpoint_id(chosen) if chosen >= 0 else named
        try:
            return load(-1)
        except BaseException as e:
            bad = step_failure(e, loading)
            if bad is None or chosen < 0:
                line = _one_line(e, loading)
                if line is None or line is e:
                    raise
                raise line from None
        finally:
            checkpointer._agreed_step = None
        loads_failed = True
        failed = (str(bad), checkpointer._create_checkpoint_id(chosen))
