"""Semi-synchronous training across torchft replica groups (``[fault_tolerance]
semi_sync_method = "diloco"`` or ``"local_sgd"``, every ``sync_steps`` = H inner steps):
torchft's ``DiLoCo`` and ``LocalSGD`` (``torchft.local_sgd``) driven by the trainer.

Between two synchronizations each group trains alone: its own batches, its own inner
optimizer (AdamW, LR schedule, clipping, NaN guard as without FT), no traffic across
groups, no quorum; the logged loss is the group's own. After the H-th inner step:

==============  ===================================================================
``diloco``      quorum; the pseudo-gradient (the global parameters of the last sync
                minus this group's) all-reduced (averaged) over the live groups; the
                parameters reset to the global ones and one step of the outer
                optimizer, SGD(lr 0.7, momentum 0.9, Nesterov) as torchtitan's, applied
                with the averaged pseudo-gradient: the new global parameters
``local_sgd``   quorum; the parameters averaged over the live groups
==============  ===================================================================

Each sync all-reduces every parameter once: its bytes per group (each rank's local
shard, count x element size, summed over the group's ranks) are logged at every sync
and written to TensorBoard as ``ft/outer_sync_mib``. The inner optimizer's state is
never synchronized (each group keeps its own moments).

The sync follows the job's step count (after every step that is a multiple of H, a
resumed run's too), not optimizer calls: a step the NaN guard does not apply (``[boost]
nan_policy = "skip"``) still counts, so every group synchronizes at the same step. The
global parameters are taken at the first step, after a checkpoint is loaded. A
checkpoint (group 0's, as without semi-sync) holds group 0's model and inner optimizer,
not the outer optimizer's momentum: a resume starts every group from group 0's state
with the momentum at zero (said in the log at start).
"""

from __future__ import annotations

import torch
from torchtitan.tools.logging import logger

#: torchtitan's outer optimizer (torchtitan/components/ft/manager.py), Nesterov SGD
OUTER_LR = 0.7
OUTER_MOMENTUM = 0.9
#: the TensorBoard scalar of a sync's bytes per group
SYNC_MIB_TAG = "ft/outer_sync_mib"
MIB = 1 << 20


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def sync_bytes(model: torch.nn.Module) -> int:
    """The bytes one sync all-reduces from this rank: every parameter's local shard (a
    pseudo-gradient or a parameter, both of the parameter's dtype)."""
    return sum(_local(p).numel() * _local(p).element_size() for p in model.parameters())


class SemiSync:
    """One replica group's rank of a DiLoCo or LocalSGD run (built by
    ``boost_titan.train.replicas.ReplicaGroups``, which decides the mode)."""

    def __init__(self, method: str, manager, sync_steps: int, model_parts, replica_id: int):
        if len(model_parts) != 1:  # (a pipeline is refused at parse)
            raise ValueError(f"semi-sync training needs one model part, not {len(model_parts)}")
        self.method, self.manager, self.sync_steps = method, manager, sync_steps
        self.model = model_parts[0]
        self.replica_id = replica_id
        self.rank_bytes = sync_bytes(self.model)
        self.group_bytes = self.rank_bytes
        if torch.distributed.is_initialized():  # the group's own ranks (its own torchrun)
            device = next(self.model.parameters()).device
            t = torch.tensor([self.rank_bytes], dtype=torch.int64, device=device)
            torch.distributed.all_reduce(t)
            self.group_bytes = int(t.item())
        self.outer_optimizer: torch.optim.Optimizer | None = None
        self._impl = None  # torchft's DiLoCo / LocalSGD, from the first step on
        self.syncs = 0

    def _start(self, optimizers) -> None:
        from torchft import local_sgd

        if self.method == "diloco":
            params = [p for p in self.model.parameters() if p.requires_grad]
            self.outer_optimizer = torch.optim.SGD(
                params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True
            )
            self._impl = local_sgd.DiLoCo(
                manager=self.manager,
                model_fragments=[self.model],
                inner_optimizer=optimizers,
                outer_optimizer=[self.outer_optimizer],
                sync_every=self.sync_steps,
            )
        else:
            self._impl = local_sgd.LocalSGD(
                manager=self.manager,
                model=self.model,
                optimizer=optimizers,
                sync_every=self.sync_steps,
            )
        logger.info(
            f"[fault_tolerance] {self.method}: replica group {self.replica_id} syncs every "
            f"{self.sync_steps} steps, {self.group_bytes / MIB:.3f} MiB per group per sync"
            + (f" (outer SGD lr {OUTER_LR}, momentum {OUTER_MOMENTUM}, Nesterov)"
               if self.method == "diloco" else "")
        )  # fmt: skip

    def step_started(self, optimizers, step: int) -> None:
        """Before the inner step: a peer may not read the model while it changes."""
        if self._impl is None:  # after any checkpoint load: those are the global weights
            self._start(optimizers)
            # syncs follow the job's step count: after a resume at a step between two
            # syncs, the next one is still at a multiple of sync_steps
            self._impl._local_step = (step - 1) % self.sync_steps
        self.manager.disallow_state_dict_read()

    def step_finished(self, step: int, metrics_logger) -> None:
        """After the inner step (applied or not): torchft's post-step hook, which counts it
        and, at the H-th, synchronizes across the groups."""
        # (called here, not registered on the optimizer: a step the NaN guard skips never
        # reaches the optimizer, and the groups' counts would drift apart)
        self._impl._step_post_hook(None, (), {})
        if self._impl._local_step != 0:
            return
        self.syncs += 1
        mib = self.group_bytes / MIB
        logger.info(
            f"[fault_tolerance] {self.method} sync {self.syncs} at step {step}: "
            f"{mib:.3f} MiB per group ({self.group_bytes} bytes; {self.rank_bytes} from "
            f"this rank), "
            f"{self.manager.num_participants()} live group(s)"
        )
        if metrics_logger is not None:
            metrics_logger.log({SYNC_MIB_TAG: mib}, step=step)
