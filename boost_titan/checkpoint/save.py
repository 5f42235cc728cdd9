"""A checkpoint save that fails on the disk ends the run with one line.

Full disk (ENOSPC), quota (EDQUOT), I/O error (EIO), no permission (EACCES, EPERM,
EROFS): DCP turns a rank's error into a ``CheckpointException`` that every rank raises
(its write step gathers each rank's result on the coordinator and broadcasts the
verdict), and torch's zip writer hides the OS error itself: ``torch.save`` into a file
whose ``write`` raises ENOSPC reports ``[enforce fail at inline_container.cc:672] .
unexpected pos 704 vs 598`` (the 165-line trace of a full disk). Here:

* every file DCP writes goes through :class:`_GuardedFile`, which keeps the first
  ``OSError`` a write raises; when the write fails the error leaves the file's ``with``
  block as that ``OSError`` (errno, file), so DCP passes it on to every rank;
* :class:`SaveGuard` guards the checkpoint manager's ``dcp_save`` (and, for
  ``checkpoint.async_mode = "async"``, the wait on the save in flight, where its error
  surfaces at the next save): on a disk error, with every rank holding the same
  verdict, it measures what the checkpoint needs (``checkpoint_space``: the state dict
  being saved, every rank's), rank 0 removes the partial step folder, all ranks meet
  at a barrier, and every rank raises :class:`CheckpointSaveError`: the errno's name,
  the file and rank, the bytes needed and free (``os.statvfs``), the previous
  checkpoint (untouched by a failed save: torchtitan purges old ones only after a
  save succeeds) and what to do. It is a ``SystemExit`` (code 1): the run stops on the
  line, without a traceback, and torchelastic's ``@record`` on ``Trainer.train`` does
  not copy a traceback into torchrun's failure report;
* where no guarded file saw the error (a writer of another kind) and only the zip
  writer's message is left, the errno is inferred from the free space after the
  failure, and the line says so;
* ``BOOST_TITAN_INJECT=enospc@S[:rank=R]`` (``boost_titan.train.fault``) makes the guarded
  files of step S's save on rank R fail with ENOSPC after 64 KiB, as a full disk
  does, so the whole path above runs as for a real one.

``checkpoint.async_mode = "async_with_pinned_mem"`` writes from a separate (spawned)
process where no guarded file is installed: its failure reaches the next save's wait
as DCP's exception and becomes the same line (the errno named where the OS error
itself came back, else inferred from free space); its injection does not fire there.
That mode needs a GPU (torchtitan's pinned staging asserts an accelerator): untested
on CPU.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.api import CheckpointException

from boost_titan.checkpoint import space
from boost_titan.checkpoint.space import fmt_bytes

logger = logging.getLogger()  # torchtitan's logger (the root logger)

INJECTED_BUDGET = 64 * 1024  # bytes an injected full disk takes before ENOSPC
# what torch's zip writer says when the file's write raised (its error is not kept)
SERIALIZER_WRITE_FAILURE = re.compile(r"unexpected pos|PytorchStreamWriter failed writing file")

REMEDY = {
    "ENOSPC": "free space on that filesystem (or move --job.dump_folder to a larger disk, "
    "or keep fewer checkpoints: --checkpoint.keep_latest_k)",
    "EDQUOT": "raise your disk quota or free space in it (or move --job.dump_folder)",
    "EACCES": "make the checkpoint folder writable for this user",
    "EPERM": "make the checkpoint folder writable for this user",
    "EROFS": "the filesystem is read-only: move --job.dump_folder to a writable one",
}


class CheckpointSaveError(SystemExit):
    """A failed save as one line; exits with code 1 without a traceback."""

    def __init__(self, line: str):
        super().__init__(1)
        self.line = line

    def __str__(self) -> str:
        return self.line


# ---------------------------------------------------------------- the files DCP writes


_enospc_steps: set[int] = set()  # this rank's injected full disks (step numbers)
_injected_left: dict[str, int] = {}  # step folder -> bytes the injected disk still takes
_injection_logged: set[str] = set()  # step folders whose injected ENOSPC was logged
_rank = 0


class _GuardedFile:
    """A file DCP writes, passed through; keeps the first OSError of a write."""

    def __init__(self, raw, path: str):
        self._raw = raw
        self.path = path
        self.error: OSError | None = None
        m = re.fullmatch(r"step-(\d+)", os.path.basename(os.path.dirname(path)))
        self._folder = os.path.dirname(path)
        self._injected = m is not None and int(m.group(1)) in _enospc_steps
        if self._injected:
            _injected_left.setdefault(self._folder, INJECTED_BUDGET)

    def _full(self) -> OSError:
        if self._folder not in _injection_logged:
            _injection_logged.add(self._folder)
            logger.warning(f"[inject] rank {_rank}: ENOSPC while writing {self.path}")
        code = errno.ENOSPC
        return OSError(code, f"{os.strerror(code)} [injected: BOOST_TITAN_INJECT]", self.path)

    def write(self, data) -> int:
        try:
            if self._injected:
                view = memoryview(data).cast("B")
                left = _injected_left[self._folder]
                if len(view) > left:
                    self._raw.write(view[:left])  # what fits, as a full disk takes it
                    _injected_left[self._folder] = 0
                    raise self._full()
                _injected_left[self._folder] = left - len(view)
            return self._raw.write(data)
        except OSError as e:
            if self.error is None:
                self.error = e
            raise

    def close(self) -> None:
        # a file that fit in the injected budget fails when closed, as a disk that
        # allocates late (NFS, delayed allocation) reports it: the injection always fires
        if self._injected and self.error is None and not self._raw.closed:
            _injected_left[self._folder] = 0
            self.error = self._full()
            self._raw.close()
            raise self.error
        self._raw.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._raw, name)


_original_create_stream = None


def install_guarded_files(rank: int, enospc_steps: set[int]) -> None:
    """Route the files DCP's FileSystem writes through :class:`_GuardedFile`
    (idempotent; reads pass through untouched)."""
    global _original_create_stream, _rank
    _rank = rank
    _enospc_steps.clear()
    _enospc_steps.update(enospc_steps)
    if _original_create_stream is not None:
        return
    original = _original_create_stream = dcp_filesystem.FileSystem.create_stream

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        with original(self, path, mode) as raw:
            if "r" in mode:
                yield raw
                return
            guarded = _GuardedFile(raw, str(path))
            try:
                yield guarded
            except OSError:
                raise
            except BaseException as e:
                if guarded.error is None:
                    raise
                # torch's zip writer reports a failed write as "unexpected pos": the
                # OS error it lost is the one to pass on
                err = guarded.error
                raise OSError(err.errno, err.strerror, str(path)) from e

    dcp_filesystem.FileSystem.create_stream = create_stream


# ---------------------------------------------------------------- what went wrong


def _failures(exc: BaseException) -> tuple[dict[int, BaseException], bool]:
    """Each failing rank's exception; whether every rank holds the same verdict (DCP's
    CheckpointException is raised on every rank)."""
    if isinstance(exc, CheckpointException):
        return {rank: e for rank, (e, _trace) in exc.failures.items()}, True
    return {dist.get_rank() if dist.is_initialized() else 0: exc}, False


def _os_error(exc: BaseException) -> OSError | None:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def disk_errors(exc: BaseException) -> tuple[dict[int, BaseException], bool] | None:
    """The ranks' disk errors in a failed save (an OSError with an errno, or the zip
    writer's message of a lost one), or None when the save failed otherwise."""
    failures, agreed = _failures(exc)
    disk = {
        rank: _os_error(e) or e
        for rank, e in failures.items()
        if _os_error(e) is not None or SERIALIZER_WRITE_FAILURE.search(str(e))
    }
    return (disk, agreed) if disk else None


def describe(
    errors: dict[int, BaseException], free_after_failure: int, still_to_write: int
) -> tuple[str, str]:
    """(errno name, ``NAME (strerror) writing FILE on rank R``)."""
    ranks = sorted(errors)
    where = f"on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    named = {r: e for r, e in sorted(errors.items()) if isinstance(e, OSError)}
    if named:
        e = next(iter(named.values()))
        name = errno.errorcode.get(e.errno, f"errno {e.errno}")
        # an OSError may carry no file name (a write on a bare descriptor, a flush):
        # which rank's does is a race when both fill the same disk
        files = [
            f"{os.path.basename(str(x.filename))} (rank {r})"
            for r, x in named.items()
            if x.filename
        ]
        unnamed = [r for r, x in named.items() if not x.filename]
        if unnamed:
            s = "s" if len(unnamed) > 1 else ""
            files.append(f"an unnamed file on rank{s} {', '.join(map(str, unnamed))}")
        target = f" writing {', '.join(files)}" if len(unnamed) < len(named) else f" {where}"
        return name, f"{name} ({e.strerror}){target}"
    # only torch's zip writer's message is left: ask the filesystem
    if free_after_failure < still_to_write:
        return "ENOSPC", (
            f"ENOSPC (No space left on device) {where}: torch's serializer hid the OS error "
            f"('{str(next(iter(errors.values()))).strip()[:80]}'); inferred from "
            f"{fmt_bytes(free_after_failure)} free after the failed write, less than the "
            f"{fmt_bytes(still_to_write)} still to write"
        )
    return "an unnamed I/O error", (
        f"an unnamed I/O error {where}: torch's serializer hid the OS error "
        f"('{str(next(iter(errors.values()))).strip()[:80]}'); not a full disk: "
        f"{fmt_bytes(free_after_failure)} free, enough for the {fmt_bytes(still_to_write)} "
        "still to write"
    )


def _folder_bytes(path: str) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(root, f))
    return total


# ---------------------------------------------------------------- the checkpointer


class SaveGuard:
    """The checkpoint manager's saves, guarded (see the module docstring): it calls
    :meth:`dcp_save` and :meth:`async_wait` with torchtitan's own."""

    def __init__(self, checkpointer, estimated_bytes: int | None = None, current_step=None):
        self.ckpt = checkpointer
        self.current_step = current_step  # () -> the trainer's step (async: when noticed)
        self.estimated_bytes = estimated_bytes  # the start-time figure (lone errors)
        self.pending: tuple[str, dict] | None = None  # an async save in flight

    def dcp_save(self, save, state_dict, checkpoint_id, async_mode, *args, **kwargs):
        try:
            ret = save(state_dict, checkpoint_id, async_mode, *args, **kwargs)
        except BaseException as e:
            self.fail(e, checkpoint_id, state_dict)
            raise
        if ret is not None:  # async: its error surfaces in _async_wait
            self.pending = (checkpoint_id, state_dict)
        return ret

    def async_wait(self, wait) -> None:
        try:
            wait()
            if self.ckpt.save_future is None:  # waited for and done (async mode)
                self.pending = None
        except BaseException as e:
            if self.pending is not None:
                checkpoint_id, state_dict = self.pending
                self.pending = None
                noticed = self.current_step() if self.current_step else "a later step"
                self.fail(e, checkpoint_id, state_dict, f" (async; noticed at step {noticed})")
            raise

    def fail(
        self, exc: BaseException, checkpoint_id: str, state_dict: dict, note: str = ""
    ) -> None:
        """Raise CheckpointSaveError for a disk error; return for anything else."""
        found = disk_errors(exc)
        if found is None:
            return
        errors, agreed = found
        rank = dist.get_rank() if dist.is_initialized() else 0
        m = re.search(r"step-(\d+)$", str(checkpoint_id).rstrip("/"))
        step = m.group(1) if m else "?"
        if agreed:  # every rank is here, with the same verdict
            items, _ = space.local_items(state_dict, predict_optimizer=False)
            needed = space.total_bytes(space.global_items(items))
        else:
            needed = self.estimated_bytes or 0
        free_now = space.free_bytes(checkpoint_id)
        name, what = describe(errors, free_now, needed - _folder_bytes(checkpoint_id))
        if agreed:
            fate = f"the partial folder {checkpoint_id} was removed"
            if rank == 0 and os.path.isdir(checkpoint_id):
                try:
                    shutil.rmtree(checkpoint_id)
                except OSError as e:
                    fate = f"the partial folder {checkpoint_id} could not be removed ({e})"
            if dist.is_initialized():
                dist.barrier()  # nobody exits before the partial folder is gone
        else:  # only this rank knows: the others may still be writing there
            fate = (
                f"the partial folder {checkpoint_id} is left (other ranks may still write to "
                "it) and set aside at the next start"
            )
        free = space.free_bytes(checkpoint_id)
        prev_step = self.ckpt._find_load_step()
        if prev_step >= 0 and str(prev_step) != step:
            previous = (
                f"previous checkpoint: {self.ckpt._create_checkpoint_id(prev_step)} (intact: "
                f"a failed save touches no other step); rerun the same command to resume "
                f"from step {prev_step}"
            )
        else:
            previous = "no previous checkpoint in this folder: a rerun starts from step 0"
        remedy = REMEDY.get(name, "check the disk (dmesg, the storage's health)")
        line = (
            f"checkpoint save of step {step} failed{note}: {what}; {fate}. The checkpoint needs "
            f"{fmt_bytes(needed)}; {os.path.dirname(str(checkpoint_id))} has "
            f"{fmt_bytes(free)} free now (os.statvfs). {previous[0].upper()}{previous[1:]}. "
            f"To go on: {remedy}."
        )
        raise CheckpointSaveError(line) from None


# ---------------------------------------------------------------- wiring


def guard(trainer, injector) -> SaveGuard | None:
    """The guard of the trainer's checkpoint saves (None: the run saves nothing), after
    checking that the run's checkpoints fit on their disk (warn if not). Collective:
    call on every rank."""
    ckpt = trainer.checkpointer
    if not ckpt.enable or ckpt.load_only:
        return None
    config = trainer.job_config
    rank = dist.get_rank() if dist.is_initialized() else 0
    install_guarded_files(
        rank,
        {i.step for i in injector.injections if i.kind == "enospc" and i.rank in (None, rank)},
    )
    estimated = None
    if not config.checkpoint.create_seed_checkpoint:
        planned = space.plan(ckpt, config)
        estimated = planned.full
        line = planned.line(ckpt.folder, config.checkpoint.keep_latest_k)
        if rank == 0:
            if planned.needed > planned.free:
                logger.warning(
                    f"{line}: NOT ENOUGH: a save will fail with ENOSPC; free space, move "
                    "--job.dump_folder to a larger disk or keep fewer checkpoints "
                    "(--checkpoint.keep_latest_k)"
                )
            else:
                logger.info(line)
    return SaveGuard(ckpt, estimated, lambda: trainer.step)
