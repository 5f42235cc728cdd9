"""What a run does when something goes wrong: preemption, non-finite steps, cut-off
checkpoints, and fault injection to rehearse all of it.

================  ==================================================  ==============================
event             what happens                                        where
================  ==================================================  ==============================
SIGTERM           every rank finishes its step, a full checkpoint     ``Preemption`` + ``StepGuard``
(preemption,      of that step is saved, the ranks exit 0
torchrun stop)    (``run_train.sh`` too)
NaN/inf loss or   the update is not applied (no optimizer or LR       ``StepGuard``
gradient          step); stop with an error naming the step, or
                  skip under ``[boost] nan_policy = "skip"``
                  (bounded run of skips)
rank dies         torchrun ``--max-restarts`` restarts the ranks;     torchtitan + DCP
(SIGKILL, OOM)    they resume from the newest complete checkpoint
cut-off save      a ``step-N`` folder without DCP's ``.metadata``     ``quarantine_incomplete_
                  (written last, by rename, once every rank's data    checkpoints``
                  is on disk) is never loaded: it is renamed
                  ``step_N.incomplete`` and named in the log
full disk, I/O    the save stops the run with one line: errno name    ``boost_titan.checkpoint.
error, no         (ENOSPC, EDQUOT, EIO, EACCES...), file and rank,    save``; the start-time
permission at     bytes needed and free; the partial folder is        estimate: ``checkpoint.
a save            removed at once, the previous checkpoint named;     space``
                  at start, a warning if the checkpoints the run
                  keeps will not fit in the free space
damaged           a step that fails its seal (a digest, a missing or  ``boost_titan.checkpoint.
checkpoint        foreign file, a bad manifest or .metadata) while    integrity``
                  resuming: rank 0 renames it ``step_N.corrupt`` and
                  every rank loads the newest step that opens (the
                  log names the problem and the steps lost); a named
                  checkpoint fails on one line; the NaN stop names
                  the last checkpoint that verifies
================  ==================================================  ==============================

Both per-step decisions (skip this update? stop for preemption?) must be the same on
every rank or the ranks desynchronise, so they ride in one all-reduce (MAX) of three
flags per step, over the whole world: ``StepGuard.agree``. That is the only collective
this module adds (12 bytes per step), and reading its result the only host sync: the
loss of each micro-batch is checked on the device, and the gradients through the total
norm torchtitan's clipping computes anyway (:func:`reporting_grad_norm`).

Fault injection (``BOOST_TITAN_INJECT``, comma-separated ``KIND@STEP[:rank=R]``):

* ``sigkill@S:rank=R`` rank R SIGKILLs itself after step S, first attempt only
  (``TORCHELASTIC_RESTART_COUNT == 0``), so a restarted job runs through;
* ``nodekill@S:rank=R`` rank R SIGKILLs its torchrun agent (its parent process), then
  itself, after step S, first attempt only: a node lost, as far as the other nodes can
  tell (``tests/test_multinode.py``);
* ``sigterm@S`` after step S, rank 0 sends SIGTERM to the launcher
  (``BOOST_TITAN_LAUNCHER_PID``, set by ``run_train.sh``; else torchrun), which forwards
  it to every rank, as a SLURM preemption does;
* ``nan_loss@S`` step S divides its loss by NaN tokens before backward;
* ``inf_grad@S:rank=R`` after step S's backward, one gradient element on rank R is inf;
* ``enospc@S:rank=R`` the save of step S fails on rank R with ENOSPC after 64 KiB of its
  files, at the file-write level (``boost_titan.checkpoint.save``), as a full disk does.

Without ``:rank=R`` an injection fires on every rank (sigterm: rank 0 only). Rank 0
lists every injection at start, whichever rank it fires on: the console shows rank 0's
log only (``LOG_RANK``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import os
import re
import signal
import time

import torch
import torch.distributed as dist

logger = logging.getLogger()  # torchtitan's logger (the root logger); not imported from
# torchtitan so that this module imports without it (torchtitan fixes its device at import)

INJECT_ENV = "BOOST_TITAN_INJECT"
INJECT_KINDS = ("sigkill", "nodekill", "sigterm", "nan_loss", "inf_grad", "enospc")
STATUS_FILE_ENV = "BOOST_TITAN_STATUS_FILE"  # run_train.sh: preemption -> exit 0
FAILED = "failed: "  # a status line run_train.sh repeats last (and torchrun.py's report is cut)
LAUNCHER_PID_ENV = "BOOST_TITAN_LAUNCHER_PID"


def report_failure(line: str) -> None:
    """A failure this run explains in one line, for the launcher of this node
    (``run_train.sh``'s status file): written by local rank 0, once per node."""
    path = os.environ.get(STATUS_FILE_ENV)
    if path and os.environ.get("LOCAL_RANK", "0") == "0":
        with contextlib.suppress(OSError), open(path, "w") as f:
            f.write(FAILED + line.replace("\n", " ") + "\n")


def clear_failure() -> None:
    """Forget an earlier attempt's line (a run torchrun restarted: its new failure, if
    any, is its own); local rank 0, at start."""
    if explained_failure() is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        with contextlib.suppress(OSError), open(os.environ[STATUS_FILE_ENV], "w"):
            pass


def explained_failure() -> str | None:
    """The line :func:`report_failure` wrote on this node, if any."""
    path = os.environ.get(STATUS_FILE_ENV)
    try:
        with open(path or "") as f:
            text = f.read()
    except OSError:
        return None
    return text[len(FAILED) :].strip() if text.startswith(FAILED) else None


# ---------------------------------------------------------------- fault injection


@dataclasses.dataclass(frozen=True)
class Injection:
    kind: str
    step: int
    rank: int | None


def parse_injections(spec: str) -> list[Injection]:
    """``"sigkill@5:rank=1,nan_loss@3"`` -> injections; a clear error on anything else."""
    out = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        m = re.fullmatch(r"(\w+)@(\d+)(?::rank=(\d+))?", item)
        if not m or m.group(1) not in INJECT_KINDS:
            raise ValueError(
                f"{INJECT_ENV}: {item!r} is not KIND@STEP[:rank=R] "
                f"with KIND in {list(INJECT_KINDS)}"
            )
        out.append(
            Injection(m.group(1), int(m.group(2)), None if m.group(3) is None else int(m.group(3)))
        )
    return out


def describe_injection(i: Injection) -> str:
    where = "every rank" if i.rank is None else f"rank {i.rank}"
    return {
        "sigkill": f"{where} SIGKILLs itself after step {i.step} (first attempt only)",
        "nodekill": f"{where} SIGKILLs its torchrun agent and itself after step {i.step} "
        "(first attempt only)",
        "sigterm": f"rank 0 sends SIGTERM to the launcher after step {i.step}",
        "nan_loss": f"NaN loss at step {i.step} on {where}",
        "inf_grad": f"an inf gradient after step {i.step}'s backward on {where}",
        "enospc": f"the save of step {i.step} fails with ENOSPC on {where}",
    }[i.kind]


class FaultInjector:
    def __init__(self, spec: str, rank: int):
        self.injections = parse_injections(spec)
        self.rank = rank
        # every rank parses the same spec; rank 0's log (the console's) lists them all
        if self.injections and rank == 0:
            logger.warning(
                f"{INJECT_ENV}={spec!r}: faults will be injected: "
                + "; ".join(describe_injection(i) for i in self.injections)
            )

    def fires(self, kind: str, step: int) -> bool:
        return any(
            i.kind == kind and i.step == step and i.rank in (None, self.rank)
            for i in self.injections
        )

    def after_step(self, step: int) -> None:
        """Signals, sent once step ``step`` (and its checkpoint) is done."""
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if self.fires("sigkill", step) and first_attempt:
            logger.warning(f"[inject] rank {self.rank}: SIGKILL after step {step}")
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fires("nodekill", step) and first_attempt:
            # torchrun starts each rank in a session of its own: the agent's death alone
            # would leave the rank training on
            logger.warning(
                f"[inject] rank {self.rank}: SIGKILL to its agent and itself after step {step}"
            )
            os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        if self.fires("sigterm", step) and self.rank == 0:
            target = int(os.environ.get(LAUNCHER_PID_ENV) or os.getppid())
            logger.warning(f"[inject] SIGTERM to pid {target} after step {step}")
            os.kill(target, signal.SIGTERM)

    def poison_loss_scale(self, step: int, global_valid_tokens: torch.Tensor) -> torch.Tensor:
        if self.fires("nan_loss", step):
            logger.warning(f"[inject] rank {self.rank}: NaN loss at step {step}")
            return global_valid_tokens * float("nan")
        return global_valid_tokens

    def poison_grads(self, step: int, model_parts) -> None:
        if not self.fires("inf_grad", step):
            return
        for p in (p for m in model_parts for p in m.parameters()):
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                with torch.no_grad():
                    grad.view(-1)[0] = float("inf")
                logger.warning(f"[inject] rank {self.rank}: inf gradient at step {step}")
                return


# ---------------------------------------------------------------- preemption


class Preemption:
    """SIGTERM only raises a flag: the step in flight finishes, and ``StepGuard`` turns
    the flag into a decision every rank shares (ranks get the signal at different
    moments). Installed only when checkpointing is on: without checkpoints there is
    nothing to save, so SIGTERM keeps its default (terminate)."""

    def __init__(self):
        self.requested = False
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame) -> None:
        if not self.requested:
            # no logging here: a signal handler may interrupt the logger itself
            os.write(
                2,
                (
                    f"[boost_titan] SIGTERM on pid {os.getpid()}: checkpoint after this step\n"
                ).encode(),
            )
        self.requested = True


# ---------------------------------------------------------------- the per-step guard


class NonFiniteStepError(RuntimeError):
    pass


class StepGuard:
    """Wraps the trainer's ``optimizers.step`` and ``lr_schedulers.step``: before the
    update, every rank contributes (non-finite loss here?, non-finite gradients here?,
    SIGTERM seen here?) to one MAX all-reduce; a non-finite step applies neither the
    optimizer nor the LR scheduler (as Megatron does), then stops or is skipped per
    ``nan_policy``.

    Nothing here waits for the device before that all-reduce: each micro-batch's loss
    adds to a flag on the device (:meth:`record_loss`), and the gradients are judged by
    the total norm torchtitan's ``clip_grad_norm_`` returns (:meth:`record_grad_norm`),
    non-finite exactly when some gradient is. That norm is reduced over the TP, FSDP and
    PP ranks already; what only one rank's norm shows (a DDP replica's own gradients, an
    ``inf_grad`` injection there) reaches the others through the flags' all-reduce. A
    step whose norm was not recorded gets one norm pass of its own
    (:meth:`_local_grads_nonfinite`). The loss is checked too: an inf loss can have
    finite gradients (ranks without the last pipeline stage report a finite
    placeholder)."""

    def __init__(
        self, trainer, policy: str, max_consecutive_skips: int, preemption: Preemption | None
    ):
        self.trainer = trainer
        self.policy = policy
        self.max_consecutive_skips = max_consecutive_skips
        self.preemption = preemption
        # this rank, this step (reset after each decision): on the device, never read
        # per micro-batch
        self._loss_nonfinite: torch.Tensor | None = None
        self._grad_norm: torch.Tensor | None = None
        self.consecutive_skips = 0
        self.skipped_steps: list[int] = []
        self.preempt_agreed = False
        self._update_skipped = False
        self._optimizer_step = trainer.optimizers.step
        self._scheduler_step = trainer.lr_schedulers.step
        trainer.optimizers.step = self._guarded_optimizer_step
        trainer.lr_schedulers.step = self._guarded_scheduler_step

    def record_loss(self, loss: torch.Tensor) -> None:
        """One micro-batch's loss, or-ed into this step's flag without a host sync."""
        nonfinite = ~torch.isfinite(_local(loss.detach())).all()
        if self._loss_nonfinite is not None:
            nonfinite = nonfinite | self._loss_nonfinite
        self._loss_nonfinite = nonfinite

    def record_grad_norm(self, total_norm: torch.Tensor) -> None:
        """This step's total gradient norm, as torchtitan's ``clip_grad_norm_`` returns it."""
        self._grad_norm = _local(total_norm.detach())

    def _grads_nonfinite(self) -> torch.Tensor:
        if self._grad_norm is not None:
            return ~torch.isfinite(self._grad_norm)
        return self._local_grads_nonfinite()

    def _local_grads_nonfinite(self) -> torch.Tensor:
        """Whether this rank's gradients hold a NaN or inf, as a device flag: one norm
        pass over them, for steps whose norm torchtitan did not compute."""
        grads = [
            _local(g)
            for g in (p.grad for m in self.trainer.model_parts for p in m.parameters())
            if g is not None
        ]
        grads = [g for g in grads if g.numel()]
        if not grads:
            return torch.zeros((), dtype=torch.bool, device=self.trainer.device)
        return ~torch.isfinite(torch.stack([n.float() for n in torch._foreach_norm(grads)]).sum())

    def agree(self) -> tuple[bool, bool]:
        """(non-finite anywhere, SIGTERM seen anywhere), the same on every rank: the
        step's one host sync."""
        device = self.trainer.device
        loss_nonfinite = self._loss_nonfinite
        if loss_nonfinite is None:  # no micro-batch recorded: nothing to judge
            loss_nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        preempt = self.preemption is not None and self.preemption.requested
        flags = torch.stack(
            [
                loss_nonfinite.to(device=device, dtype=torch.int32),
                self._grads_nonfinite().to(device=device, dtype=torch.int32),
                torch.full((), int(preempt), dtype=torch.int32, device=device),
            ]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        self._loss_nonfinite = self._grad_norm = None
        loss_flag, grad_flag, preempt_flag = flags.tolist()
        return bool(loss_flag or grad_flag), bool(preempt_flag)

    def _guarded_optimizer_step(self, *args, **kwargs) -> None:
        step = self.trainer.step
        nonfinite, preempt = self.agree()
        self.preempt_agreed |= preempt
        self._update_skipped = nonfinite
        if not nonfinite:
            self.consecutive_skips = 0
            return self._optimizer_step(*args, **kwargs)
        self.trainer.optimizers.zero_grad()
        self.consecutive_skips += 1
        self.skipped_steps.append(step)
        if self.policy == "skip" and self.consecutive_skips <= self.max_consecutive_skips:
            logger.warning(
                f"step {step}: non-finite loss or gradients; update skipped "
                f"({self.consecutive_skips} in a row, limit {self.max_consecutive_skips}; "
                f"{len(self.skipped_steps)} skipped so far: {self.skipped_steps})"
            )
            return None
        why = (
            f"{self.consecutive_skips} non-finite steps in a row exceed "
            f"[boost] nan_max_consecutive_skips = {self.max_consecutive_skips}"
            if self.policy == "skip"
            else '[boost] nan_policy = "stop"; set nan_policy = "skip" to skip such steps'
        )
        last, failed = self._last_checkpoint()
        raise NonFiniteStepError(
            f"step {step}: non-finite loss or gradients (NaN/inf); the update was not "
            f"applied and the run stops ({why}). Last checkpoint: {last or 'none'} "
            f"(untouched{failed}). A NaN caused by the data recurs on resume: skip it with "
            '[boost] nan_policy = "skip", or lower the learning rate.'
        )

    def _guarded_scheduler_step(self) -> None:
        if not self._update_skipped:
            self._scheduler_step()

    def _last_checkpoint(self) -> tuple[str | None, str]:
        """(the newest checkpoint that verifies, a note naming newer ones that do not).
        Rank 0 reads the checkpoint through (``boost_titan.checkpoint.integrity``): the message
        must not send a restart to a corrupted one; the other ranks name the newest."""
        ckpt = self.trainer.checkpointer
        if not ckpt.enable:
            return None, ""
        if dist.is_initialized() and dist.get_rank() != 0:
            step = ckpt._find_load_step()
            return (None if step < 0 else ckpt._create_checkpoint_id(step)), ""
        from boost_titan.checkpoint import integrity

        last, failed = integrity.newest_verified(ckpt.folder)
        return last, "".join(f"; newer, failed verification: {line}" for line in failed)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a NaN or inf in any shard makes the whole non-finite,
    and the flags' all-reduce tells the other ranks), a plain tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


# ---------------------------------------------------------------- the step's grad norm
_norm_receiver = None  # the StepGuard of the train step in flight (:func:`grad_norms_to`)


def reporting_grad_norm(clip_grad_norm_):
    """torchtitan's ``clip_grad_norm_``, its total norm also handed to the
    :class:`StepGuard` of the train step in flight, which then needs no gradient pass of
    its own (``boost_titan.train.trainer.install`` puts it in torchtitan)."""
    if getattr(clip_grad_norm_, "reports_grad_norm", False):
        return clip_grad_norm_

    @functools.wraps(clip_grad_norm_)
    def clip(*args, **kwargs):
        total_norm = clip_grad_norm_(*args, **kwargs)
        if _norm_receiver is not None:
            _norm_receiver.record_grad_norm(total_norm)
        return total_norm

    clip.reports_grad_norm = True
    return clip


@contextlib.contextmanager
def grad_norms_to(guard: StepGuard):
    """Inside: the norms :func:`reporting_grad_norm` sees go to ``guard``; outside (a
    tool's own clipping, another model) to nobody, so a guard never judges a step by a
    norm of something else."""
    global _norm_receiver
    previous, _norm_receiver = _norm_receiver, guard
    try:
        yield
    finally:
        _norm_receiver = previous


# ---------------------------------------------------------------- cut-off checkpoints


def _is_complete(path: str) -> bool:
    # DCP writes .metadata last (tmp file + rename, after every rank's data is written);
    # torchtitan's HF layout has its index file instead
    return os.path.isfile(os.path.join(path, ".metadata")) or os.path.isfile(
        os.path.join(path, "model.safetensors.index.json")
    )


def quarantine_incomplete_checkpoints(folder: str) -> list[tuple[str, str]]:
    """Rename every ``step-N`` folder under ``folder`` that lacks its commit marker to
    ``step_N.incomplete`` (no longer matched by torchtitan's ``step-(\\d+)``, so it is
    neither loaded nor counted by ``keep_latest_k``). Returns (old, new) paths. Call on
    one rank; the others skip such a folder anyway (torchtitan checks .metadata)."""
    moved = []
    if not os.path.isdir(folder):
        return moved
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"step-(\d+)", name)
        path = os.path.join(folder, name)
        if not m or not os.path.isdir(path) or _is_complete(path):
            continue
        target = os.path.join(folder, f"step_{m.group(1)}.incomplete")
        if os.path.exists(target):
            target += f".{int(time.time())}"
        os.rename(path, target)
        moved.append((path, target))
    return moved
