"""Optimizers: torchtitan's Adam/AdamW, and LORO for W = B A models.

``build_optimizers`` is the train specs' ``build_optimizers_fn``: ``[optimizer] name =
"LORO"`` builds one :class:`~boost_titan.optim.loro.LORO` per model part (each pipeline
stage steps its own layers); any other name goes to torchtitan's builder.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer import build_optimizers as build_torchtitan_optimizers
from torchtitan.tools.logging import logger

from boost_titan.optim.loro import LORO


class LOROContainer(OptimizersContainer):
    """torchtitan's container (checkpointing, LR schedulers) around LORO optimizers."""

    def __init__(self, model_parts: list[nn.Module], loro_kwargs: dict) -> None:
        self.model_parts = model_parts
        self.optimizers = [
            LORO(part, model_dim=part.model_args.dim, **loro_kwargs) for part in model_parts
        ]
        self._validate_length(len(model_parts))
        params = [p for part in model_parts for p in part.parameters() if p.requires_grad]
        self._post_init(params, {k: loro_kwargs[k] for k in ("lr", "betas", "eps", "weight_decay")})
        first = self.optimizers[0]
        _log_rank0(
            f"LORO optimizer: exact (Riemannian) step every {first.exact_every} steps, lazy "
            f"factor steps in between; {sum(len(o.pairs) for o in self.optimizers)} factor "
            f"pairs on this rank ({loro_kwargs['exact_dtype']} exact step)"
        )

    def step(self, *args, **kwargs) -> None:
        super().step(*args, **kwargs)
        done = [o.last_exact for o in self.optimizers if o.last_exact is not None]
        if not done:
            return
        step = self.optimizers[0].loro_step
        pairs, seconds = sum(n for n, _ in done), sum(t for _, t in done)
        _log_rank0(f"LORO exact step at step {step}: {seconds:.2f} s ({pairs} factor pairs)")
        for optimizer in self.optimizers:
            optimizer.last_exact = None


def _log_rank0(line: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        logger.info(line)


def loro_kwargs(config) -> dict:
    return dict(
        lr=config.lr,
        betas=(config.beta1, config.beta2),
        eps=config.eps,
        weight_decay=config.weight_decay,
        exact_every=config.loro_freq,
        lr_scaler=config.loro_lr_scaler,
        refresh=config.loro_refresh,
        restart_warmup=config.loro_restart_warmup,
        exact_dtype=config.loro_exact_dtype,
    )


def build_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager=None):
    if optimizer_config.name != "LORO":
        return build_torchtitan_optimizers(model_parts, optimizer_config, parallel_dims, ft_manager)
    if optimizer_config.early_step_in_backward or (ft_manager and ft_manager.enabled):
        raise ValueError(
            "LORO steps whole factor pairs after backward: set [optimizer] "
            "early_step_in_backward = false and disable [fault_tolerance]"
        )
    return LOROContainer(model_parts, loro_kwargs(optimizer_config))
