"""One command for a GPU machine: compiled numerics, GEMM rates, throughput, memory.

    bash benchmarks/gpu_check.sh                  # one GPU: under 8 minutes
    bash benchmarks/gpu_check.sh --smoke          # the same code paths on CPU, tiny shapes
    python -m boost_titan.gpu_check [--out DIR] [--smoke] [--batch B] [--seq S] [--steps N]

Sections, all in ``<out>/gpu_check.json`` (default ``outputs/gpu_check``), with a
markdown summary printed at the end:

* ``numerics``: eager vs ``torch.compile`` (per block, as the trainer via
  ``boost_titan.compile.apply_compile``, loss compiled too) for every architecture
  (dense, svd, cola, lax) on one device, fp32: loss and gradient differences over two
  AdamW steps. Must agree within 1e-4 relative (loss) and 1e-3 (gradients).
* ``tp2``: the same at TP2 (full-rank plan for dense, BTP for low-rank) on two ranks:
  GPUs 0 and 1 when two are visible, two gloo CPU ranks with ``--smoke``; skipped
  otherwise. Simulated TP in one process (tests/tp_sim.py, LocalTensorMode) cannot be
  compiled: AOTAutograd fails on LocalTensor x FunctionalTensor (torch 2.13).
* ``gemm``: per-plan per-rank GEMM TFLOP/s at 7B/TP4 shapes (``bench.gemm.gemm_bench``,
  as ``python -m boost_titan.bench --gemm``).
* ``throughput``: tokens/s and MFU of CoLA 350m and its dense twin, bf16 autocast
  (torchtitan's single-device mixed precision), eager and compiled, a few steps after
  warm-up (the first, compiling step timed separately).
* ``memory``: peak memory of every run above (``torch.cuda.max_memory_allocated``;
  on CPU the peak RSS rise, a coarser figure).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ARCHS = ("dense", "svd", "cola", "lax")
THROUGHPUT_ARCHS = ("cola", "dense")
LOSS_RTOL = 1e-4  # compiled vs eager loss, relative (fp32)
GRAD_RTOL = 1e-3  # compiled vs eager gradients: max |diff| / max |eager| per parameter
NUMERIC_STEPS = 2  # the second step checks the compiled graphs see the updated weights
LOCAL_TENSOR_NOTE = (
    "simulated TP (fake process group + LocalTensorMode) cannot be compiled with torch "
    f"{torch.__version__}: AOTAutograd fails on LocalTensor x FunctionalTensor"
)


@dataclass(frozen=True)
class Sizes:
    """Shapes and step counts of one check run."""

    numerics_flavor: str = "debugmodel"  # d 256, 4 layers, vocab 8192
    numerics_dim: int | None = None  # None: the flavor's
    numerics_batch: int = 4
    numerics_seq: int = 256
    tp2_archs: tuple[str, ...] = ARCHS
    throughput_flavor: str = "350m"
    throughput_dim: int | None = None
    throughput_batch: int = 8
    throughput_seq: int = 2048
    warmup: int = 3  # untimed steps after the compiling one
    steps: int = 10
    gemm_dtype: str = "bfloat16"
    gemm_m_scale: float = 1.0
    gemm_seconds: float = 0.2


# CPU: tiny shapes, same code paths (tests/test_bench.py runs it)
# (TP2: one architecture per plan, full-rank and BTP; tracing DTensor code is slow)
SMOKE = Sizes(
    numerics_dim=128,
    numerics_batch=2,
    numerics_seq=32,
    tp2_archs=("dense", "cola"),
    throughput_flavor="debugmodel",
    throughput_dim=128,
    throughput_batch=2,
    throughput_seq=64,
    warmup=1,
    steps=2,
    gemm_dtype="float32",
    gemm_m_scale=0.002,
    gemm_seconds=0.02,
)


# ----------------------------------------------------------------------------- building
def model_args(arch: str, flavor: str, seq: int, dim: int | None):
    """A flavor's LlamaArgs; ``dim`` set shrinks it to 2 blocks of that width (smoke)."""
    from boost_titan.models.flavors import flavors_for

    args = copy.deepcopy(flavors_for(arch)[flavor])
    args.max_seq_len = seq
    if dim is not None:
        # ffn ~ 8d/3 rounded up to a multiple of 8: divisible by the TP degree
        args.dim, args.ffn_dim, args.vocab_size, args.n_layers = (
            dim,
            -(-dim * 8 // 3 // 8) * 8,
            512,
            2,
        )
        if args.low_rank:
            args.rank = dim // 4
    args.validate()
    return args


def build_model(args, device: torch.device, plan_fn=None):
    """Seeded weights, identical for every build of the same args; ``plan_fn(model)``
    (a TP plan) is applied on the meta model, before weights exist."""
    from boost_titan.models.model import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    if plan_fn is not None:
        plan_fn(model)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def compile_like_trainer(model, backend: str):
    """The model's blocks and the loss compiled as the trainer does; returns the loss."""
    from torchtitan.components.loss import cross_entropy_loss

    from boost_titan.compile import apply_compile

    apply_compile(model, SimpleNamespace(backend=backend))
    return torch.compile(cross_entropy_loss, backend=backend)


def batch(vocab: int, b: int, s: int, device: torch.device):
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, vocab, (b, s), generator=g)
    labels = torch.randint(0, vocab, (b, s), generator=g)
    return tokens.to(device), labels.to(device)


# ----------------------------------------------------------------------------- stepping
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def scalar(t: torch.Tensor) -> float:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).item()


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def plain_name(name: str) -> str:
    """Parameter names with torch.compile's wrapper level removed."""
    return name.replace("_orig_mod.", "")


def adamw(model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)


def train_steps(
    model,
    opt,
    loss_fn,
    tokens,
    labels,
    steps: int,
    *,
    context=None,
    amp_dtype=None,
    keep_grads=False,
):
    """Steps with the trainer's token-mean loss; returns losses, per-step seconds and
    (``keep_grads``) the first step's local gradients by parameter name."""
    import contextlib

    device = tokens.device
    losses, times, grads = [], [], {}
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        with context() if context else contextlib.nullcontext():
            with (
                torch.autocast(device.type, dtype=amp_dtype)
                if amp_dtype
                else contextlib.nullcontext()
            ):
                loss = loss_fn(model(tokens), labels) / labels.numel()
            loss.backward()
        if keep_grads and i == 0:
            grads = {
                plain_name(n): local(p.grad).detach().clone() for n, p in model.named_parameters()
            }
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(scalar(loss.detach()))  # syncs, so the step time is the step's
        sync(device)
        times.append(time.perf_counter() - t0)
    return losses, times, grads


def compare(eager: tuple, compiled: tuple) -> dict:
    """Loss and gradient differences of two ``train_steps`` results."""
    (le, te, ge), (lc, tc, gc) = eager, compiled
    loss_rel = max(abs(c - e) / max(abs(e), 1e-30) for e, c in zip(le, lc))
    grad_rel = max(
        ((gc[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item() for n, g in ge.items()
    )
    return {
        "eager_loss": le,
        "compiled_loss": lc,
        "loss_max_rel_diff": loss_rel,
        "grad_max_rel_diff": grad_rel,
        "compile_step_s": tc[0],
        "eager_first_step_s": te[0],
        "ok": loss_rel <= LOSS_RTOL and grad_rel <= GRAD_RTOL,
    }


class PeakMemory:
    """Peak memory from ``start()``: CUDA max allocated, or the CPU peak RSS rise."""

    def __init__(self, device: torch.device):
        self.device, self.base = device, 0

    @property
    def source(self) -> str:
        return (
            "torch.cuda.max_memory_allocated"
            if self.device.type == "cuda"
            else "peak RSS rise (CPU)"
        )

    def start(self) -> None:
        from boost_titan.cpu_runtime import current_rss_bytes, reset_peak_rss

        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = 0  # absolute: everything the run holds on the GPU
        else:
            self.base = current_rss_bytes()
            reset_peak_rss()

    def peak_mib(self) -> float:
        from boost_titan.cpu_runtime import peak_rss_bytes

        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        return max(0, peak_rss_bytes() - self.base) / 2**20


def graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def fail_rather_than_fall_back() -> None:
    """Past dynamo's recompile limit a block would silently run eager, and eager
    numbers would be reported as compiled: make that an error instead."""
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def guarded(fn, *args) -> dict:
    """``fn(*args)``, or its error: one failing part must not cost a GPU session the
    results of the others."""
    import traceback

    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the results and the exit status
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"[:2000]}


def release(device: torch.device) -> None:
    """Forget compiled graphs and cached memory between runs: each run starts alike."""
    import gc

    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- sections
def numerics(sizes: Sizes, device: torch.device, backend: str) -> dict:
    """Eager vs compiled, every architecture, one device, fp32."""
    torch.set_float32_matmul_precision("highest")  # no TF32: compare fp32 with fp32
    rows = {arch: guarded(_numerics_arch, arch, sizes, device, backend) for arch in ARCHS}
    return {
        "dtype": "float32",
        "flavor": sizes.numerics_flavor,
        "batch": sizes.numerics_batch,
        "seq": sizes.numerics_seq,
        "steps": NUMERIC_STEPS,
        "loss_rtol": LOSS_RTOL,
        "grad_rtol": GRAD_RTOL,
        "archs": rows,
    }


def _numerics_arch(arch: str, sizes: Sizes, device: torch.device, backend: str) -> dict:
    from torchtitan.components.loss import cross_entropy_loss

    mem = PeakMemory(device)
    args = model_args(arch, sizes.numerics_flavor, sizes.numerics_seq, sizes.numerics_dim)
    tokens, labels = batch(args.vocab_size, sizes.numerics_batch, sizes.numerics_seq, device)
    runs, peaks = {}, {}
    try:
        for mode in ("eager", "compiled"):
            model = build_model(args, device)
            loss_fn = (
                compile_like_trainer(model, backend) if mode == "compiled" else cross_entropy_loss
            )
            mem.start()
            runs[mode] = train_steps(
                model, adamw(model), loss_fn, tokens, labels, NUMERIC_STEPS, keep_grads=True
            )
            peaks[f"{mode}_peak_mem_mib"] = mem.peak_mib()
            del model
    finally:
        release(device)
    return {**compare(runs["eager"], runs["compiled"]), **peaks}


def _tp2_worker(rank: int, cfg: dict, init_file: str, out_file: str) -> None:
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    cuda = cfg["cuda"]
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=2
    )
    try:
        from boost_titan.compile import use_rank_local_compile_cache

        use_rank_local_compile_cache()  # before anything compiles (see compile.py)
        fail_rather_than_fall_back()
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        rows = {arch: _tp2_arch(arch, cfg, device) for arch in cfg["sizes"]["tp2_archs"]}
        if rank == 0:
            Path(out_file).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _tp2_arch(arch: str, cfg: dict, device: torch.device) -> dict:
    """One architecture at TP2 under the trainer's plan for it, eager vs compiled."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel
    from torchtitan.components.loss import cross_entropy_loss

    from boost_titan.tp_plans import apply_tp_plan, resolve_tp_plan

    sizes = Sizes(**cfg["sizes"])
    args = model_args(arch, sizes.numerics_flavor, sizes.numerics_seq, sizes.numerics_dim)
    plan = resolve_tp_plan("auto", args)  # fullrank for dense, btp for low-rank
    mesh = init_device_mesh(device.type, (2,))
    job = SimpleNamespace(boost=SimpleNamespace(rmsnorm="online"))
    tokens, labels = batch(args.vocab_size, sizes.numerics_batch, sizes.numerics_seq, device)
    runs = {}
    for mode in ("eager", "compiled"):
        model = build_model(
            args, device, lambda m: apply_tp_plan(plan, m, mesh, loss_parallel=True, job_config=job)
        )
        loss_fn = (
            compile_like_trainer(model, cfg["backend"])
            if mode == "compiled"
            else cross_entropy_loss
        )
        runs[mode] = train_steps(
            model,
            adamw(model),
            loss_fn,
            tokens,
            labels,
            NUMERIC_STEPS,
            context=loss_parallel,
            keep_grads=True,
        )
        del model
        release(device)
    row = compare(runs["eager"], runs["compiled"])
    # gradients were compared shard by shard: the worst over both ranks
    worst = torch.tensor([row["grad_max_rel_diff"]], device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    row["grad_max_rel_diff"] = worst.item()
    row["ok"] = row["loss_max_rel_diff"] <= LOSS_RTOL and row["grad_max_rel_diff"] <= GRAD_RTOL
    return {"plan": plan, **row}


def tp2(sizes: Sizes, smoke: bool, backend: str) -> dict:
    """TP2 eager vs compiled on two real ranks, when there are two."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2 and not (smoke and gpus == 0):
        return {
            "ran": False,
            "reason": f"needs 2 GPUs, {gpus} visible",
            "note": LOCAL_TENSOR_NOTE,
            "archs": {},
        }
    cfg = {"cuda": gpus >= 2, "sizes": asdict(sizes), "backend": backend}
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "tp2.json")
        torch.multiprocessing.spawn(
            _tp2_worker, args=(cfg, os.path.join(tmp, "init"), out_file), nprocs=2
        )
        rows = json.loads(Path(out_file).read_text())
    return {
        "ran": True,
        "ranks": "2 GPUs (nccl)" if cfg["cuda"] else "2 CPU ranks (gloo)",
        "dtype": "float32",
        "note": LOCAL_TENSOR_NOTE,
        "loss_rtol": LOSS_RTOL,
        "grad_rtol": GRAD_RTOL,
        "archs": rows,
    }


def gemm(sizes: Sizes) -> dict:
    """Per-plan GEMM rates at 7B/TP4, b 4 x s 4096 (scaled by ``gemm_m_scale``)."""
    from boost_titan.bench.gemm import GEMM_DEFAULTS, gemm_bench

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

        return get_peak_flops(torch.cuda.get_device_name(device)), "datasheet bf16 (torchtitan)"
    from boost_titan.cpu_runtime import measure_matmul_peak_flops

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


# ----------------------------------------------------------------------------- report
def failures(results: dict) -> list[str]:
    """One line per section that failed and per architecture whose compiled run
    failed or does not match eager."""
    out = [
        f"{name}: {section['error']}"
        for name, section in results.items()
        if isinstance(section, dict) and "error" in section
    ]
    for section in ("numerics", "tp2"):
        for arch, row in results.get(section, {}).get("archs", {}).items():
            if "error" in row:
                out.append(f"{section} {arch}: {row['error']}")
            elif not row["ok"]:
                out.append(
                    f"{section} {arch}: "
                    f"loss rel diff {row['loss_max_rel_diff']:.2e} (max {LOSS_RTOL:g}), "
                    f"grad rel diff {row['grad_max_rel_diff']:.2e} (max {GRAD_RTOL:g})"
                )
    return out


def markdown(results: dict) -> str:
    lines = [
        f"# GPU check: {results['device']}, torch {results['torch']}, {results['backend']}"
        f"{' (smoke)' if results['smoke'] else ''}, {results['seconds']:.0f} s",
        "",
    ]
    for name in SECTIONS:
        if "error" in results.get(name, {}):
            lines += [f"{name}: **ERROR** {results[name]['error']}", ""]
    if "archs" in results.get("numerics", {}):
        lines += _numerics_md("Eager vs compiled, one device, fp32", results["numerics"])
    if "ran" in results.get("tp2", {}):
        tp = results["tp2"]
        if tp["ran"]:
            lines += _numerics_md(f"Eager vs compiled, TP2 on {tp['ranks']}, fp32", tp)
        else:
            lines += [f"TP2 skipped: {tp['reason']}; {tp['note']}", ""]
    if "plans" in results.get("gemm", {}):
        lines += _gemm_md(results["gemm"])
    if "runs" in results.get("throughput", {}):
        lines += _throughput_md(results["throughput"])
    lines += [f"Peak memory source: {results['memory']['source']}"]
    return "\n".join(lines) + "\n"


def _gemm_md(g: dict) -> list[str]:
    lines = [f"Per-rank block GEMMs, {g['flavor']} TP{g['tp']}, m = {g['m']}, {g['dtype']}:", ""]
    lines += [
        f"- {plan}: {r['tflops']:.2f} TFLOP/s ({r['block_gemm_time_s'] * 1e3:.2f} ms per block)"
        for plan, r in g["plans"].items()
    ]
    return lines + [""]


def _throughput_md(t: dict) -> list[str]:
    lines = [
        f"Throughput, {t['flavor']}, {t['dtype']}, batch {t['batch']} x seq {t['seq']}, "
        f"{t['steps']} steps after {t['warmup']} warm-up (MFU vs {t['peak_flops']:.3g} FLOP/s, "
        f"{t['peak_flops_source']}):",
        "",
        "| run | first step s | step s (median) | tokens/s | MFU | peak MiB |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in t["runs"].items():
        lines.append(
            f"| {name} | {r['first_step_s']:.1f} | {r['step_time_median_s']:.4f} "
            f"| {r['tokens_per_s']:.0f} "
            f"| {100 * r['mfu']:.1f}% | {r['peak_mem_mib']:.0f} |"
        )
    lines += [""] + [f"- {k}: {v:.3g}" for k, v in t["ratios"].items()]
    recompiled = [n for n, r in t["runs"].items() if r["graphs_compiled_in_timed_steps"]]
    if recompiled:
        lines.append(
            f"- Warning: graphs compiled during the timed steps of {recompiled} (raise --warmup)"
        )
    return lines + [""]


def _numerics_md(title: str, section: dict) -> list[str]:
    lines = [
        f"{title} (loss max rel diff <= {LOSS_RTOL:g}, grads <= {GRAD_RTOL:g}):",
        "",
        "| arch | loss eager / compiled (step 1) | loss rel diff | grad rel diff "
        "| compile step s | ok |",
        "|---|---|---|---|---|---|",
    ]
    for arch, r in section["archs"].items():
        if "error" in r:
            lines.append(f"| {arch} | **ERROR** {r['error'][:200]} | | | | **NO** |")
            continue
        plan = f" ({r['plan']})" if "plan" in r else ""
        lines.append(
            f"| {arch}{plan} | {r['eager_loss'][0]:.6f} / {r['compiled_loss'][0]:.6f} "
            f"| {r['loss_max_rel_diff']:.1e} | {r['grad_max_rel_diff']:.1e} "
            f"| {r['compile_step_s']:.1f} "
            f"| {'yes' if r['ok'] else '**NO**'} |"
        )
    return lines + [""]


# ----------------------------------------------------------------------------- main
SECTIONS = ("numerics", "tp2", "gemm", "throughput")


def run(sizes: Sizes, smoke: bool, backend: str, sections: tuple[str, ...] = SECTIONS) -> dict:
    """The chosen sections, in order, each one's wall time recorded; then memory."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    fail_rather_than_fall_back()
    start = time.perf_counter()
    results = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
        "torch": torch.__version__,
        "backend": backend,
        "smoke": smoke,
        "sizes": asdict(sizes),
        "section_seconds": {},
    }
    fns = {
        "numerics": lambda: numerics(sizes, device, backend),
        "tp2": lambda: tp2(sizes, smoke, backend),
        "gemm": lambda: gemm(sizes),
        "throughput": lambda: throughput(sizes, device, backend),
    }
    for name in sections:
        t0 = time.perf_counter()
        results[name] = guarded(fns[name])
        results["section_seconds"][name] = time.perf_counter() - t0
        print(f"[gpu_check] {name} done in {results['section_seconds'][name]:.0f} s", flush=True)
    results["memory"] = memory(results, device)
    results["seconds"] = time.perf_counter() - start
    return results


def _sizes(a: argparse.Namespace) -> Sizes:
    base = SMOKE if a.smoke else Sizes()
    given = {
        k: v
        for k, v in (
            ("throughput_batch", a.batch),
            ("throughput_seq", a.seq),
            ("steps", a.steps),
            ("warmup", a.warmup),
        )
        if v is not None
    }
    return Sizes(**{**asdict(base), **given})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="outputs/gpu_check", help="folder for gpu_check.json")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="CPU, tiny shapes: checks the code paths in a minute or two",
    )
    p.add_argument(
        "--backend",
        default=None,
        help="torch.compile backend (default inductor; --smoke: aot_eager, which traces and "
        "partitions as inductor does but skips C++ code generation, minutes on a small CPU)",
    )
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {list(SECTIONS)}")
    p.add_argument(
        "--batch",
        type=int,
        default=None,
        help=f"throughput batch (default {Sizes.throughput_batch})",
    )
    p.add_argument(
        "--seq",
        type=int,
        default=None,
        help=f"throughput sequence length (default {Sizes.throughput_seq})",
    )
    p.add_argument(
        "--steps", type=int, default=None, help=f"timed throughput steps (default {Sizes.steps})"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help=f"untimed steps after the compiling one (default {Sizes.warmup})",
    )
    a = p.parse_args(argv)
    for flag in ("batch", "seq", "steps"):
        if getattr(a, flag) is not None and getattr(a, flag) < 1:
            p.error(f"--{flag} must be >= 1, got {getattr(a, flag)}")
    if a.warmup is not None and a.warmup < 0:
        p.error(f"--warmup must be >= 0, got {a.warmup}")
    sections = tuple(s.strip() for s in a.sections.split(","))
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; valid: {list(SECTIONS)}")
    backend = a.backend or ("aot_eager" if a.smoke else "inductor")
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    results = run(_sizes(a), a.smoke, backend, sections)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=2))
    print(markdown(results))
    print(f"wrote {out / 'gpu_check.json'}")
    bad = failures(results)
    if bad:  # the file is written first, so the numbers can be inspected
        raise SystemExit("compiled does not match eager:\n  " + "\n  ".join(bad))


if __name__ == "__main__":
    main()
