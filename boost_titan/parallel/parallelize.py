"""parallelize_fn for every boost_titan model: TP plan, latent checkpointing, then
torchtitan's AC, compile and FSDP2/DDP exactly as torchtitan's llama3 applies them."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.llama3.infra.parallelize import _op_sac_save_list, apply_ddp, apply_fsdp
from torchtitan.tools.logging import logger

from boost_titan.observability import log_filters
from boost_titan.parallel.compile import apply_compile, use_rank_local_compile_cache
from boost_titan.parallel.cpu_runtime import fix_fsdp_reduce_for_gloo
from boost_titan.parallel.latent_checkpoint import apply_latent_checkpointing
from boost_titan.tp_plans import apply_tp_plan, resolve_tp_plan


def parallelize_boost(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    args = model.model_args
    plan = resolve_tp_plan(job_config.boost.tp_plan, args)
    if job_config.training.seq_len % parallel_dims.seq_len_divisor:
        raise ValueError(
            f"seq_len {job_config.training.seq_len} must be divisible by "
            f"{parallel_dims.seq_len_divisor} (TP degree x 2 x CP degree)"
        )
    if parallel_dims.cp_enabled:
        apply_context_parallel(model, parallel_dims.get_mesh("cp"))

    if parallel_dims.tp_enabled:
        tp_mesh = parallel_dims.get_mesh("tp")
        apply_tp_plan(
            plan,
            model,
            tp_mesh,
            loss_parallel=not job_config.parallelism.disable_loss_parallel,
            job_config=job_config,
        )
        maybe_enable_async_tp(job_config, tp_mesh)
        logger.info(f"Applied tensor-parallel plan {plan!r} (degree {tp_mesh.size()})")

    apply_latent_checkpointing(
        model,
        job_config.boost.latent_checkpoint,
        job_config.boost.latent_checkpoint_every,
        keep=job_config.boost.latent_checkpoint_keep,
        plan=plan if parallel_dims.tp_enabled else None,
        norm_mode=job_config.boost.rmsnorm,
        torchtitan_ac=job_config.activation_checkpoint.mode,
    )
    if job_config.boost.latent_checkpoint != "none":
        logger.info(
            f"Latent (communication-free) checkpointing: {job_config.boost.latent_checkpoint} "
            f"chunks, every {job_config.boost.latent_checkpoint_every} block(s), "
            f"keeping {job_config.boost.latent_checkpoint_keep!r}"
        )
    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.compile.enable:  # the loss is compiled too: before any graph is cached
        use_rank_local_compile_cache()
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(
            model,
            job_config.activation_checkpoint,
            model_compile_enabled=compile_model,
            op_sac_save_list=_op_sac_save_list,
            base_folder=job_config.job.dump_folder,
        )
    if compile_model:
        apply_compile(model, job_config.compile)
    apply_autocast_without_fsdp(model, parallel_dims, job_config)

    if parallel_dims.fsdp_enabled:
        names = ["dp_replicate", "fsdp"] if parallel_dims.dp_replicate_enabled else ["fsdp"]
        apply_fsdp(
            model,
            parallel_dims.get_mesh(names),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
        )
        fix_fsdp_reduce_for_gloo(model)
    elif parallel_dims.dp_replicate_enabled:
        if parallel_dims.world_size != parallel_dims.get_mesh("dp_replicate").size():
            raise RuntimeError("DDP has not supported > 1D parallelism")
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model


def apply_context_parallel(model: nn.Module, cp_mesh) -> None:
    """Ring attention over the CP ranks, torchtitan's own mechanism: every block's SDPA
    (``attention.inner_attention``, dense and low-rank blocks alike) sees q, k, v
    sequence-sharded and attends to the whole sequence (``cpu_ring_attention`` on CPU).
    The projections, norms and FFN are token-wise: they run on each rank's shard of the
    sequence unchanged, so a low-rank block's latents and BTP's collectives are per
    shard too, and only attention's keys/values travel between CP ranks. The trainer
    shards inputs, labels and RoPE positions (head-tail load balancing)."""
    from torchtitan.distributed.context_parallel import apply_cp_to_attention_module

    apply_cp_to_attention_module(
        [block.attention.inner_attention for block in model.layers.values()], cp_mesh, "sdpa"
    )
    logger.info(f"Applied context parallelism (ring attention, degree {cp_mesh.size()})")


def autocast_dtype(parallel_dims: ParallelDims, job_config) -> torch.dtype | None:
    """The dtype :func:`apply_autocast_without_fsdp` runs a model part's forward in, or
    None where torchtitan applies ``mixed_precision_param`` itself (FSDP2's param
    dtype; autocast on one device or DDP) or it is float32."""
    dtype = TORCH_DTYPE_MAP[job_config.training.mixed_precision_param]
    if dtype == torch.float32 or parallel_dims.fsdp_enabled:
        return None
    if not (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        return None  # torchtitan's maybe_enable_amp autocasts the step
    return dtype


def apply_autocast_without_fsdp(model: nn.Module, parallel_dims: ParallelDims, job_config):
    """``[training] mixed_precision_param`` for TP and PP layouts without FSDP.

    torchtitan 0.2.2 applies it through FSDP2 (bf16 parameters for compute) or, on one
    device and under DDP, through autocast; with TP or PP and no FSDP it logs a warning
    and trains in fp32 (``maybe_enable_amp``): a TP4 recipe on 4 GPUs would run 2-4x
    slower than asked, its numbers still plausible. Here the model part's forward runs
    under autocast instead, the same mechanism torchtitan uses on one device: GEMMs and
    attention in the 16-bit dtype, reductions and the residual stream in fp32, fp32
    master weights and gradients. It wraps the forward (not the step) so pipeline
    stages get it too, with backward outside it as autocast requires."""
    if not parallel_dims.fsdp_enabled and (parallel_dims.tp_enabled or parallel_dims.pp_enabled):
        log_filters.drop_torchtitan_mixed_precision_lines()  # wrong here: see below
    dtype = autocast_dtype(parallel_dims, job_config)
    if dtype is None:
        return
    from torchtitan.tools.utils import device_type

    model.forward = functools.partial(_autocast_forward, model.forward, device_type, dtype)
    logger.info(
        f"Mixed precision: {dtype} autocast around each model part's forward "
        "(boost_titan: torchtitan applies it only with FSDP)"
    )


def _autocast_forward(forward, device_type: str, dtype: torch.dtype, *args, **kwargs):
    with torch.autocast(device_type, dtype=dtype):
        return forward(*args, **kwargs)
