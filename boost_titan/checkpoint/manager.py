"""torchtitan's CheckpointManager, with what it leaves silent or unfinished done. Every
checkpoint behaviour of a run is reached from this class:

==========================  ==========================================  =====================
method                      what boost_titan adds                       where the logic is
==========================  ==========================================  =====================
``load``                    rank 0 picks the newest step that opens,    ``integrity``
                            setting damaged newer ones aside, and
                            broadcasts it; the log says what was
                            loaded (below)
``dcp_load``                the data position checked against this      ``data_position``
                            run's loader (old kinds refused in one line)
``dcp_save``,               a save failing on the disk ends the run     ``save``
``_async_wait``             on one line, the partial folder removed
``save``                    the initial_load_path record; exactly       here
                            keep_latest_k step folders at the end
(every DCP read / write)    steps sealed (manifest) and opened through  ``integrity``,
                            it first; .metadata unpickled with an       ``safe_metadata``
                            allowlist
==========================  ==========================================  =====================

In detail, here:

* **one run per checkpoint folder** (``checkpoint.lock``): rank 0 locks the folder when
  the manager is built, before anything in it is renamed, set aside or loaded; a second
  run on it stops there on one line naming the holder, every rank with it;
* **every step bound to its run** (``checkpoint.run_id``): the folder's run id is read
  at start (none yet: the id of the step the run resumes, else a new one), written
  beside the steps before the first save, recorded in every step's manifest; a resume
  sets another run's step aside unless ``[checkpoint] allow_foreign_steps``
  (``boost_titan.config.Checkpoint``);
* **the log says what was loaded**: one line on rank 0 when a run starts, ``Loaded
  checkpoint PATH (where it came from): full (...) at step N`` or ``... model weights
  only ...``, or ``No checkpoint loaded (why): training starts from fresh weights``;
* **initial_load_path is honoured** when the checkpoint folder exists but holds no
  complete step (torchtitan reads initial_load_path only when the folder does not
  exist, and otherwise starts from fresh weights: a first save cut off and set aside,
  or an empty folder, made a fine-tuning run silently train from scratch);
* **the initial_load_path a run started from is recorded** beside its step folders
  (``boost_titan.checkpoint.folder.RECORD``, at its first save), so the same command
  run again (a requeued or restarted job) resumes its newest step, while another
  initial_load_path over those checkpoints is refused at parse time
  (``boost_titan.train.config_check.checkpoint``);
* **a run ends with exactly keep_latest_k step folders**: torchtitan purges stale
  folders after each interval save, but its final save (``save(last_step=True)``)
  returns before purging, so 8 steps at interval 2 with keep_latest_k 2 ended with
  step-4, step-6 and step-8; here the final save purges and waits until the purge
  thread has deleted every stale folder, before the process group ends.

:func:`install` makes ``torchtitan.train.Trainer`` build this class.
"""

from __future__ import annotations

import os
import re
import threading

import torch.distributed as dist
import torchtitan.train
from torchtitan.components.checkpoint import CheckpointManager, Terminate, purge_thread
from torchtitan.tools.logging import logger

from boost_titan.checkpoint import folder as cf
from boost_titan.checkpoint import integrity, run_id
from boost_titan.checkpoint import lock as folder_lock
from boost_titan.checkpoint import save as checkpoint_save
from boost_titan.checkpoint.data_position import DataPosition
from boost_titan.checkpoint.hf.adapters import finish_hf_save


def _rank0() -> bool:
    return not dist.is_initialized() or dist.get_rank() == 0


def _from_rank0(value):
    """Rank 0's ``value`` on every rank (the others pass None and wait for it)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return value


class BoostCheckpointManager(CheckpointManager):
    _loaded: tuple[str, list[str], bool] | None = None  # (path, training states, from HF)
    _started_from: str | None = None  # the initial_load_path this process loaded
    _recorded = False
    save_guard: checkpoint_save.SaveGuard | None = None  # None: saves unguarded
    data_position: DataPosition | None = None  # None: no per-rank data position
    _lock: folder_lock.FolderLock | None = None  # rank 0's, held for the run
    # the folder's run (rank 0): its run.json's; None while it has none (integrity.resume
    # then compares nothing, and the run takes the id of the step it resumes)
    run_id: str | None = None
    allow_foreign_steps = False
    _run_written = False  # run.json is in the folder (read there, or written)
    writes = True  # False: a replica group other than the one that saves

    def __init__(self, *args, checkpoint_config, states, **kwargs) -> None:
        super().__init__(*args, checkpoint_config=checkpoint_config, states=states, **kwargs)
        # torchft replica groups (boost_titan.train.replicas): one group writes the job's
        # steps and holds the folder; the others load them and never write
        replicas = getattr(states.get("train_state"), "replicas", None)
        self.writes = replicas is None or replicas.saves_checkpoints()
        if self.enable and self.writes:
            self.allow_foreign_steps = getattr(checkpoint_config, "allow_foreign_steps", False)
            self._hold_folder()

    def _hold_folder(self) -> None:
        """Rank 0 locks the checkpoint folder and reads its run id; a refusal (another
        run holds it, its lock file cannot be taken, its run.json is unreadable) stops
        every rank on rank 0's line, before anything in the folder is touched."""
        refusal = None
        if _rank0():
            # (nothing raised past here: the other ranks wait for rank 0's outcome; acquire
            # raises only FolderRefused: a lock it cannot take refuses the run)
            try:
                self._lock = folder_lock.acquire(self.folder)
            except folder_lock.FolderRefused as e:
                refusal = e.line
            else:
                if self._lock.fd is None:
                    logger.warning(
                        f"checkpoint folder {self.folder}: its file system has no locks "
                        f"({self._lock.path}): a second run on this folder would not "
                        "be refused"
                    )
            if refusal is None:
                try:
                    self.run_id = run_id.read(self.folder)
                    self._run_written = self.run_id is not None
                except run_id.BadRunFile as e:
                    refusal = (
                        f"checkpoint folder {self.folder} cannot be resumed: {e}. Restore it, "
                        "or delete it (the run then takes the run id of the step it resumes)"
                    )
        # every rank must agree whether run.json is to be written (a collective, save)
        refusal, self._run_written = _from_rank0((refusal, self._run_written))
        if refusal is not None:
            self.close()
            raise folder_lock.FolderRefused(refusal)

    def close(self) -> None:
        super().close()
        if self._lock is not None:
            self._lock.release()

    def attach(self, trainer, injector) -> None:
        """The run's checkpoint policies, once the trainer is built (collective: every
        rank; the start-time disk-space check happens here)."""
        self.save_guard = checkpoint_save.guard(trainer, injector)
        self.data_position = DataPosition.for_run(trainer.dataloader, trainer.parallel_dims)

    # ------------------------------------------------------------------ load
    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized) -> None:
        if from_hf and os.path.isfile(os.path.join(checkpoint_id, integrity.MANIFEST)):
            self._verify_hf(checkpoint_id)
        if self.data_position is not None:
            state_dict = self.data_position.adapt(state_dict, checkpoint_id, from_hf)
        states = [s for s in cf.TRAINING_STATES if s in state_dict]
        super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        if "train_state" in states:
            self._check_step(checkpoint_id)
        self._loaded = (checkpoint_id, states, from_hf)

    def _verify_hf(self, folder: str) -> None:
        """A sealed Hugging Face folder, checked before any rank reads it: each rank its
        share of the blocks (``integrity.folder_seal``), then every rank the first
        problem any found."""
        if not dist.is_initialized():
            problems = integrity.verify(folder)
        else:
            share = (dist.get_rank(), dist.get_world_size())
            found = [None] * share[1]
            dist.all_gather_object(found, integrity.check(folder, share).problems)
            problems = list(dict.fromkeys(p for lines in found for p in lines))
        if problems:
            raise integrity.ChecksumMismatch(problems[0])

    def _check_step(self, checkpoint_id: str) -> None:
        """A full step-N holds train_state.step N (a whole step copied or linked under
        another step's name fails here if nothing else caught it)."""
        m = re.fullmatch(r"step-(\d+)", os.path.basename(os.path.normpath(checkpoint_id)))
        saved = self.states["train_state"].step
        if m and saved != int(m[1]):
            raise integrity.ChecksumMismatch(
                f"checkpoint {checkpoint_id} is corrupted: its train_state.step is {saved}, "
                f"the folder is step {m[1]} (a step saved under another step's name); not loaded"
            )

    def load(self, step: int = -1) -> bool:
        try:
            return integrity.load_past_corruption(self, self._load_and_report, step)
        finally:
            integrity.release()  # nothing parsed kept for the run (a step's items: GBs)

    _agreed_step: int | None = None  # the step rank 0 chose to resume (integrity.resume)

    def _find_load_step(self, folder: str = "") -> int:
        """The step every rank resumes: rank 0's choice while a load is in progress
        (ranks never list the folder themselves then), else torchtitan's listing."""
        if self._agreed_step is not None and not folder:
            return self._agreed_step
        return super()._find_load_step(folder)

    def _load_and_report(self, step: int = -1) -> bool:
        if not self.enable:
            if _rank0():
                logger.info(
                    "No checkpoint loaded ([checkpoint] enable = false): training starts "
                    "from fresh weights"
                )
            return super().load(step)
        # torchtitan reads initial_load_path only when the folder does not exist
        redirect = (
            bool(self.initial_load_path)
            and step == -1
            and os.path.isdir(self.folder)
            and self._find_load_step() < 0  # rank 0's listing (integrity.resume)
        )
        folder = self.folder
        if redirect:
            self.folder = ""  # os.path.exists("") is False: torchtitan's branch for it
        try:
            loaded = super().load(step)
        finally:
            self.folder = folder
        if loaded and self._loaded and self._loaded[0] == self.initial_load_path:
            self._started_from = self.initial_load_path
        if _rank0():
            self._adopt_run_id(loaded)
            logger.info(self._load_line(loaded, step))
        return loaded

    def _adopt_run_id(self, loaded: bool) -> None:
        """A folder with no run.json that resumed one of its own steps (steps copied
        into a new dump folder to go on there: the way to continue a run elsewhere)
        continues that step's run; a step of initial_load_path is another run's."""
        if self.run_id is not None or not loaded or self._loaded is None:
            return
        path, _states, from_hf = self._loaded
        if from_hf or os.path.dirname(os.path.normpath(path)) != os.path.normpath(self.folder):
            return
        try:
            seal = integrity.open_step(path).seal  # (parsed once: kept until the load ends)
        except integrity.ChecksumMismatch:  # (it loaded: only if changed since)
            return
        self.run_id = seal.run_id if seal is not None else None

    def _load_line(self, loaded: bool, step: int) -> str:
        if not loaded or self._loaded is None:
            return (
                f"No checkpoint loaded (checkpoint folder {self.folder} holds no complete "
                "step-N folder and [checkpoint] initial_load_path is not set): training starts "
                "from fresh weights"
            )
        path, states, from_hf = self._loaded
        if path == self.initial_load_path:
            source = "[checkpoint] initial_load_path"
        elif from_hf:
            source = "[model] hf_assets_path"
        elif step != -1:
            source = "[checkpoint] load_step"
        else:
            source = "the newest step of the dump folder"
        fmt = ", Hugging Face safetensors" if from_hf else ""
        if states:
            at = self.states["train_state"].step if "train_state" in states else 0
            kind = "full" if len(states) == len(cf.TRAINING_STATES) else "partial"
            what = f"{kind} ({', '.join(['model', *states])}) at step {at}"
        else:
            what = "model weights only (optimizer, LR schedule, data position and step start fresh)"
        line = f"Loaded checkpoint {path} ({source}{fmt}): {what}"
        if self.initial_load_path and source != "[checkpoint] initial_load_path":
            why = (
                "this run started from it"
                if cf.started_from(self.folder, self.initial_load_path)
                else "the dump folder's checkpoints come first"
            )
            line += f"; [checkpoint] initial_load_path {self.initial_load_path} not loaded: {why}"
        return line

    # ------------------------------------------------------------------ save
    def dcp_save(self, *args, **kwargs):
        if self.save_guard is None:
            out = super().dcp_save(*args, **kwargs)
        else:
            out = self.save_guard.dcp_save(super().dcp_save, *args, **kwargs)
        if kwargs.get("to_hf"):  # torchtitan's only HF save (_save_last_step) passes keywords
            finish_hf_save(kwargs["checkpoint_id"], self.sd_adapter, self.export_dtype)
        return out

    def _async_wait(self) -> None:
        if self.save_guard is None:
            return super()._async_wait()
        return self.save_guard.async_wait(super()._async_wait)

    def _write_run_id(self) -> None:
        """``run.json`` before the first step is sealed (the save reads it there); a
        failure (a full or read-only disk) ends every rank on rank 0's line."""
        failed = None
        if _rank0():
            self.run_id = self.run_id or run_id.new()  # a new folder: a new run
            try:
                run_id.write(self.folder, self.run_id)
            except OSError as e:
                failed = (
                    f"checkpoint folder {self.folder}: its run record "
                    f"{run_id.FILE} cannot be written ({e.strerror}); no checkpoint saved"
                )
        failed = _from_rank0(failed)
        if failed is not None:
            raise checkpoint_save.CheckpointSaveError(failed)
        self._run_written = True

    def save(self, curr_step: int, last_step: bool = False) -> None:
        if not self.writes:
            return
        saves = self._should_save(curr_step, last_step)
        if saves and not self._run_written:
            self._write_run_id()
        if saves and self._started_from and not self._recorded:
            if _rank0():
                cf.write_record(self.folder, self._started_from)
            self._recorded = True
        super().save(curr_step, last_step)
        if saves and last_step:
            self._purge_now()

    def _purge_now(self) -> None:
        """Delete every step folder beyond keep_latest_k now (rank 0) and wait for it."""
        if self.purge_thread is None:  # keep_latest_k = 0: every checkpoint is kept
            return
        self._purge_stale_checkpoints()  # rank 0 queues the stale folders
        self.purge_queue.put(Terminate())
        self.purge_thread.join()  # the queue is FIFO: every queued folder is deleted
        # a fresh thread, should anything save after this
        self.purge_thread = threading.Thread(
            target=purge_thread, args=(self.purge_queue,), daemon=True
        )
        self.purge_thread.start()


def install() -> None:
    """Trainers built after this use :class:`BoostCheckpointManager`."""
    torchtitan.train.CheckpointManager = BoostCheckpointManager
