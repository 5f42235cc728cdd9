"""The timing worker: one process per TP rank builds every variant and times whole
training steps, interleaved across variants, then measures each variant's saved
activations and collectives; rank 0 writes raw.json."""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from boost_titan.perf.bench.activations import saved_activation_bytes
from boost_titan.perf.bench.comm import measure_comm
from boost_titan.perf.bench.variants import Shape, build_variant, is_compiled, sync, train_step


@dataclass
class VariantResult:
    name: str
    step_times: list[float] = field(default_factory=list)
    rep_times: list[float] = field(default_factory=list)  # mean step time of each repetition
    comm_times: list[float] = field(default_factory=list)
    instrumented_step_times: list[float] = field(default_factory=list)
    bytes_per_step: int = 0  # raw payload counted
    volume_per_step: float = 0.0  # all-reduce-equivalent bytes
    comm_by_op: dict = field(default_factory=dict)  # op -> {"count", "bytes"} per step
    collectives_per_step: int = 0
    peak_step_mem_bytes: int = 0
    saved_activation_bytes: int = 0
    param_bytes_per_rank: int = 0
    warmup_times: list[float] = field(default_factory=list)  # the first one compiles, if compiled
    first_step_loss: float | None = None
    step_losses: list[float] = field(default_factory=list)  # loss of each timed step
    graphs_compiled_in_timed_steps: int = 0  # > 0: a recompile polluted the step times


def _scalar(loss: torch.Tensor) -> float:
    """A (possibly DTensor) scalar loss as a float, the same on every rank."""
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _prepare_compile(n_models: int) -> None:
    """Compile settings for a process that compiles several models' blocks."""
    from boost_titan.parallel.compile import use_rank_local_compile_cache

    # each rank its own inductor cache, before anything is compiled (see compile.py)
    use_rank_local_compile_cache()
    # every variant's blocks share one forward code object, and dynamo caches a few
    # graphs per block kind per model against it; past the limit it would silently
    # run a block eager and time eager code as compiled, so raise the limit, and fail
    # rather than fall back
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * n_models)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def init_rank(rank: int, world: int, init_method: str, threads: int) -> torch.device:
    """Join the benchmark's process group: NCCL on GPU ``rank``, else gloo with
    ``threads`` CPU threads; returns this rank's device."""
    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(threads)
    dist.init_process_group(
        "nccl" if cuda else "gloo", init_method=init_method, rank=rank, world_size=world
    )
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def worker(rank: int, world: int, cfg: dict, out_dir: str):
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    from torch.distributed.device_mesh import init_device_mesh

    device = init_rank(rank, world, cfg["init_method"], cfg["threads"])
    mesh = init_device_mesh(device.type, (world,))
    shape = Shape(**cfg["shape"])
    names = cfg["variants"]
    compiled = [n for n in names if is_compiled(n)]
    if compiled:
        _prepare_compile(len(compiled))
    built = {n: build_variant(n, shape, mesh, device, cfg["backend"]) for n in names}
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
    labels = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
    results = {n: VariantResult(n, param_bytes_per_rank=built[n][2]) for n in names}
    for n in names:  # warm-up, outside the timed region; a compiled variant compiles here
        _warm_up(built[n], results[n], cfg["warmup"], tokens, labels, device)
    for _rep in range(cfg["reps"]):
        for n in names:
            _timed_steps(built[n], results[n], cfg["steps"], tokens, labels, device)
    for n in names:  # instrumented steps: collective counts/bytes and time
        _instrumented_steps(built[n], results[n], cfg["comm_steps"], tokens, labels, device)
    if rank == 0:
        with open(os.path.join(out_dir, "raw.json"), "w") as f:
            json.dump({n: r.__dict__ for n, r in results.items()}, f)
    dist.destroy_process_group()


def _warm_up(built, result: VariantResult, steps: int, tokens, labels, device) -> None:
    """Untimed steps; each one's time is kept (the first of a compiled variant is its
    compile time) and the first step's loss too (compiled must match eager)."""
    model, opt, _, loss_fn = built
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        loss = train_step(model, opt, tokens, labels, loss_fn)
        sync(device)
        result.warmup_times.append(time.perf_counter() - t0)
        if i == 0:
            result.first_step_loss = _scalar(loss)


def _timed_steps(built, result: VariantResult, steps: int, tokens, labels, device) -> None:
    """One repetition of a variant: ``steps`` timed steps and their peak memory."""
    from boost_titan.parallel.cpu_runtime import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    model, opt, _, loss_fn = built
    cuda = device.type == "cuda"
    rep_start = len(result.step_times)
    graphs_before = _graphs_compiled()
    for _ in range(steps):
        sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = current_rss_bytes()
            reset_peak_rss()
        t0 = time.perf_counter()
        loss = train_step(model, opt, tokens, labels, loss_fn)
        sync(device)
        result.step_times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base if cuda else peak_rss_bytes() - base
        result.step_losses.append(_scalar(loss))  # after the timed interval
        result.peak_step_mem_bytes = max(result.peak_step_mem_bytes, peak)
    result.graphs_compiled_in_timed_steps += _graphs_compiled() - graphs_before
    result.rep_times.append(statistics.mean(result.step_times[rep_start:]))


def _instrumented_steps(
    built, result: VariantResult, comm_steps: int, tokens, labels, device
) -> None:
    """Saved activations, collectives counted, and collectives timed, in steps that
    are not timed as training steps."""
    model, opt, _, loss_fn = built
    result.saved_activation_bytes = saved_activation_bytes(model, tokens, labels, loss_fn)
    opt.zero_grad(set_to_none=True)
    comm = measure_comm(built, is_compiled(result.name), comm_steps, tokens, labels, device)
    result.collectives_per_step, result.bytes_per_step = (
        comm.collectives_per_step,
        comm.bytes_per_step,
    )
    result.volume_per_step, result.comm_by_op = comm.volume_per_step, comm.by_op
    result.instrumented_step_times.extend(comm.step_times)
    result.comm_times.extend(comm.comm_times)
