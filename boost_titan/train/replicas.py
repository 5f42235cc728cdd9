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

from collections import defaultdict
from datetime import timedelta
from typing import Any

import torch
from torch.distributed import ReduceOp
from torchtitan.tools.logging import logger

#: the key the data position travels under in a peer's state
DATA_KEY = "boost_data_position"


class ReplicaGroups:
    """This process's view of the job's replica groups (one torchft ``Manager``)."""

    def __init__(self, ft_config, *, group_rank: int, group_world_size: int):
        import torchft

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
            # one bound for every wait: a quorum short of min_replica_size, a lighthouse
            # or peer that does not answer (torchft's TORCHFT_*_TIMEOUT_SEC override it)
            quorum_timeout=timeout,
            connect_timeout=timeout,
            rank=group_rank,
            world_size=group_world_size,
            replica_id=f"boost_titan_group_{self.replica_id}",
        )
        self.committed = True  # the last step's decision
        self._step_start_samples: int | None = None

    def attach(self, trainer) -> None:
        """Into the built trainer: the state a recovering peer gets, and either the
        per-step protocol (module docstring) or semi-synchronous training."""
        self.register_state(trainer.checkpointer.states, trainer.dataloader)
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
                logger.warning(
                    f"[fault_tolerance] step not applied: {manager.num_participants()} live "
                    f"replica group(s) of {self.group_size} (min_replica_size "
                    f"{self.min_replica_size}), error: {manager.errored()}"
                )

        def lr_step_if_committed(*args, **kwargs):
            if self.committed:
                lr_step(*args, **kwargs)

        optimizers.zero_grad = quorum_then_zero_grad
        optimizers.step = step_if_committed
        lr_schedulers.step = lr_step_if_committed

    @torch.no_grad()
    def average_gradients(self, model_parts) -> None:
        """Every gradient averaged over the live groups, one all-reduce per dtype. A
        DTensor's local shard is what is averaged: every group has the same layout."""
        grads = defaultdict(list)
        for part in model_parts:
            for p in part.parameters():
                if p.grad is not None:
                    g = p.grad
                    g = g.to_local() if hasattr(g, "to_local") else g
                    grads[g.dtype].append(g)
        for group in grads.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            self.manager.allreduce(flat, reduce_op=ReduceOp.AVG).wait()
            offset = 0
            for g in group:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    def average_loss(self, avg: float, peak: float) -> tuple[float, float]:
        t = torch.tensor([avg], dtype=torch.float64)
        m = torch.tensor([peak], dtype=torch.float64)
        self.manager.allreduce(t, reduce_op=ReduceOp.AVG).wait()
        self.manager.allreduce(m, reduce_op=ReduceOp.MAX).wait()
        return t.item(), m.item()

    # ------------------------------------------------------------------ recovery
    def register_state(self, states: dict[str, Any], loader) -> None:
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
            for k in names:
                states[k].load_state_dict(state[k])
            if DATA_KEY in state:
                loader.seek(state[DATA_KEY])
            logger.info(
                f"[fault_tolerance] group {self.replica_id} recovered from a live group: "
                f"step {getattr(states.get('train_state'), 'step', '?')}"
                + (f", data position {state[DATA_KEY]}" if DATA_KEY in state else "")
            )

        self.manager.register_state_dict_fn("boost_titan", load_state_dict, state_dict)

    def saves_checkpoints(self) -> bool:
        return self.replica_id == 0

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)


def build(job_config, *, group_rank: int, group_world_size: int) -> ReplicaGroups | None:
    ft = job_config.fault_tolerance
    if not ft.enable:
        return None
    return ReplicaGroups(ft, group_rank=group_rank, group_world_size=group_world_size)
