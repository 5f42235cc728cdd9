"""Replica groups under torchft (``[fault_tolerance] enable = true``): the data-parallel
dimension across groups is torchft's, so a group can die and rejoin while the others
train on.

Each group is its own ``torchrun`` (its own ``WORLD_SIZE``, store and process group:
TP, BTP, FSDP2 live inside it); ``--fault_tolerance.replica_id i`` and ``group_size N``
place it in the job, and the lighthouse (``TORCHFT_LIGHTHOUSE``) forms a quorum of the
live groups at every step. A step across groups, in the order the trainer runs it:

=====================  ==============================================================
``zero_grad``          ``start_quorum``: the live groups agree who takes part in this
                       step (asynchronously: the forward overlaps it); a group behind
                       the others is sent their state (below)
after the last         every gradient averaged over the live groups: one flat buffer
backward of the step   per dtype, ``Manager.allreduce`` (sum / participants). This is
                       the cross-group all-reduce of a step, and the only one
``optimizers.step``    ``should_commit``: the step is applied only where every rank of
                       every live group finished it; otherwise the model, optimizer and
                       LR schedule stay as they were (and the log says why)
logging                the loss averaged (its max: the largest) over the live groups
=====================  ==============================================================

**Recovery from a peer.** A relaunched group starts at torchft step 0 (or at a disk
checkpoint's); the quorum sees it behind and a live group sends it, through torchft's
HTTP transport (rank i of the sender to rank i of the receiver: same layout), the model,
the optimizer, the LR schedule, the train state (step, tokens seen) and its data
position: the global position at the start of the step (``WindowLoader.samples``) plus
the step's global batch, so the rejoined group reads the next step's windows. Its own
batch of the recovery step is discarded (torchft zeroes a healing group's share).

**Data.** The global batch spans the groups: group ``i``'s data-parallel rank ``r`` of
``dp`` reads as rank ``i * dp + r`` of ``group_size * dp`` (``data.loader``). While a
group is down its windows are not trained; the global position still advances by the
whole global batch each step, so a restart of the whole job resumes every group exactly.

**Semi-synchronous training** (``semi_sync_method = "diloco"`` or ``"local_sgd"``):
none of the per-step protocol above runs (no quorum at ``zero_grad``, no gradient
all-reduce, no ``should_commit`` gate, no loss averaged across groups): the groups train
alone and synchronize every ``sync_steps`` steps, with a quorum of their own
(``boost_titan.train.semi_sync``). :meth:`ReplicaGroups.attach` decides which.

**Checkpoints.** Group 0 alone saves (one sealed step per step of the job, one folder
lock); every group loads it at a restart. While group 0 is down no step is saved.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp
from torchtitan.tools.logging import logger

#: the key the data position travels under in a peer's state
DATA_KEY = "boost_data_position"
DIGEST_ENV = "BOOST_TITAN_PARAM_DIGEST"
QUORUM_TIMEOUT = timedelta(seconds=60)
#: the most gradient bytes one cross-group all-reduce carries (one tensor larger than
#: this goes alone)
BUCKET_BYTES = 256 * 2**20


def _bytes(t: torch.Tensor) -> bytes:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def _flat(tree, prefix: str = ""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    elif isinstance(tree, list | tuple):
        for i, v in enumerate(tree):
            yield from _flat(v, f"{prefix}{i}.")
    else:
        yield prefix, tree


def _no_flight_recorder_line(record: logging.LogRecord) -> bool:
    """torchft warns at every new quorum that it cannot reset NCCL's flight recorder
    where torch has none (a CPU build): nothing to act on."""
    return "Unable to reset NCCL flight recorder" not in record.getMessage()


def _buckets(tensors: list[torch.Tensor], limit: int) -> list[list[torch.Tensor]]:
    """Consecutive runs of ``tensors`` of at most ``limit`` bytes each."""
    out: list[list[torch.Tensor]] = []
    size = limit
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append(t)
        size += nbytes
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


class ReplicaGroups:
    """This process's view of the job's replica groups (one torchft ``Manager``)."""

    def __init__(self, ft_config, *, group_rank: int, group_world_size: int):
        import torchft  # (its log level: RUST_LOG, set by boost_titan.train's entry)

        # torchft's Python side logs each quorum and commit at INFO (through torchtitan's
        # handler: two lines per step per rank); its warnings stay, and our own lines say
        # what a user needs (a step not applied, a recovery)
        logging.getLogger("torchft").setLevel(logging.WARNING)
        logging.getLogger("torchft.manager").addFilter(_no_flight_recorder_line)

        timeout = timedelta(milliseconds=ft_config.process_group_timeout_ms)
        if ft_config.process_group == "gloo":
            pg = torchft.ProcessGroupGloo(timeout=timeout)
        else:
            pg = torchft.ProcessGroupNCCL(timeout=timeout)
        self.replica_id, self.group_size = ft_config.replica_id, ft_config.group_size
        self.min_replica_size = ft_config.min_replica_size
        self.semi_sync_method = ft_config.semi_sync_method
        self.sync_steps = ft_config.sync_steps
        self.semi_sync = None  # boost_titan.train.semi_sync.SemiSync, from attach()
        # init_sync=False: every group builds the same seeded weights (or loads the same
        # step), so step 0 needs no transfer; with it torchft zeroes one group's first
        # gradients and the first step differs from the same run without FT
        self.manager = torchft.Manager(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=self.min_replica_size,
            # semi-sync: the quorum is at each sync, and DiLoCo needs it synchronous
            use_async_quorum=self.semi_sync_method is None,
            init_sync=False,
            timeout=timeout,
            # a quorum waits for the live groups to reach their next step (a step's time)
            # and fails the group when it times out: torchft's 60 s, not the collectives'
            # bound (TORCHFT_QUORUM_TIMEOUT_SEC and TORCHFT_CONNECT_TIMEOUT_SEC set them)
            quorum_timeout=QUORUM_TIMEOUT,
            connect_timeout=QUORUM_TIMEOUT,
            rank=group_rank,
            world_size=group_world_size,
            replica_id=f"boost_titan_group_{self.replica_id}",
        )
        self.committed = True  # the last step's decision
        self._step_start_samples: int | None = None

    def attach(self, trainer) -> None:
        """Into the built trainer: the state a recovering peer gets, and either the
        per-step protocol (module docstring) or semi-synchronous training."""
        self.register_state(trainer.checkpointer.states, trainer.dataloader, trainer.model_parts)
        if self.semi_sync_method is None:
            self.gate(trainer.optimizers, trainer.lr_schedulers)
            trainer.metrics_processor.share_replica_loss(self.average_loss)
            return
        from boost_titan.train.semi_sync import SemiSync

        self.semi_sync = SemiSync(
            self.semi_sync_method, self.manager, self.sync_steps, trainer.model_parts,
            self.replica_id,
        )  # fmt: skip
        if trainer.checkpointer.enable:
            logger.warning(
                f"[fault_tolerance] semi_sync_method = {self.semi_sync_method}: a checkpoint "
                "holds group 0's model and inner optimizer, not the outer optimizer's "
                "momentum; a resume starts every group from group 0's state with the "
                "momentum at zero (not an exact resume of every group)"
            )

    # ------------------------------------------------------------------ a step
    def step_started(self, trainer) -> None:
        """Before the step's batch is read: the data position a peer recovering during
        this step continues from."""
        self._step_start_samples = getattr(trainer.dataloader, "samples", None)
        if self.semi_sync is not None:
            self.semi_sync.step_started(trainer.optimizers, trainer.step)

    def last_backward_done(self, model_parts) -> None:
        """After the step's last backward, before clipping: the cross-group gradient
        all-reduce (not in semi-synchronous training: the groups train alone)."""
        if self.semi_sync is None:
            self.average_gradients(model_parts)

    def step_finished(self, step: int, metrics_logger) -> None:
        if self.semi_sync is not None:
            self.semi_sync.step_finished(step, metrics_logger)

    def gate(self, optimizers, lr_schedulers) -> None:
        """torchft's step protocol around the trainer's own optimizer calls (as
        ``torchft.optim.OptimizerWrapper``, on the container torchtitan holds, so the
        checkpointer and the schedules keep their references)."""
        zero_grad, step, lr_step = optimizers.zero_grad, optimizers.step, lr_schedulers.step
        manager = self.manager

        def quorum_then_zero_grad(*args, **kwargs):
            manager.start_quorum()
            zero_grad(*args, **kwargs)

        def step_if_committed(*args, **kwargs):
            self.committed = manager.should_commit()
            if self.committed:
                step(*args, **kwargs)
            else:
                error = manager.errored()
                logger.warning(
                    f"[fault_tolerance] group {self.replica_id}: step not applied, retried "
                    f"from the same data: {manager.num_participants()} live replica group(s) "
                    f"of {self.group_size}, min_replica_size {self.min_replica_size}"
                    + (f"; {_first_line(error.original_exception)}" if error else "")
                )

        def lr_step_if_committed(*args, **kwargs):
            if self.committed:
                lr_step(*args, **kwargs)

        optimizers.zero_grad = quorum_then_zero_grad
        optimizers.step = step_if_committed
        lr_schedulers.step = lr_step_if_committed

    @torch.no_grad()
    def average_gradients(self, model_parts) -> None:
        """Every gradient averaged over the live groups, in buckets of at most
        :data:`BUCKET_BYTES` per dtype (a rank holds one bucket's copy at a time, not a
        second copy of all its gradients). A DTensor's local shard is what is averaged:
        every group has the same layout."""
        grads = defaultdict(list)
        for part in model_parts:
            for p in part.parameters():
                if p.grad is not None:
                    g = p.grad
                    g = g.to_local() if hasattr(g, "to_local") else g
                    grads[g.dtype].append(g)
        for group in grads.values():
            for bucket in _buckets(group, BUCKET_BYTES):
                flat = torch.cat([g.reshape(-1) for g in bucket])
                self.manager.allreduce(flat, reduce_op=ReduceOp.AVG).wait()
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()

    def average_loss(self, avg: float, peak: float) -> tuple[float, float]:
        t = torch.tensor([avg], dtype=torch.float64)
        m = torch.tensor([peak], dtype=torch.float64)
        self.manager.allreduce(t, reduce_op=ReduceOp.AVG).wait()
        self.manager.allreduce(m, reduce_op=ReduceOp.MAX).wait()
        return t.item(), m.item()

    # ------------------------------------------------------------------ recovery
    def register_state(self, states: dict[str, Any], loader, model_parts) -> None:
        """What a live group sends a recovering one: the checkpointer's model,
        optimizer, LR schedule and train state, and the data position after this step."""
        names = [k for k in ("model", "optimizer", "lr_scheduler", "train_state") if k in states]
        optimizer = states.get("optimizer")
        if optimizer is not None and hasattr(optimizer, "init_cache_state_dict"):
            optimizer.init_cache_state_dict()

        def state_dict():
            out = {k: states[k].state_dict() for k in names}
            if self._step_start_samples is not None:
                out[DATA_KEY] = self._step_start_samples + loader.global_batch
            return out

        def load_state_dict(state):
            # (called in should_commit, after backward.) A fresh optimizer's state is made
            # by torch's set_optimizer_state_dict with a step of zero gradients, which it
            # skips when a gradient exists, and then loads nothing, silently: the step's
            # gradients are put aside while the state loads
            params = [p for part in model_parts for p in part.parameters()]
            grads = [p.grad for p in params]
            for p in params:
                p.grad = None
            try:
                for k in names:
                    states[k].load_state_dict(state[k])
            finally:
                for p, g in zip(params, grads):
                    p.grad = g
            if DATA_KEY in state:
                # the next step's windows; and this step's, should it not be committed
                loader.seek(state[DATA_KEY])
                self._step_start_samples = state[DATA_KEY] - loader.global_batch
            received = sum(v.nbytes for _, v in _flat(state) if isinstance(v, torch.Tensor))
            logger.info(
                f"[fault_tolerance] group {self.replica_id} recovered from a live group: "
                f"step {getattr(states.get('train_state'), 'step', '?')}"
                + (f", data position {state[DATA_KEY]}" if DATA_KEY in state else "")
                + f", {received / 2**20:.2f} MiB received by this rank"
            )

        self.manager.register_state_dict_fn("boost_titan", load_state_dict, state_dict)

    def retry_from(self, loader) -> None:
        """After a step that was not committed: its batch again, from the same position."""
        loader.seek(self._step_start_samples)

    def digest(self, model_parts, optimizers, step: int) -> None:
        """``BOOST_TITAN_PARAM_DIGEST=1``: every rank logs a digest of its parameters and
        one of its optimizer state after each committed step (equal across groups once
        they agree: how the tests and a user check that a recovered group trains on the
        same weights)."""
        if os.environ.get(DIGEST_ENV) != "1" or not self.committed:
            return
        params = hashlib.blake2b(digest_size=16)
        for part in model_parts:
            for name, p in part.named_parameters():
                params.update(name.encode())
                params.update(_bytes(p.detach()))
        state = hashlib.blake2b(digest_size=16)
        for key, value in sorted(_flat(optimizers.state_dict())):
            state.update(key.encode())
            state.update(_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
        logger.info(
            f"[fault_tolerance] group {self.replica_id} step {step} params {params.hexdigest()} "
            f"optimizer {state.hexdigest()}"
        )

    def saves_checkpoints(self) -> bool:
        return self.replica_id == 0

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def build(job_config, *, group_rank: int, group_world_size: int) -> ReplicaGroups | None:
    ft = job_config.fault_tolerance
    if not ft.enable:
        return None
    return ReplicaGroups(ft, group_rank=group_rank, group_world_size=group_world_size)
