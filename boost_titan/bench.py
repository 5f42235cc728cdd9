"""Side-by-side benchmark: the same low-rank model under BTP and vanilla TP, and its
dense twin under full-rank TP, trained in one run on the same machine.

    python -m boost_titan.bench                  # CPU: TP2 on 2 gloo ranks (NCCL on GPUs)
    python -m boost_titan.bench --smoke          # tiny model, 2 steps: checks the outputs
    python -m boost_titan.bench --compile        # every variant eager and torch.compile'd, side by side
    python -m boost_titan.bench --gemm           # single device: per-rank GEMMs of each plan

Every variant runs whole training steps (forward, backward, AdamW). Repetitions are
interleaved (variant A, B, C, A, B, C, ...) so machine drift hits all alike; the first
``--warmup`` steps of each variant are excluded. Per variant it reports step time
(median, min-max), tokens/s, the communication share of a step (collectives timed in
separate, instrumented steps), bytes per step (counted), and peak memory per rank (CPU:
peak RSS rise during a step above the RSS before it, plus exact parameter bytes; GPU:
max allocated). Ablations (grouping off, sync norm) are BTP variants of the same model.

``--compile`` adds a compiled twin of every selected variant, ``<variant> [compiled]``,
run in the same interleaved repetitions: its blocks compiled as the trainer does
(``boost_titan.compile.apply_compile``) and its loss ``torch.compile``'d. Its first
warm-up step compiles; that step's time is reported separately (``compile`` in
results.json) and never enters the step-time statistics. A compiled variant's first-step
loss must equal its eager twin's within 1e-4 relative, or the run fails after writing
its outputs.

Outputs in ``--out``: results.json, results.md, step_time.png, comm_share.png and
TensorBoard scalars under tb/.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F

VARIANTS = {
    # name: (architecture, plan, group_linears, rmsnorm, activation checkpointing)
    "btp": ("cola", "btp", True, "online", "none"),
    "vanilla": ("cola", "vanilla", True, "online", "none"),
    "fullrank (dense twin)": ("dense", "fullrank", True, "online", "none"),
    "btp ungrouped": ("cola", "btp", False, "online", "none"),
    "btp sync-norm": ("cola", "btp", True, "sync", "none"),
    "btp latent-ckpt": ("cola", "btp", True, "online", "latent"),
    "btp latent-ckpt recompute-attn": ("cola", "btp", True, "online", "latent recompute-attn"),
    "btp full-ac": ("cola", "btp", True, "online", "full"),
    "vanilla full-ac": ("cola", "vanilla", True, "online", "full"),
}
DEFAULT_VARIANTS = ("btp", "vanilla", "fullrank (dense twin)", "btp ungrouped", "btp sync-norm")
AC_VARIANTS = ("btp", "btp latent-ckpt", "btp latent-ckpt recompute-attn", "btp full-ac", "vanilla",
               "vanilla full-ac")
COMPILED = " [compiled]"  # suffix of a variant's torch.compile'd twin
COMPILE_LOSS_RTOL = 1e-4  # compiled vs eager first-step loss, relative
# GEMM mode's shapes when --tp/--batch/--seq are not given: 7B at TP4, b 4 x s 4096
GEMM_DEFAULTS = {"tp": 4, "batch": 4, "seq": 4096}
TRAIN_DEFAULT_TP = 2


def compiled_name(name: str) -> str:
    return name + COMPILED


def base_name(name: str) -> str:
    """The VARIANTS key of a (possibly compiled) variant name."""
    return name.removesuffix(COMPILED)


def is_compiled(name: str) -> bool:
    return name.endswith(COMPILED)


def with_compiled(names: list[str], tp: int) -> tuple[list[str], dict[str, str]]:
    """Each variant followed by its compiled twin (interleaved repetitions then time
    both back to back, and every table lists them side by side), and the variants
    that get no twin because torch cannot compile them correctly: {name: why}."""
    out, refused = [], {}
    for n in names:
        out.append(n)
        why = compile_refusal(n, tp)
        if why:
            refused[n] = why
        else:
            out.append(compiled_name(n))
    return out, refused


def compile_refusal(name: str, tp: int) -> str | None:
    """Why the trainer would refuse to compile this variant at TP ``tp`` (the same
    check, ``boost_titan.compile.check_compile_config``), or None."""
    from boost_titan.compile import check_compile_config

    ac = VARIANTS[base_name(name)][4]
    latent = ac.startswith("latent")
    config = SimpleNamespace(
        compile=SimpleNamespace(enable=True, components=["model", "loss"]),
        parallelism=SimpleNamespace(tensor_parallel_degree=tp),
        activation_checkpoint=SimpleNamespace(mode="full" if ac == "full" else "none"),
        boost=SimpleNamespace(latent_checkpoint="both" if latent else "none",
                              latent_checkpoint_keep="none" if ac.endswith("recompute-attn") else "attention"),
    )
    try:
        check_compile_config(config)
    except ValueError as e:
        return str(e)
    return None


@dataclass
class Shape:
    dim: int = 1024
    ffn_dim: int = 2736
    n_heads: int = 16
    rank: int = 256
    n_layers: int = 4
    vocab_size: int = 8192
    batch: int = 4
    seq: int = 1024


SMOKE = Shape(dim=128, ffn_dim=344, n_heads=8, rank=32, n_layers=2, vocab_size=512, batch=2, seq=64)


@dataclass
class VariantResult:
    name: str
    step_times: list[float] = field(default_factory=list)
    rep_times: list[float] = field(default_factory=list)  # mean step time of each repetition
    comm_times: list[float] = field(default_factory=list)
    instrumented_step_times: list[float] = field(default_factory=list)
    bytes_per_step: int = 0
    collectives_per_step: int = 0
    peak_step_mem_bytes: int = 0
    saved_activation_bytes: int = 0
    param_bytes_per_rank: int = 0
    warmup_times: list[float] = field(default_factory=list)  # the first one compiles, if compiled
    first_step_loss: float | None = None
    graphs_compiled_in_timed_steps: int = 0  # > 0: a recompile polluted the step times


class _CollectiveTimer(torch.utils._python_dispatch.TorchDispatchMode):
    """Wall time spent in collectives and their waits (instrumented steps only)."""

    def __init__(self):
        super().__init__()
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace in ("_c10d_functional", "c10d_functional", "c10d"):
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))  # wait_tensor is timed too
            self.seconds += time.perf_counter() - t0
            return out
        return func(*args, **(kwargs or {}))


def _build(name: str, shape: Shape, mesh, device, backend: str = "inductor"):
    """Model, AdamW, parameter bytes per rank and loss function of a variant; a
    ``[compiled]`` one is compiled after TP and checkpointing, as the trainer does."""
    from torch.distributed.tensor import DTensor

    from boost_titan.models.args import LlamaArgs
    from boost_titan.models.model import Transformer
    from boost_titan.tp_plans.btp import apply_btp
    from boost_titan.tp_plans.vanilla import apply_vanilla

    arch, plan, grouped, norm, ac = VARIANTS[base_name(name)]
    args = LlamaArgs(dim=shape.dim, n_layers=shape.n_layers, n_heads=shape.n_heads, ffn_dim=shape.ffn_dim,
                     vocab_size=shape.vocab_size, max_seq_len=shape.seq, arch=arch,
                     rank=shape.rank if arch != "dense" else 0, norm_eps=1e-6, group_linears=grouped)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(args)
    if plan == "btp":
        apply_btp(model, mesh, loss_parallel=True, norm_mode=norm)
    elif plan == "vanilla":
        apply_vanilla(model, mesh, loss_parallel=True)
    else:
        from torchtitan.models.llama3.infra.parallelize import apply_tp

        apply_tp(model, mesh, loss_parallel=True, enable_float8_tensorwise_tp=False)
    if ac.startswith("latent"):
        from boost_titan.parallelize import apply_latent_checkpointing

        keep = "none" if ac.endswith("recompute-attn") else "attention"
        apply_latent_checkpointing(model, "both", keep=keep, plan=plan, norm_mode=norm)
    elif ac == "full":  # torchtitan's full AC: every block recomputed whole
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        for layer_id, block in list(model.layers.named_children()):
            model.layers.register_module(layer_id, checkpoint_wrapper(block, preserve_rng_state=False))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    loss_fn = lm_loss
    if is_compiled(name):
        from boost_titan.compile import apply_compile

        apply_compile(model, SimpleNamespace(backend=backend))
        loss_fn = torch.compile(lm_loss, backend=backend)  # as torchtitan's build_cross_entropy_loss
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    param_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )
    return model, opt, param_bytes, loss_fn


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The benchmark's loss: token-mean cross-entropy (loss-parallel on sharded logits)."""
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def _step(model, opt, tokens, labels, loss_fn=lm_loss):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = loss_fn(model(tokens), labels)
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _scalar(loss: torch.Tensor) -> float:
    """A (possibly DTensor) scalar loss as a float, the same on every rank."""
    return (loss.full_tensor() if hasattr(loss, "full_tensor") else loss).item()


def _graphs_compiled() -> int:
    """Graphs dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _prepare_compile(n_models: int) -> None:
    """Compile settings for a process that compiles several models' blocks."""
    from boost_titan.compile import use_rank_local_compile_cache

    # each rank its own inductor cache, before anything is compiled (see compile.py)
    use_rank_local_compile_cache()
    # every variant's blocks share one forward code object, and dynamo caches a few
    # graphs per block kind per model against it; past the limit it would silently
    # run a block eager and time eager code as compiled, so raise the limit, and fail
    # rather than fall back
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * n_models)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def _saved_activation_bytes(model, tokens, labels, loss_fn=lm_loss) -> int:
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

    from boost_titan.models import model as lowrank_model

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

    sac_contexts = lowrank_model.create_selective_checkpoint_contexts

    def counting_contexts(policy):
        def counted(ctx, op, *args, **kwargs):
            decision = policy(ctx, op, *args, **kwargs)
            if not ctx.is_recompute and decision in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE):
                outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else [ctx.op_output]
                for t in outputs:
                    if isinstance(t, torch.Tensor):
                        pack(t)
            return decision
        return sac_contexts(counted)

    with loss_parallel(), mock.patch.object(lowrank_model, "create_selective_checkpoint_contexts", counting_contexts):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = loss_fn(model(tokens), labels)
        loss.backward()
    return total + sum(kept.values())


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def _worker(rank: int, world: int, cfg: dict, out_dir: str):
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    from torch.distributed.device_mesh import init_device_mesh

    cuda = torch.cuda.is_available()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(cfg["threads"])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=cfg["init_method"], rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))
    shape = Shape(**cfg["shape"])
    names = cfg["variants"]
    compiled = [n for n in names if is_compiled(n)]
    if compiled:
        _prepare_compile(len(compiled))
    built = {n: _build(n, shape, mesh, device, cfg["backend"]) for n in names}
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
    labels = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
    results = {n: VariantResult(n, param_bytes_per_rank=built[n][2]) for n in names}
    for n in names:  # warm-up, outside the timed region; a compiled variant compiles here
        _warm_up(built[n], results[n], cfg["warmup"], tokens, labels, device)
    for rep in range(cfg["reps"]):
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
        _sync(device)
        t0 = time.perf_counter()
        loss = _step(model, opt, tokens, labels, loss_fn)
        _sync(device)
        result.warmup_times.append(time.perf_counter() - t0)
        if i == 0:
            result.first_step_loss = _scalar(loss)


def _timed_steps(built, result: VariantResult, steps: int, tokens, labels, device) -> None:
    """One repetition of a variant: ``steps`` timed steps and their peak memory."""
    from boost_titan.cpu_runtime import current_rss_bytes, peak_rss_bytes, reset_peak_rss

    model, opt, _, loss_fn = built
    cuda = device.type == "cuda"
    rep_start = len(result.step_times)
    graphs_before = _graphs_compiled()
    for _ in range(steps):
        _sync(device)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = current_rss_bytes()
            reset_peak_rss()
        t0 = time.perf_counter()
        _step(model, opt, tokens, labels, loss_fn)
        _sync(device)
        result.step_times.append(time.perf_counter() - t0)
        peak = torch.cuda.max_memory_allocated() - base if cuda else peak_rss_bytes() - base
        result.peak_step_mem_bytes = max(result.peak_step_mem_bytes, peak)
    result.graphs_compiled_in_timed_steps += _graphs_compiled() - graphs_before
    result.rep_times.append(statistics.mean(result.step_times[rep_start:]))


def _instrumented_steps(built, result: VariantResult, comm_steps: int, tokens, labels, device) -> None:
    """Saved activations, collectives counted, and collectives timed, in steps that
    are not timed as training steps."""
    from boost_titan.comm_stats import CommCounter

    model, opt, _, loss_fn = built
    result.saved_activation_bytes = _saved_activation_bytes(model, tokens, labels, loss_fn)
    opt.zero_grad(set_to_none=True)
    if is_compiled(result.name):
        _profiled_comm_steps(built, result, comm_steps, tokens, labels, device)
        return
    with CommCounter() as counter:
        _step(model, opt, tokens, labels, loss_fn)
    result.collectives_per_step, result.bytes_per_step = counter.total()
    for _ in range(comm_steps):
        _sync(device)
        timer = _CollectiveTimer()
        t0 = time.perf_counter()
        with timer:
            _step(model, opt, tokens, labels, loss_fn)
        _sync(device)
        result.instrumented_step_times.append(time.perf_counter() - t0)
        result.comm_times.append(timer.seconds)


_DTYPE_BYTES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8}


def _profiled_comm_steps(built, result: VariantResult, comm_steps: int, tokens, labels, device) -> None:
    """Collectives of a compiled variant, counted and timed under torch.profiler:
    torch.compile refuses the dispatch modes (CommCounter, _CollectiveTimer) that
    count and time the eager variants' collectives, but the compiled graphs' functional
    collectives still pass the dispatcher, where the profiler records them. Bytes as
    CommCounter counts them: the input, an all-gather's output."""
    from torch.profiler import ProfilerActivity, profile

    from boost_titan.comm_stats import _COLLECTIVES

    model, opt, _, loss_fn = built
    world = dist.get_world_size()
    for i in range(max(comm_steps, 1)):  # the first profiled step also counts
        _sync(device)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            t0 = time.perf_counter()
            _step(model, opt, tokens, labels, loss_fn)
            _sync(device)
            step_s = time.perf_counter() - t0
        events = [e for e in prof.events() if _functional_op(e.name)
                  and not (e.cpu_parent and _functional_op(e.cpu_parent.name))]
        collectives = [e for e in events if _functional_op(e.name).startswith(_COLLECTIVES)]
        if i == 0:
            result.collectives_per_step = len(collectives)
            result.bytes_per_step = sum(_collective_bytes(e, world) for e in collectives)
        if i < comm_steps:
            result.instrumented_step_times.append(step_s)
            result.comm_times.append(sum(e.cpu_time_total for e in events) / 1e6)


def _functional_op(event_name: str) -> str:
    """'_c10d_functional::all_reduce_' -> 'all_reduce' (CommCounter's names), 'wait_tensor'
    for waits, '' for anything else (other namespaces, autograd wrappers)."""
    from boost_titan.comm_stats import _COLLECTIVES, _canonical

    namespace, _, op = event_name.partition("::")
    if namespace != "_c10d_functional":
        return ""
    op = _canonical(op)
    return op if op.startswith(_COLLECTIVES) or op == "wait_tensor" else ""


def _collective_bytes(event, world: int) -> int:
    """Payload of one profiled functional collective on this rank."""
    import math

    dtype = event.input_dtypes[0]
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"collective {event.name} on dtype {dtype!r}: add its size to _DTYPE_BYTES")
    nbytes = math.prod(event.input_shapes[0]) * _DTYPE_BYTES[dtype]
    return nbytes * world if "all_gather" in event.name else nbytes


def summarise(raw: dict, shape: Shape, world: int, device: str, backend: str | None = None) -> dict:
    tokens = shape.batch * shape.seq
    out = {"shape": shape.__dict__, "tp": world, "device": device, "variants": {}}
    for n, r in raw.items():
        out["variants"][n] = _variant_stats(r, tokens)
    v = out["variants"]
    compiled = any(is_compiled(n) for n in v)
    ratios = _plan_ratios(v, "", "")
    eff = _checkpoint_efficiency(v, raw, "")
    if eff:
        out["checkpoint_efficiency"] = eff
        ratios.update(_efficiency_ratio(eff, "", ""))
    if compiled:
        ratios.update(_plan_ratios(v, COMPILED, "_compiled"))
        eff_c = _checkpoint_efficiency(v, raw, COMPILED)
        if eff_c:
            out.setdefault("checkpoint_efficiency", {}).update(eff_c)
            ratios.update(_efficiency_ratio(eff_c, COMPILED, "_compiled"))
        out["compile"] = _compile_summary(raw, v, backend)
        for n, c in out["compile"]["variants"].items():
            ratios[f"{_slug(n)}_compiled_vs_eager_tokens_per_s"] = c["compiled_vs_eager_tokens_per_s"]
    out["ratios"] = ratios
    return out


def _variant_stats(r: dict, tokens: int) -> dict:
    med = statistics.median(r["step_times"])
    share = (sum(r["comm_times"]) / sum(r["instrumented_step_times"])) if r["comm_times"] else 0.0
    return {
        "step_time_median_s": med,
        "step_time_min_s": min(r["step_times"]),
        "step_time_max_s": max(r["step_times"]),
        "steps_timed": len(r["step_times"]),
        "tokens_per_s": tokens / med,
        "comm_share": share,
        "bytes_per_step": r["bytes_per_step"],
        "collectives_per_step": r["collectives_per_step"],
        "peak_step_mem_mib": r["peak_step_mem_bytes"] / 2**20,
        "saved_activation_mib": r["saved_activation_bytes"] / 2**20,
        "param_mib_per_rank": r["param_bytes_per_rank"] / 2**20,
    }


def _plan_ratios(v: dict, suffix: str, key_suffix: str) -> dict:
    """The plan comparisons among the variants named ``<name><suffix>`` (eager: "",
    compiled: COMPILED), keyed ``<ratio><key_suffix>``."""
    btp, vanilla, full = "btp" + suffix, "vanilla" + suffix, "fullrank (dense twin)" + suffix
    ungrouped, sync = "btp ungrouped" + suffix, "btp sync-norm" + suffix
    ratios = {}
    if btp in v and vanilla in v:
        ratios["btp_vs_vanilla_tokens_per_s"] = v[btp]["tokens_per_s"] / v[vanilla]["tokens_per_s"]
        ratios["vanilla_vs_btp_bytes"] = v[vanilla]["bytes_per_step"] / max(v[btp]["bytes_per_step"], 1)
    if btp in v and full in v:
        ratios["btp_vs_fullrank_tokens_per_s"] = v[btp]["tokens_per_s"] / v[full]["tokens_per_s"]
    if ungrouped in v:
        ratios["grouping_speedup"] = v[ungrouped]["step_time_median_s"] / v[btp]["step_time_median_s"]
    if sync in v:
        ratios["online_vs_sync_speedup"] = v[sync]["step_time_median_s"] / v[btp]["step_time_median_s"]
    return {k + key_suffix: val for k, val in ratios.items()}


def _checkpoint_efficiency(v: dict, raw: dict, suffix: str) -> dict:
    """Activation checkpointing efficiency: activation memory saved per ms added. The
    added time is the median over repetitions of (AC variant - its base) within the
    repetition: the two ran back to back, so machine drift largely cancels."""
    eff = {}
    for ac_name, base in (("btp latent-ckpt", "btp"), ("btp latent-ckpt recompute-attn", "btp"),
                          ("btp full-ac", "btp"), ("vanilla full-ac", "vanilla")):
        ac_name, base = ac_name + suffix, base + suffix
        if ac_name in v and base in v:
            saved_mb = (v[base]["saved_activation_mib"] - v[ac_name]["saved_activation_mib"]) * 2**20 / 1e6
            paired = [a - b for a, b in zip(raw[ac_name]["rep_times"], raw[base]["rep_times"])]
            added_ms = 1e3 * statistics.median(paired)
            eff[ac_name] = {"saved_mb": saved_mb, "added_ms": added_ms,
                            "added_ms_per_rep": [1e3 * d for d in paired],
                            # None: no added time measurable on this machine
                            "mb_per_ms": saved_mb / added_ms if added_ms > 0 else None}
    return eff


def _efficiency_ratio(eff: dict, suffix: str, key_suffix: str) -> dict:
    latent, full = "btp latent-ckpt" + suffix, "vanilla full-ac" + suffix
    if latent in eff and full in eff and None not in (eff[latent]["mb_per_ms"], eff[full]["mb_per_ms"]):
        return {"latent_ckpt_vs_vanilla_full_ac_efficiency" + key_suffix:
                eff[latent]["mb_per_ms"] / eff[full]["mb_per_ms"]}
    return {}


def _compile_summary(raw: dict, v: dict, backend: str | None) -> dict:
    """Per variant with a compiled twin: throughput both ways, the compiling step's
    time, and the first-step losses that must agree."""
    rows = {}
    for c in (n for n in v if is_compiled(n)):
        n = base_name(c)
        eager_loss, compiled_loss = raw[n]["first_step_loss"], raw[c]["first_step_loss"]
        rel = abs(compiled_loss - eager_loss) / max(abs(eager_loss), 1e-30)
        rows[n] = {
            "eager_tokens_per_s": v[n]["tokens_per_s"],
            "compiled_tokens_per_s": v[c]["tokens_per_s"],
            "compiled_vs_eager_tokens_per_s": v[c]["tokens_per_s"] / v[n]["tokens_per_s"],
            "compile_step_s": raw[c]["warmup_times"][0],  # the first, compiling step
            "eager_first_step_s": raw[n]["warmup_times"][0],
            "eager_first_step_loss": eager_loss,
            "compiled_first_step_loss": compiled_loss,
            "first_step_loss_rel_diff": rel,
            "loss_match": rel <= COMPILE_LOSS_RTOL,
            "graphs_compiled_in_timed_steps": raw[c]["graphs_compiled_in_timed_steps"],
        }
    return {"backend": backend, "loss_rtol": COMPILE_LOSS_RTOL, "inductor_cache_dir": _inductor_cache_dir(),
            "variants": rows}


def _inductor_cache_dir() -> str:
    """Where the ranks cached their compiled graphs (a warm cache shortens the
    compiling step; TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) times a cold compile)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default_cache_dir()
    return os.path.join(base, "rank<R>")


def loss_mismatches(summary: dict) -> list[str]:
    """One line per compiled variant whose first-step loss is not its eager twin's."""
    rows = summary.get("compile", {}).get("variants", {})
    return [f"{n}: eager {c['eager_first_step_loss']:.6f}, compiled {c['compiled_first_step_loss']:.6f} "
            f"(relative difference {c['first_step_loss_rel_diff']:.2e} > {COMPILE_LOSS_RTOL:g})"
            for n, c in rows.items() if not c["loss_match"]]


def _slug(name: str) -> str:
    """A variant name as a key or TensorBoard tag: 'fullrank (dense twin) [compiled]'
    -> 'fullrank_dense_twin_compiled'."""
    for ch in "()[]":
        name = name.replace(ch, "")
    return name.strip().replace(" ", "_")


def markdown(summary: dict) -> str:
    s = summary["shape"]
    lines = [
        f"TP{summary['tp']} on {summary['device']}; d={s['dim']} f={s['ffn_dim']} heads={s['n_heads']} "
        f"r={s['rank']} layers={s['n_layers']} vocab={s['vocab_size']}, batch {s['batch']} x seq {s['seq']}, fp32",
        "",
        "| variant | step time median (min-max) | tokens/s | comm share | MiB comm/step | collectives/step | saved activations MiB/rank | peak step RSS rise MiB/rank | params MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, v in summary["variants"].items():
        lines.append(
            f"| {n} | {v['step_time_median_s']:.3f} s ({v['step_time_min_s']:.3f}-{v['step_time_max_s']:.3f}) "
            f"| {v['tokens_per_s']:.0f} | {100 * v['comm_share']:.1f}% | {v['bytes_per_step'] / 2**20:.1f} "
            f"| {v['collectives_per_step']} | {v['saved_activation_mib']:.0f} | {v['peak_step_mem_mib']:.0f} "
            f"| {v['param_mib_per_rank']:.1f} |"
        )
    lines.append("")
    if "compile" in summary:
        lines += _compile_markdown(summary["compile"])
    for n, e in summary.get("checkpoint_efficiency", {}).items():
        per_rep = ", ".join(f"{d:+.0f}" for d in e["added_ms_per_rep"])
        value = f"{e['mb_per_ms']:.2f} MB/ms" if e["mb_per_ms"] is not None else "no measurable added time"
        lines.append(f"- {n}: saves {e['saved_mb']:.0f} MB of activations for {e['added_ms']:+.0f} ms "
                     f"(median of per-repetition differences {per_rep}) = {value}")
    for k, val in summary["ratios"].items():
        lines.append(f"- {k}: **{val:.2f}x**")
    return "\n".join(lines) + "\n"


def _compile_markdown(comp: dict) -> list[str]:
    lines = [
        f"Compiled ({comp['backend']}, per block + loss) vs eager; the compiling first step is not in "
        "the step times:",
        "",
        "| variant | eager tokens/s | compiled tokens/s | compiled/eager | compile step s (eager first step s) "
        "| first-step loss eager / compiled (rel diff) |",
        "|---|---|---|---|---|---|",
    ]
    for n, c in comp["variants"].items():
        flag = "" if c["loss_match"] else " **MISMATCH**"
        lines.append(
            f"| {n} | {c['eager_tokens_per_s']:.0f} | {c['compiled_tokens_per_s']:.0f} "
            f"| {c['compiled_vs_eager_tokens_per_s']:.2f}x | {c['compile_step_s']:.1f} ({c['eager_first_step_s']:.2f}) "
            f"| {c['eager_first_step_loss']:.5f} / {c['compiled_first_step_loss']:.5f} "
            f"({c['first_step_loss_rel_diff']:.1e}){flag} |"
        )
    lines.append("\nCompiled rows' collectives are counted and timed under torch.profiler (torch.compile "
                 "refuses the dispatch modes that count and time the eager rows').")
    for n, why in comp.get("not_compiled", {}).items():
        lines.append(f"\n{n}: eager only; {why}")
    recompiled = [n for n, c in comp["variants"].items() if c["graphs_compiled_in_timed_steps"]]
    if recompiled:
        lines.append(f"\nWarning: graphs were compiled during timed steps of {recompiled}; their step "
                     "times include compilation (raise --warmup).")
    return lines + [""]


def charts(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["variants"])
    v = summary["variants"]
    height = max(3.5, 0.35 * len(names) + 1)  # --compile doubles the bars
    fig, ax = plt.subplots(figsize=(8, height))
    med = [v[n]["step_time_median_s"] for n in names]
    err = [[med[i] - v[n]["step_time_min_s"] for i, n in enumerate(names)],
           [v[n]["step_time_max_s"] - med[i] for i, n in enumerate(names)]]
    ax.barh(names, med, xerr=err, color=["#2a9d8f" if n.startswith("btp") else "#e76f51" for n in names])
    ax.set_xlabel("step time (s), median with min-max")
    ax.invert_yaxis()
    ax.set_title(f"TP{summary['tp']} training step, {summary['device']}")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, height))
    ax.barh(names, [v[n]["bytes_per_step"] / 2**20 for n in names], color="#457b9d")
    ax.set_xlabel("communication per step (MiB, counted)")
    for i, n in enumerate(names):
        ax.text(v[n]["bytes_per_step"] / 2**20, i, f" {100 * v[n]['comm_share']:.0f}% of step time", va="center")
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "comm_share.png", dpi=110)
    plt.close(fig)


def tensorboard(summary: dict, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(out / "tb"))
    for n, v in summary["variants"].items():
        tag = _slug(n)
        for k in ("step_time_median_s", "tokens_per_s", "comm_share", "bytes_per_step", "peak_step_mem_mib"):
            w.add_scalar(f"{tag}/{k}", v[k], 0)
    for n, c in summary.get("compile", {}).get("variants", {}).items():
        w.add_scalar(f"{_slug(compiled_name(n))}/compile_step_s", c["compile_step_s"], 0)
    for k, val in summary["ratios"].items():
        w.add_scalar(f"ratios/{k}", val, 0)
    w.close()


# ----------------------------------------------------------------------------- GEMM mode
def gemm_bench(flavor: str, tp: int, batch: int, seq: int, dtype: str, m_scale: float, seconds: float) -> dict:
    """Single device: time each plan's per-rank forward GEMMs at a flavor's shapes."""
    from boost_titan.models.flavors import flavors_for
    from boost_titan.plan import block_gemms

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = getattr(torch, dtype)
    args = flavors_for("cola")[flavor]
    m = max(1, int(batch * seq * m_scale))
    out = {"flavor": flavor, "tp": tp, "m": m, "dtype": dtype, "device": str(dev), "plans": {}}
    for plan in ("fullrank", "vanilla", "btp"):
        a = args.with_overrides(arch="dense", rank=0) if plan == "fullrank" else args
        total_flops, total_s, rows = 0.0, 0.0, []
        for gm in block_gemms(a, plan, tp, m):
            x = torch.randn(gm.m, gm.k, device=dev, dtype=dt)
            w = torch.randn(gm.k, gm.n, device=dev, dtype=dt)
            x @ w
            if dev.type == "cuda":
                torch.cuda.synchronize()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                x @ w
                n += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt_s = (time.perf_counter() - t0) / n
            flops = 2 * gm.m * gm.k * gm.n
            rows.append({"gemm": gm.name, "m": gm.m, "k": gm.k, "n": gm.n, "tflops": flops / dt_s / 1e12})
            total_flops += flops
            total_s += dt_s
        out["plans"][plan] = {"gemms": rows, "block_gemm_time_s": total_s, "tflops": total_flops / total_s / 1e12}
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/bench")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 timed steps per variant")
    # None = not given: the training benchmark and GEMM mode have different defaults
    p.add_argument("--tp", type=int, default=None,
                   help=f"TP degree = ranks (GPUs when visible); default {TRAIN_DEFAULT_TP}, "
                        f"GEMM mode {GEMM_DEFAULTS['tp']}")
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per repetition")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per variant (they absorb compilation)")
    p.add_argument("--comm-steps", type=int, default=1, help="instrumented steps for the comm share")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--malloc-cache", action="store_true",
                   help="CPU: glibc malloc keeps freed memory (no mmap, no trim), as CUDA's caching "
                        "allocator does, so a step's time holds no page faults; the RSS-rise column "
                        "then reads only growth past the largest earlier step")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of {list(VARIANTS)}, or 'ac' for the checkpointing set")
    p.add_argument("--compile", action="store_true",
                   help="also run every variant torch.compile'd (blocks and loss), side by side with eager")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for --compile")
    for k, v in Shape().__dict__.items():
        gemm = f", GEMM mode {GEMM_DEFAULTS[k]}" if k in GEMM_DEFAULTS else ""
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v}{gemm}")
    p.add_argument("--gemm", action="store_true",
                   help="single-device GEMM mode: per-rank GEMMs of each plan at --flavor, --tp, --batch x --seq "
                        "(default 7B, TP4, 4 x 4096)")
    p.add_argument("--flavor", default="7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--m-scale", type=float, default=1.0, help="GEMM mode: scale b*s (CPU: e.g. 0.03)")
    p.add_argument("--gemm-seconds", type=float, default=0.5, help="GEMM mode: seconds timed per GEMM")
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse flags that the chosen mode would silently ignore, and bad counts."""
    for flag in ("tp", "batch", "seq"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            p.error(f"--{flag} must be >= 1, got {value}")
    if a.gemm:
        ignored = [f"--{k.replace('_', '-')} {getattr(a, k)}" for k in Shape().__dict__
                   if k not in GEMM_DEFAULTS and getattr(a, k) is not None]
        if ignored:
            p.error(f"GEMM mode takes its model shapes from --flavor ({a.flavor}); {', '.join(ignored)} "
                    "only apply to the training benchmark")
        if a.compile:
            p.error("--compile applies to the training benchmark, not to GEMM mode (plain matmuls)")
        return
    if a.compile and a.warmup < 1:
        p.error(f"--compile needs --warmup >= 1 (the first step compiles and must not be timed), got {a.warmup}")


def _world_size(p: argparse.ArgumentParser, tp: int) -> int:
    """Exactly ``tp`` ranks: GPUs 0..tp-1 when CUDA is visible, else gloo CPU ranks."""
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if visible < tp:
            p.error(f"--tp {tp} needs {tp} GPUs; only {visible} visible")
    return tp


def _run_gemm(a: argparse.Namespace, out: Path) -> None:
    given = {k: getattr(a, k) for k in GEMM_DEFAULTS}
    tp, batch, seq = ({**GEMM_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}[k]
                      for k in ("tp", "batch", "seq"))
    res = gemm_bench(a.flavor, tp, batch, seq, a.dtype, a.m_scale, a.gemm_seconds)
    res.update(batch=batch, seq=seq)
    (out / "gemm.json").write_text(json.dumps(res, indent=2))
    print(f"{a.flavor} TP{tp}, m = {res['m']} tokens (batch {batch} x seq {seq} x m-scale {a.m_scale:g}), "
          f"{a.dtype}, {res['device']}")
    for plan, r in res["plans"].items():
        print(f"{plan:9s} block GEMMs {r['block_gemm_time_s'] * 1e3:8.2f} ms  {r['tflops']:.2f} TFLOP/s")


def _variant_names(p: argparse.ArgumentParser, a: argparse.Namespace, tp: int) -> tuple[list[str], dict[str, str]]:
    """The variants to run, compiled twins included, and those refused compilation."""
    names = list(AC_VARIANTS) if a.variants == "ac" else [n.strip() for n in a.variants.split(",")]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; valid: {list(VARIANTS)}")
    return with_compiled(names, tp) if a.compile else (names, {})


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    if a.gemm:
        _run_gemm(a, out)
        return

    shape = SMOKE if a.smoke else Shape(**{k: getattr(a, k) for k in Shape().__dict__ if getattr(a, k) is not None})
    world = _world_size(p, a.tp or TRAIN_DEFAULT_TP)
    names, not_compiled = _variant_names(p, a, world)
    for n, why in not_compiled.items():
        print(f"--compile: {n!r} runs eager only: {why}")
    cfg = {
        "shape": shape.__dict__, "variants": names, "threads": a.threads,
        "reps": 1 if a.smoke else a.reps, "steps": 2 if a.smoke else a.steps,
        "warmup": a.warmup, "comm_steps": a.comm_steps, "backend": a.compile_backend,
        "init_method": f"file://{(out / '.rendezvous').resolve()}",
    }
    rendezvous = out / ".rendezvous"
    if rendezvous.exists():
        rendezvous.unlink()
    if a.malloc_cache:  # read by glibc when the spawned ranks start
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
    torch.multiprocessing.spawn(_worker, args=(world, cfg, str(out)), nprocs=world, join=True)
    raw = json.loads((out / "raw.json").read_text())
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else
              f"CPU ({a.threads} thread/rank, gloo{', caching malloc' if a.malloc_cache else ''})")
    summary = summarise(raw, shape, world, device, a.compile_backend if a.compile else None)
    if not_compiled:
        summary["compile"]["not_compiled"] = not_compiled
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    (out / "results.md").write_text(md)
    charts(summary, out)
    tensorboard(summary, out)
    print(md)
    print(f"wrote {out}/results.json, results.md, step_time.png, comm_share.png, tb/")
    mismatches = loss_mismatches(summary)
    if mismatches:  # outputs are written first, so the numbers can be inspected
        raise SystemExit("compiled first-step loss differs from eager:\n  " + "\n  ".join(mismatches))


if __name__ == "__main__":
    main()
