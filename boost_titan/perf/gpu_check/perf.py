"""Performance: per-plan GEMM rates (``gemm``), tokens/s and MFU of CoLA and its dense
twin, eager and compiled (``throughput``), and every run's peak memory (``memory``)."""

from __future__ import annotations

import statistics

import torch

from boost_titan.perf.gpu_check.common import (
    THROUGHPUT_ARCHS,
    PeakMemory,
    Sizes,
    batch,
    build_model,
    compile_like_trainer,
    graphs_compiled,
    model_args,
    release,
)
from boost_titan.perf.gpu_check.steps import adamw, train_steps


def gemm(sizes: Sizes) -> dict:
    """Per-plan GEMM rates at 7B/TP4, b 4 x s 4096 (scaled by ``gemm_m_scale``)."""
    from boost_titan.perf.bench.gemm import GEMM_DEFAULTS, gemm_bench

    return gemm_bench(
        "7b",
        GEMM_DEFAULTS["tp"],
        GEMM_DEFAULTS["batch"],
        GEMM_DEFAULTS["seq"],
        sizes.gemm_dtype,
        sizes.gemm_m_scale,
        sizes.gemm_seconds,
    )


def peak_flops(device: torch.device) -> tuple[float, str]:
    """Peak FLOP/s for MFU: the GPU's bf16 datasheet figure (torchtitan's table), or a
    quick matmul measurement on CPU."""
    if device.type == "cuda":
        from torchtitan.tools.utils import get_peak_flops

        name = torch.cuda.get_device_name(device)
        return (
            get_peak_flops(name),
            f"datasheet bf16 dense for {name!r} (torchtitan's table; a GPU it does not "
            "list gets A100's 312e12)",
        )
    from boost_titan.parallel.cpu_runtime import measure_matmul_peak_flops

    return measure_matmul_peak_flops(n=512, seconds=0.2), "measured fp32 matmul (CPU)"


def throughput(sizes: Sizes, device: torch.device, backend: str) -> dict:
    """Tokens/s, MFU and peak memory of CoLA 350m and its dense twin, bf16, eager and
    compiled; the first (compiling) step and the warm-up are not timed."""
    from torchtitan.components.loss import cross_entropy_loss

    peak, peak_source = peak_flops(device)
    mem = PeakMemory(device)
    runs = {}
    tokens_per_step = sizes.throughput_batch * sizes.throughput_seq
    for arch in THROUGHPUT_ARCHS:
        args = model_args(arch, sizes.throughput_flavor, sizes.throughput_seq, sizes.throughput_dim)
        tokens, labels = batch(
            args.vocab_size, sizes.throughput_batch, sizes.throughput_seq, device
        )
        for mode in ("eager", "compiled"):
            model = build_model(args, device)
            loss_fn = (
                compile_like_trainer(model, backend) if mode == "compiled" else cross_entropy_loss
            )
            opt = adamw(model)
            graphs_before = graphs_compiled()
            first = train_steps(
                model, opt, loss_fn, tokens, labels, 1 + sizes.warmup, amp_dtype=torch.bfloat16
            )
            graphs_warm = graphs_compiled()
            mem.start()  # steady state: weights, gradients, Adam moments, activations
            _, times, _ = train_steps(
                model, opt, loss_fn, tokens, labels, sizes.steps, amp_dtype=torch.bfloat16
            )
            med = statistics.median(times)
            tps = tokens_per_step / med
            runs[f"{arch} {mode}"] = {
                "first_step_s": first[1][0],
                "first_step_loss": first[0][0],
                "step_time_median_s": med,
                "step_time_min_s": min(times),
                "step_time_max_s": max(times),
                "tokens_per_s": tps,
                "mfu": tps * args.flops_per_token(sizes.throughput_seq) / peak,
                "peak_mem_mib": mem.peak_mib(),
                "params": sum(p.numel() for p in model.parameters()),
                "graphs_compiled": graphs_warm - graphs_before,
                # > 0: compilation inside the timed steps (raise --warmup)
                "graphs_compiled_in_timed_steps": graphs_compiled() - graphs_warm,
            }
            del model, opt
            release(device)
    if device.type == "cpu":  # an estimate: MFU's base is the highest rate seen
        from boost_titan.observability.metrics import cpu_peak

        best = max(r["mfu"] for r in runs.values()) * peak
        if best > peak:
            peak_source += f", raised to the best run's achieved {best:.3g} FLOP/s"
            for r in runs.values():
                r["mfu"] *= peak / best
            peak = cpu_peak(peak, best)
    return {
        "flavor": sizes.throughput_flavor,
        "dtype": "bfloat16 autocast, fp32 weights",
        "batch": sizes.throughput_batch,
        "seq": sizes.throughput_seq,
        "warmup": sizes.warmup,
        "steps": sizes.steps,
        "peak_flops": peak,
        "peak_flops_source": peak_source,
        "runs": runs,
        "ratios": _throughput_ratios(runs),
    }


def _throughput_ratios(runs: dict) -> dict:
    r = {
        f"{a}_compiled_vs_eager_tokens_per_s": runs[f"{a} compiled"]["tokens_per_s"]
        / runs[f"{a} eager"]["tokens_per_s"]
        for a in THROUGHPUT_ARCHS
    }
    for mode in ("eager", "compiled"):
        r[f"cola_vs_dense_tokens_per_s_{mode}"] = (
            runs[f"cola {mode}"]["tokens_per_s"] / runs[f"dense {mode}"]["tokens_per_s"]
        )
    for a in THROUGHPUT_ARCHS:  # bf16: compiled kernels round differently; informative, not checked
        e, c = runs[f"{a} eager"]["first_step_loss"], runs[f"{a} compiled"]["first_step_loss"]
        r[f"{a}_bf16_first_step_loss_rel_diff"] = abs(c - e) / max(abs(e), 1e-30)
    return r


def memory(results: dict, device: torch.device) -> dict:
    """Every run's peak memory in one place."""
    peaks = {}
    for arch, row in results.get("numerics", {}).get("archs", {}).items():
        for mode in ("eager", "compiled"):
            if f"{mode}_peak_mem_mib" in row:
                peaks[f"numerics {arch} {mode}"] = row[f"{mode}_peak_mem_mib"]
    for name, row in results.get("throughput", {}).get("runs", {}).items():
        peaks[f"throughput {name}"] = row["peak_mem_mib"]
    return {"source": PeakMemory(device).source, "peak_mem_mib": peaks}
