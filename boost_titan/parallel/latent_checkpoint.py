"""Communication-free low-rank activation checkpointing (``[boost] latent_checkpoint``).

Applied from outside, the way torchtitan applies AC, but one level down: torchtitan
wraps whole blocks; this wraps a low-rank block's *chunk bodies* (the methods named in
``LowRankBlock.CHUNK_BODIES``). A chunk body runs from reduced latents to the next
partial latent and, under BTP, contains no forward collective, so recomputing it in
backward communicates exactly as without checkpointing. What a checkpointed chunk
keeps is its inputs: the reduced latents, their statistics and the residual stream.

``keep = "attention"``: a recomputed attention chunk also keeps the attention kernel's
outputs (d/T wide), so backward does not re-run the chunk's costliest op.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from boost_titan.config import LATENT_CHECKPOINT_CHUNKS, LATENT_CHECKPOINT_KEEP

# The attention kernels (CPU, flash, memory-efficient, cuDNN). Their outputs (output,
# log-sum-exp, RNG state) are what their backward needs besides q, k, v.
ATTENTION_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(torch.ops.aten, name)
)


def _keep_attention_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in ATTENTION_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _keep_attention_context():
    return create_selective_checkpoint_contexts(_keep_attention_policy)


def _recompute_all_context():
    # Recomputes everything, like a plain checkpoint, but through the selective
    # path: under torch.compile (2.13) a plain checkpoint of a region with DTensor
    # to_local/from_local saves the DeviceMesh as if it were a tensor and the
    # compiled forward fails ("expected all tensors_saved_with_vc_check to be Tensors").
    return create_selective_checkpoint_contexts(_recompute_all_policy)


class CheckpointedChunk:
    """A chunk body recomputed in backward. An object rather than a closure so that
    ``copy.deepcopy`` of a model rebinds ``body`` to the copied block."""

    def __init__(self, body, context_fn):
        self.body = body
        self.context_fn = context_fn

    def __call__(self, *args):
        return checkpoint(self.body, *args, use_reentrant=False, context_fn=self.context_fn)


def _unwrap(block: nn.Module) -> None:
    for bodies in block.CHUNK_BODIES.values():
        for name in bodies:
            if isinstance(block.__dict__.get(name), CheckpointedChunk):
                del block.__dict__[name]


def _wrap(block: nn.Module, chunks, keep: str) -> None:
    for chunk in chunks:
        for name in block.CHUNK_BODIES[chunk]:
            keep_attention = keep == "attention" and name == block.ATTENTION_BODY
            context = _keep_attention_context if keep_attention else _recompute_all_context
            # an instance attribute shadows the method: forward calls the wrapper
            setattr(block, name, CheckpointedChunk(getattr(block, name), context))


def apply_latent_checkpointing(
    model: nn.Module,
    mode: str,
    every: int = 1,
    *,
    keep: str = "attention",
    plan: str | None = None,
    norm_mode: str = "online",
    torchtitan_ac: str = "none",
) -> None:
    """Checkpoint the ``mode`` chunks of every ``every``-th low-rank block (replacing
    an earlier call's choice). Refuses the combinations whose chunks would communicate
    or that would checkpoint twice."""
    if keep not in LATENT_CHECKPOINT_KEEP:
        raise ValueError(
            f"[boost] latent_checkpoint_keep = {keep!r} is not valid; "
            f"choose one of {list(LATENT_CHECKPOINT_KEEP)}"
        )
    blocks = [(int(i), b) for i, b in model.layers.items() if b is not None]
    if mode == "none":
        for _, block in blocks:
            if hasattr(block, "CHUNK_BODIES"):
                _unwrap(block)
        return
    args = model.model_args
    problems = []
    if not args.low_rank:
        problems.append("the model is dense (latent checkpointing needs bottleneck blocks)")
    if plan not in (None, "btp"):
        problems.append(
            f"tp_plan {plan!r} communicates inside its chunks; use btp, or "
            "[activation_checkpoint] mode = 'full' for the baselines"
        )
    if plan == "btp" and norm_mode != "online":
        problems.append("rmsnorm = 'sync' all-reduces inside the norm; use 'online'")
    if torchtitan_ac != "none":
        problems.append(
            f"[activation_checkpoint] mode = {torchtitan_ac!r} is also set; use one of the two"
        )
    if problems:
        raise ValueError(f"[boost] latent_checkpoint = {mode!r}: " + "; ".join(problems))
    for layer_id, block in blocks:
        _unwrap(block)
        if layer_id % every == 0:
            _wrap(block, LATENT_CHECKPOINT_CHUNKS[mode], keep)
