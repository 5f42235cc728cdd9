"""Saved activations of a variant's step: the bytes autograd keeps from forward to backward."""

from __future__ import annotations

import torch

from boost_titan.perf.bench.variants import lm_loss


def saved_activation_bytes(model, tokens, labels, loss_fn=lm_loss) -> int:
    """Bytes autograd keeps from forward to backward, parameters excluded: the memory
    activation checkpointing trades for recompute (exact, unlike RSS). Each storage
    counts once, however many ops or views keep it; outputs that selective
    checkpointing caches (latent checkpointing's kept attention outputs) count too.
    Compiled variants: what the compiled graphs save (AOTAutograd's partitioner
    decides, selective checkpointing included), seen by the same hook."""
    from unittest import mock

    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.utils.checkpoint import CheckpointPolicy

    from boost_titan.parallel import latent_checkpoint

    owned = set()
    for p in list(model.parameters()) + list(model.buffers()):
        t = p.to_local() if isinstance(p, DTensor) else p
        owned.add(t.untyped_storage().data_ptr())
    kept: dict[int, int] = {}
    total = 0

    def pack(t):
        nonlocal total
        local_t = t.to_local() if isinstance(t, DTensor) else t
        try:
            storage = local_t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError:  # wrapper subclasses (async collective results) own no storage
            total += local_t.numel() * local_t.element_size()
            return t
        if ptr not in owned:
            kept[ptr] = max(kept.get(ptr, 0), nbytes)
        return t

    sac_contexts = latent_checkpoint.create_selective_checkpoint_contexts

    def counting_contexts(policy):
        def counted(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute and decision in (
                CheckpointPolicy.MUST_SAVE,
                CheckpointPolicy.PREFER_SAVE,
            ):
                outputs = (
                    ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
                )
                for t in outputs:
                    if isinstance(t, torch.Tensor):
                        pack(t)
            return decision

        return sac_contexts(counted)

    with (
        loss_parallel(),
        mock.patch.object(
            latent_checkpoint, "create_selective_checkpoint_contexts", counting_contexts
        ),
    ):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(tokens), labels)
        loss.backward()
    return total + sum(kept.values())
