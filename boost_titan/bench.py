"""Side-by-side benchmark: the same low-rank model under BTP and vanilla TP, and its
dense twin under full-rank TP, trained in one run on the same machine.

    python -m boost_titan.bench                  # CPU: TP2 on 2 gloo ranks (NCCL on GPUs)
    python -m boost_titan.bench --smoke          # tiny model, 2 steps: checks the outputs
    python -m boost_titan.bench --gemm           # single device: per-rank GEMMs of each plan

Every variant runs whole training steps (forward, backward, AdamW). Repetitions are
interleaved (variant A, B, C, A, B, C, ...) so machine drift hits all alike; the first
``--warmup`` steps of each variant are excluded. Per variant it reports step time
(median, min-max), tokens/s, the communication share of a step (collectives timed in
separate, instrumented steps), bytes per step (counted), and peak memory per rank (CPU:
peak RSS rise during a step above the RSS before it, plus exact parameter bytes; GPU:
max allocated). Ablations (grouping off, sync norm) are BTP variants of the same model.

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


def _build(name: str, shape: Shape, mesh, device):
    from torch.distributed.tensor import DTensor

    from boost_titan.models.args import LlamaArgs
    from boost_titan.models.model import Transformer
    from boost_titan.tp_plans.btp import apply_btp
    from boost_titan.tp_plans.vanilla import apply_vanilla

    arch, plan, grouped, norm, ac = VARIANTS[name]
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
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    param_bytes = sum(
        (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size() for p in model.parameters()
    )
    return model, opt, param_bytes


def _step(model, opt, tokens, labels):
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def _saved_activation_bytes(model, tokens, labels) -> int:
    """Bytes autograd keeps from forward to backward, parameters excluded: the memory
    activation checkpointing trades for recompute (exact, unlike RSS). Each storage
    counts once, however many ops or views keep it; outputs that selective
    checkpointing caches (latent checkpointing's kept attention outputs) count too."""
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
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
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

    from boost_titan.comm_stats import CommCounter

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
    built = {n: _build(n, shape, mesh, device) for n in names}
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
    labels = torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
    results = {n: VariantResult(n, param_bytes_per_rank=built[n][2]) for n in names}
    from boost_titan.cpu_runtime import current_rss_bytes as cur_rss, peak_rss_bytes as peak_rss
    from boost_titan.cpu_runtime import reset_peak_rss as reset_rss


    for n in names:  # warm-up, outside the timed region
        for _ in range(cfg["warmup"]):
            _step(built[n][0], built[n][1], tokens, labels)
    for rep in range(cfg["reps"]):
        for n in names:
            model, opt, _ = built[n]
            rep_start = len(results[n].step_times)
            for _ in range(cfg["steps"]):
                _sync(device)
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                    base = torch.cuda.memory_allocated()
                else:
                    base = cur_rss()
                    reset_rss()
                t0 = time.perf_counter()
                _step(model, opt, tokens, labels)
                _sync(device)
                results[n].step_times.append(time.perf_counter() - t0)
                peak = torch.cuda.max_memory_allocated() - base if cuda else peak_rss() - base
                results[n].peak_step_mem_bytes = max(results[n].peak_step_mem_bytes, peak)
            results[n].rep_times.append(statistics.mean(results[n].step_times[rep_start:]))
    for n in names:  # instrumented steps: collective counts/bytes and time
        model, opt, _ = built[n]
        results[n].saved_activation_bytes = _saved_activation_bytes(model, tokens, labels)
        opt.zero_grad(set_to_none=True)
        with CommCounter() as counter:
            _step(model, opt, tokens, labels)
        results[n].collectives_per_step, results[n].bytes_per_step = counter.total()
        for _ in range(cfg["comm_steps"]):
            _sync(device)
            timer = _CollectiveTimer()
            t0 = time.perf_counter()
            with timer:
                _step(model, opt, tokens, labels)
            _sync(device)
            results[n].instrumented_step_times.append(time.perf_counter() - t0)
            results[n].comm_times.append(timer.seconds)
    if rank == 0:
        with open(os.path.join(out_dir, "raw.json"), "w") as f:
            json.dump({n: r.__dict__ for n, r in results.items()}, f)
    dist.destroy_process_group()


def summarise(raw: dict, shape: Shape, world: int, device: str) -> dict:
    tokens = shape.batch * shape.seq
    out = {"shape": shape.__dict__, "tp": world, "device": device, "variants": {}}
    for n, r in raw.items():
        med = statistics.median(r["step_times"])
        share = (sum(r["comm_times"]) / sum(r["instrumented_step_times"])) if r["comm_times"] else 0.0
        out["variants"][n] = {
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
    v = out["variants"]
    ratios = {}
    if "btp" in v and "vanilla" in v:
        ratios["btp_vs_vanilla_tokens_per_s"] = v["btp"]["tokens_per_s"] / v["vanilla"]["tokens_per_s"]
        ratios["vanilla_vs_btp_bytes"] = v["vanilla"]["bytes_per_step"] / max(v["btp"]["bytes_per_step"], 1)
    if "btp" in v and "fullrank (dense twin)" in v:
        ratios["btp_vs_fullrank_tokens_per_s"] = v["btp"]["tokens_per_s"] / v["fullrank (dense twin)"]["tokens_per_s"]
    if "btp ungrouped" in v:
        ratios["grouping_speedup"] = v["btp ungrouped"]["step_time_median_s"] / v["btp"]["step_time_median_s"]
    if "btp sync-norm" in v:
        ratios["online_vs_sync_speedup"] = v["btp sync-norm"]["step_time_median_s"] / v["btp"]["step_time_median_s"]
    # activation checkpointing efficiency: activation memory saved per ms added. The
    # added time is the median over repetitions of (AC variant - its base) within the
    # repetition: the two ran back to back, so machine drift largely cancels.
    eff = {}
    for ac_name, base in (("btp latent-ckpt", "btp"), ("btp latent-ckpt recompute-attn", "btp"),
                          ("btp full-ac", "btp"), ("vanilla full-ac", "vanilla")):
        if ac_name in v and base in v:
            saved_mb = (v[base]["saved_activation_mib"] - v[ac_name]["saved_activation_mib"]) * 2**20 / 1e6
            paired = [a - b for a, b in zip(raw[ac_name]["rep_times"], raw[base]["rep_times"])]
            added_ms = 1e3 * statistics.median(paired)
            eff[ac_name] = {"saved_mb": saved_mb, "added_ms": added_ms,
                            "added_ms_per_rep": [1e3 * d for d in paired],
                            # None: no added time measurable on this machine
                            "mb_per_ms": saved_mb / added_ms if added_ms > 0 else None}
    if eff:
        out["checkpoint_efficiency"] = eff
        if "btp latent-ckpt" in eff and "vanilla full-ac" in eff and None not in (
                eff["btp latent-ckpt"]["mb_per_ms"], eff["vanilla full-ac"]["mb_per_ms"]):
            ratios["latent_ckpt_vs_vanilla_full_ac_efficiency"] = (
                eff["btp latent-ckpt"]["mb_per_ms"] / eff["vanilla full-ac"]["mb_per_ms"])
    out["ratios"] = ratios
    return out


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
    for n, e in summary.get("checkpoint_efficiency", {}).items():
        per_rep = ", ".join(f"{d:+.0f}" for d in e["added_ms_per_rep"])
        value = f"{e['mb_per_ms']:.2f} MB/ms" if e["mb_per_ms"] is not None else "no measurable added time"
        lines.append(f"- {n}: saves {e['saved_mb']:.0f} MB of activations for {e['added_ms']:+.0f} ms "
                     f"(median of per-repetition differences {per_rep}) = {value}")
    for k, val in summary["ratios"].items():
        lines.append(f"- {k}: **{val:.2f}x**")
    return "\n".join(lines) + "\n"


def charts(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["variants"])
    v = summary["variants"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
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
    fig, ax = plt.subplots(figsize=(8, 3.5))
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
        tag = n.replace(" ", "_").replace("(", "").replace(")", "")
        for k in ("step_time_median_s", "tokens_per_s", "comm_share", "bytes_per_step", "peak_step_mem_mib"):
            w.add_scalar(f"{tag}/{k}", v[k], 0)
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="outputs/bench")
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 timed steps per variant")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per repetition")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--comm-steps", type=int, default=1, help="instrumented steps for the comm share")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--malloc-cache", action="store_true",
                   help="CPU: glibc malloc keeps freed memory (no mmap, no trim), as CUDA's caching "
                        "allocator does, so a step's time holds no page faults; the RSS-rise column "
                        "then reads only growth past the largest earlier step")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma list of {list(VARIANTS)}, or 'ac' for the checkpointing set")
    for k, v in Shape().__dict__.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=v)
    p.add_argument("--gemm", action="store_true", help="single-device GEMM mode (7B/TP4 shapes)")
    p.add_argument("--flavor", default="7b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--m-scale", type=float, default=1.0, help="GEMM mode: scale b*s (CPU: e.g. 0.03)")
    a = p.parse_args(argv)
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    if a.gemm:
        res = gemm_bench(a.flavor, 4, 4, 4096, a.dtype, a.m_scale, 0.5)
        (out / "gemm.json").write_text(json.dumps(res, indent=2))
        for plan, r in res["plans"].items():
            print(f"{plan:9s} block GEMMs {r['block_gemm_time_s'] * 1e3:8.2f} ms  {r['tflops']:.2f} TFLOP/s")
        return

    shape = SMOKE if a.smoke else Shape(**{k: getattr(a, k) for k in Shape().__dict__})
    names = list(AC_VARIANTS) if a.variants == "ac" else [n.strip() for n in a.variants.split(",")]
    unknown = set(names) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; valid: {list(VARIANTS)}")
    cfg = {
        "shape": shape.__dict__, "variants": names, "threads": a.threads,
        "reps": 1 if a.smoke else a.reps, "steps": 2 if a.smoke else a.steps,
        "warmup": a.warmup, "comm_steps": a.comm_steps,
        "init_method": f"file://{(out / '.rendezvous').resolve()}",
    }
    rendezvous = out / ".rendezvous"
    if rendezvous.exists():
        rendezvous.unlink()
    world = torch.cuda.device_count() if torch.cuda.is_available() else a.tp
    if a.malloc_cache:  # read by glibc when the spawned ranks start
        os.environ["GLIBC_TUNABLES"] = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
    torch.multiprocessing.spawn(_worker, args=(world, cfg, str(out)), nprocs=world, join=True)
    raw = json.loads((out / "raw.json").read_text())
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available() else
              f"CPU ({a.threads} thread/rank, gloo{', caching malloc' if a.malloc_cache else ''})")
    summary = summarise(raw, shape, world, device)
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    (out / "results.md").write_text(md)
    charts(summary, out)
    tensorboard(summary, out)
    print(md)
    print(f"wrote {out}/results.json, results.md, step_time.png, comm_share.png, tb/")


if __name__ == "__main__":
    main()
