"""Which scaled-dot-product-attention kernel each architecture ran (``sdpa``): one
eager forward per architecture and dtype (fp32, and bf16 autocast as in training)
under the profiler. On CUDA the kernel is read from the GPU kernels' names (flash,
memory-efficient, cuDNN; none of those: the math path); on CPU from the ATen op the
dispatcher chose (``_scaled_dot_product_flash_attention_for_cpu`` or the math path)."""

from __future__ import annotations

import torch

from boost_titan.perf.gpu_check.common import (
    ARCHS,
    Sizes,
    batch,
    build_model,
    guarded,
    model_args,
    release,
)

# ATen ops SDPA dispatches to, by backend
_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash (CPU)",
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_efficient_attention": "efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "overrideable",
}
# GPU kernel names, by backend (first match wins)
# (cuDNN's SDPA kernels are named like "cudnn_generated_fort_native_sdpa_sm90_flash_fprop":
# cudnn before flash)
_KERNELS = (
    ("cudnn", "cudnn"),
    ("flash", "flash"),
    ("fmha", "efficient"),
    ("efficient", "efficient"),
)


def sdpa(sizes: Sizes, device: torch.device) -> dict:
    rows = {arch: guarded(_sdpa_arch, arch, sizes, device) for arch in ARCHS}
    return {
        "source": "GPU kernel names (profiler)"
        if device.type == "cuda"
        else "ATen op (profiler, CPU)",
        "batch": sizes.numerics_batch,
        "seq": sizes.numerics_seq,
        "archs": rows,
    }


def classify(op_names: list[str], kernel_names: list[str], cuda: bool) -> str:
    """The backend that ran, from the profiled ATen ops and (CUDA) GPU kernels."""
    ops = [_OPS[n] for n in op_names if n in _OPS]
    if cuda:
        for name in kernel_names:
            low = name.lower()
            for key, backend in _KERNELS:
                if key in low:
                    return backend
        if "math" in ops:
            return "math"
        raise RuntimeError(f"no SDPA kernel among the GPU kernels; ATen SDPA ops: {op_names}")
    if not ops:
        raise RuntimeError("no SDPA op in the profile (the model did not call SDPA?)")
    return ops[0]


def _sdpa_arch(arch: str, sizes: Sizes, device: torch.device) -> dict:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    args = model_args(arch, sizes.numerics_flavor, sizes.numerics_seq, sizes.numerics_dim)
    tokens, _ = batch(args.vocab_size, sizes.numerics_batch, sizes.numerics_seq, device)
    model = build_model(args, device)
    row = {}
    try:
        for dtype in ("float32", "bfloat16"):
            amp = dtype == "bfloat16"
            with torch.no_grad(), torch.autocast(device.type, torch.bfloat16, enabled=amp):
                model(tokens)  # warm: the profiled forward picks as a steady one does
                activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
                with profile(activities=activities) as prof:
                    model(tokens)
                    if cuda:
                        torch.cuda.synchronize(device)
            events = prof.events()
            ops = sorted({e.name for e in events if "scaled_dot_product" in e.name})
            kernels = sorted(
                {
                    e.name
                    for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA
                    and any(
                        k in e.name.lower() for k in ("flash", "fmha", "cudnn", "attention", "sdpa")
                    )
                }
            )
            row[dtype] = {
                "kernel": classify(ops, kernels, cuda),
                "aten_ops": ops,
                "gpu_kernels": kernels[:8],
            }
    finally:
        del model
        release(device)
    return row
