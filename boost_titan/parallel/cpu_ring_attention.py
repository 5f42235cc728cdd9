"""Context-parallel (ring) attention on CPU ranks: the CPU flash kernel made a ring op.

torch's context parallelism routes ``scaled_dot_product_attention`` on sequence-sharded
DTensors to a ring (``torch.distributed.tensor.experimental._context_parallel``): each
rank attends its queries to every rank's keys/values in turn and merges the partial
outputs with their log-sum-exp. It knows the CUDA kernels only (flash, efficient,
cuDNN). On CPU the dispatcher picks ``aten._scaled_dot_product_flash_attention_for_cpu``,
which has no sharding strategy, so CP fails before the first step. That kernel returns
the log-sum-exp the ring merges with, and its backward takes it back, so it plugs into
torch's own ring (``_templated_ring_attention[_backward]``: the same load balancing,
rotation and merge as on GPUs); what this module adds is only the glue:

======================================================  =================================
op                                                      ring
======================================================  =================================
``_scaled_dot_product_flash_attention_for_cpu``         (out, lse) merged over the ring
``_scaled_dot_product_flash_attention_for_cpu_backward``  dq local, dk/dv rotated home
======================================================  =================================

Placements (the CP mesh, 1-D): q, k, v, out, lse, grads all ``Shard(2)`` (the sequence).

:func:`install` adds the two ops to torch's CP handler table and their sharding rules
to the ones torch registers while CP is on, so they are active exactly when torch's are
(``context_parallel()`` / torchtitan's ``apply_cp_to_attention_module``) and never
otherwise: a sequence-sharded SDPA outside CP would attend within each shard, silently
wrong. ``cpu_runtime.activate()`` installs it; on GPUs nothing here runs.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten
SEQ_DIM = 2  # [batch, heads, seq, head_dim]: where torch's ring splits
FORWARD = aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

_INSTALLED = False


def _ring_forward(mesh, query, key, value, dropout_p=0.0, is_causal=False, *,
                  attn_mask=None, scale=None):  # fmt: skip
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if attn_mask is not None or dropout_p:
        raise NotImplementedError(
            "context parallelism on CPU: attn_mask and dropout are not supported "
            "(the models attend causally without a mask)"
        )
    return cp._templated_ring_attention(
        mesh.get_group(), SEQ_DIM, FORWARD, query=query, key=key, value=value,
        is_causal=is_causal, dropout_p=0.0, scale=scale,
    )  # fmt: skip


def _ring_backward(mesh, grad_out, query, key, value, out, logsumexp, dropout_p=0.0,
                   is_causal=False, *, attn_mask=None, scale=None):  # fmt: skip
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    if attn_mask is not None or dropout_p:
        raise NotImplementedError("context parallelism on CPU: no attn_mask or dropout")
    return cp._templated_ring_attention_backward(
        mesh.get_group(), SEQ_DIM, BACKWARD, grad_out=grad_out, grad_out_name="grad_out",
        query=query, key=key, value=value, out=out, logsumexp=logsumexp,
        is_causal=is_causal, dropout_p=0.0, scale=scale,
    )  # fmt: skip


def _handler(op_call, args, kwargs):
    """torch's ``_sdpa_handler`` for the CPU kernel: propagate (every input already
    ``Shard(2)``), run the ring on the local shards, wrap the outputs."""
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    op_info = dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    dispatcher.sharding_propagator.propagate(op_info)
    sharding = op_info.output_sharding
    if sharding is None or sharding.needs_redistribute:
        raise AssertionError(f"{op_call}: context-parallel inputs must be Shard({SEQ_DIM})")
    ring = _ring_forward if op_call is FORWARD else _ring_backward
    local = ring(op_info.compute_mesh, *op_info.local_args, **op_info.local_kwargs)
    return dispatcher.wrap(local, sharding.output_spec)


def _forward_strategy(op_schema):
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args()
    # outputs (out, lse), then inputs (q, k, v)
    strategies = [[Replicate()] * 5, [Shard(SEQ_DIM)] * 5]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=2)


def _backward_strategy(op_schema):
    from torch.distributed.tensor._op_schema import OpStrategy
    from torch.distributed.tensor._ops.utils import expand_to_full_mesh_op_strategy
    from torch.distributed.tensor.placement_types import Replicate, Shard

    mesh = op_schema.get_mesh_from_args(validate=False)
    tensors = sum(isinstance(a, OpStrategy) for a in op_schema.args_schema)
    # outputs (dq, dk, dv), then inputs (grad_out, q, k, v, out, lse)
    strategies = [[Replicate()] * (3 + tensors), [Shard(SEQ_DIM)] * (3 + tensors)]
    return expand_to_full_mesh_op_strategy(mesh, op_schema, strategies, input_index=3)


def install() -> None:
    """Make torch's CP machinery handle the CPU kernel (idempotent)."""
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.experimental._context_parallel import _sharding_rules as rules

    # handlers: torch merges this dict into DTensor's custom ops when CP turns on
    cp.custom_ops[FORWARD] = _handler
    cp.custom_ops[BACKWARD] = _handler
    register, unregister = rules.register_cp_sharding_rules, rules.unregister_cp_sharding_rules
    ours = [
        (FORWARD, _forward_strategy, RuntimeSchemaInfo(3)),
        (BACKWARD, _backward_strategy, None),
    ]

    def register_with_cpu():
        first = not rules._cp_strategy_contexts
        register()
        if first:
            for op, strategy, schema in ours:
                ctx = rules._op_strategy_context(op, strategy, schema)
                rules._original_strategies[op] = ctx.__enter__()
                rules._cp_strategy_contexts[op] = ctx

    rules.register_cp_sharding_rules = register_with_cpu
    # unregister exits every context in _cp_strategy_contexts: ours included
    del unregister
    _INSTALLED = True
