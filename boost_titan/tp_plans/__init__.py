"""Tensor-parallel plans, selected by ``[boost] tp_plan``.

fullrank  dense LLaMA-2: torchtitan's Megatron + sequence-parallel plan (baseline)
btp       low-rank models: bottleneck-aware TP (``btp.py``)
vanilla   low-rank models: every factor its own Megatron chunk (``vanilla.py``, baseline)
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from boost_titan.config import LOW_RANK_TP_PLANS
from boost_titan.models.args import LlamaArgs

# the first plan of each architecture is what "auto" picks
PLANS_FOR = {
    "dense": ("fullrank",),
    "svd": LOW_RANK_TP_PLANS,
    "cola": LOW_RANK_TP_PLANS,
    "lax": LOW_RANK_TP_PLANS,
}


def resolve_tp_plan(requested: str, args: LlamaArgs) -> str:
    valid = PLANS_FOR[args.arch]
    if requested == "auto":
        return valid[0]
    if requested not in valid:
        kind = "dense" if args.arch == "dense" else f"low-rank ({args.arch})"
        raise ValueError(
            f"[boost] tp_plan = {requested!r} does not apply to a {kind} model; "
            f"valid plans for it: {list(valid)}"
        )
    return requested


def validate_tp_degree(args: LlamaArgs, tp: int, plan: str) -> None:
    """Divisibility the plan needs, checked on the meta model (before allocation)."""
    if plan == "vanilla":  # splits r (every rank) and the vocab; heads stay whole
        need = {f"rank of {n}": r for n, (_, _, r) in args.projection_shapes().items()}
        need["vocab_size"] = args.vocab_size
    else:
        need = {
            "n_heads": args.n_heads,
            "n_kv_heads": args.kv_heads,
            "dim": args.dim,
            "ffn_dim": args.ffn_dim,
            "vocab_size": args.vocab_size,
        }
    bad = {k: v for k, v in need.items() if v % tp}
    if bad:
        listing = ", ".join(f"{k}={v}" for k, v in bad.items())
        raise ValueError(
            f"tensor_parallel_degree {tp} does not divide {listing} "
            f"(plan {plan!r} splits {', '.join(dict.fromkeys(k.split(' of ')[0] for k in need))} "
            f"across ranks); "
            f"choose a degree dividing all of them"
        )


def apply_tp_plan(
    plan: str, model: nn.Module, tp_mesh: DeviceMesh, *, loss_parallel: bool, job_config
) -> None:
    args: LlamaArgs = model.model_args
    validate_tp_degree(args, tp_mesh.size(), plan)
    if plan == "fullrank":
        from torchtitan.models.llama3.infra.parallelize import apply_tp

        apply_tp(model, tp_mesh, loss_parallel=loss_parallel, enable_float8_tensorwise_tp=False)
    elif plan == "btp":
        from .btp import apply_btp

        b = job_config.boost
        apply_btp(
            model,
            tp_mesh,
            loss_parallel,
            norm_mode=b.rmsnorm,
            sequence_parallel=b.sequence_parallel,
            keep_gathered=b.sequence_parallel_keep_gathered,
        )
    elif plan == "vanilla":
        from .vanilla import apply_vanilla

        apply_vanilla(model, tp_mesh, loss_parallel)
    else:  # resolve_tp_plan guards this
        raise AssertionError(plan)
    for layer_id, block in model.layers.items():  # profiler names: btp/layer3/reduce_down_qkv
        if hasattr(block, "comm"):
            block.comm.label = f"{plan}/layer{layer_id}"
