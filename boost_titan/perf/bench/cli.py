"""Side-by-side benchmark: the same low-rank model under BTP and vanilla TP, and its
dense twin under full-rank TP, trained in one run on the same machine.

    boost-titan bench                  # CPU: TP2 on 2 gloo ranks (NCCL on GPUs)
    boost-titan bench --smoke          # tiny model, 2 steps: checks the outputs
    boost-titan bench --compile        # every variant eager and torch.compile'd,
                                                 # side by side
    boost-titan bench --gemm           # single device: per-rank GEMMs of each plan

Every variant runs whole training steps (forward, backward, AdamW). Repetitions are
interleaved (variant A, B, C, A, B, C, ...) so machine drift hits all alike; the first
``--warmup`` steps of each variant are excluded. Per variant it reports step time
(median, min-max), tokens/s, the communication share of a step (collectives timed in
separate, instrumented steps), communication volume per step (counted, stated in
all-reduce-equivalent bytes: an all-gather or reduce-scatter counts half its payload, as
the planner counts; results.json also keeps the raw bytes), and peak memory per rank (CPU:
peak RSS rise during a step above the RSS before it, plus exact parameter bytes; GPU:
max allocated). Ablations (grouping off, sync norm) are BTP variants of the same model.

``--variants`` takes a comma list of variant ids (``btp``, ``btp-sp``, ``vanilla``,
``fullrank``, ...; ``--help`` lists them) and group names (``default``, ``ac``); an id is
the variant's one spelling in every output.

``--compile`` adds a compiled twin of every selected variant, ``<id>-compiled``,
run in the same interleaved repetitions: its blocks compiled as the trainer does
(``boost_titan.parallel.compile.apply_compile``) and its loss ``torch.compile``'d. Its first
warm-up step compiles; that step's time is reported separately (``compile`` in
results.json) and never enters the step-time statistics. A compiled variant's first-step
loss must equal its eager twin's within 1e-4 relative, or the run fails after writing
its outputs.

Outputs in ``--out``: results.json, results.md, step_time.png, comm_share.png and
TensorBoard runs under tb/: one per variant (tb/<id>/, the same tags in each, one
point per timed step), so ``tensorboard --logdir <out>/tb`` overlays the variants, and
tb/ratios/.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from boost_titan.config import Parser
from boost_titan.perf.bench.gemm import GEMM_DEFAULTS, gemm_bench
from boost_titan.perf.bench.report import charts, markdown, tensorboard
from boost_titan.perf.bench.stats import loss_mismatches, summarise
from boost_titan.perf.bench.variants import (
    DEFAULT_VARIANTS,
    GROUPS,
    SMOKE,
    VARIANTS,
    Shape,
    resolve_variants,
    with_compiled,
)
from boost_titan.perf.bench.worker import worker

TRAIN_DEFAULT_TP = 2


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="boost-titan bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default="outputs/bench",
        help="folder for results.json, results.md, charts and tb/ (default %(default)s)",
    )
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 timed steps per variant")
    # None = not given: the training benchmark and GEMM mode have different defaults
    p.add_argument(
        "--tp",
        type=int,
        default=None,
        help=f"TP degree = ranks (GPUs when visible); default {TRAIN_DEFAULT_TP}, "
        f"GEMM mode {GEMM_DEFAULTS['tp']}",
    )
    p.add_argument("--reps", type=int, default=3, help="interleaved repetitions")
    p.add_argument("--steps", type=int, default=2, help="timed steps per variant per repetition")
    p.add_argument(
        "--warmup", type=int, default=1, help="untimed steps per variant (they absorb compilation)"
    )
    p.add_argument(
        "--comm-steps", type=int, default=1, help="instrumented steps for the comm share"
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument(
        "--malloc-cache",
        action="store_true",
        help="CPU: glibc malloc keeps freed memory (no mmap, no trim), as CUDA's caching "
        "allocator does, so a step's time holds no page faults; the RSS-rise column "
        "then reads only growth past the largest earlier step",
    )
    p.add_argument(
        "--variants",
        default=",".join(DEFAULT_VARIANTS),
        help=f"comma list of variant ids ({', '.join(VARIANTS)}) and groups ({_groups()})",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="also run every variant torch.compile'd (blocks and loss), side by side with eager",
    )
    p.add_argument(
        "--compile-backend", default="inductor", help="torch.compile backend for --compile"
    )
    for k, v in Shape().__dict__.items():
        gemm = f", GEMM mode {GEMM_DEFAULTS[k]}" if k in GEMM_DEFAULTS else ""
        p.add_argument(
            f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v}{gemm}"
        )
    p.add_argument(
        "--gemm",
        action="store_true",
        help="single-device GEMM mode: per-rank GEMMs of each plan at --flavor, --tp, "
        "--batch x --seq (default 7B, TP4, 4 x 4096)",
    )
    p.add_argument("--flavor", default="7b", help="GEMM mode: the model's size (default 7b)")
    p.add_argument(
        "--dtype", default="bfloat16", help="GEMM mode: the matmuls' dtype (default bfloat16)"
    )
    p.add_argument(
        "--m-scale", type=float, default=1.0, help="GEMM mode: scale b*s (CPU: e.g. 0.03)"
    )
    p.add_argument(
        "--gemm-seconds", type=float, default=0.5, help="GEMM mode: seconds timed per GEMM"
    )
    return p


def _groups() -> str:
    return "; ".join(f"{g} = {','.join(names)}" for g, names in GROUPS.items())


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Refuse flags that the chosen mode would silently ignore, and bad counts."""
    for flag in ("tp", "batch", "seq"):
        value = getattr(a, flag)
        if value is not None and value < 1:
            p.error(f"--{flag} must be >= 1, got {value}")
    if a.gemm:
        ignored = [
            f"--{k.replace('_', '-')} {getattr(a, k)}"
            for k in Shape().__dict__
            if k not in GEMM_DEFAULTS and getattr(a, k) is not None
        ]
        if ignored:
            p.error(
                f"GEMM mode takes its model shapes from --flavor ({a.flavor}); "
                f"{', '.join(ignored)} only apply to the training benchmark"
            )
        if a.compile:
            p.error("--compile applies to the training benchmark, not to GEMM mode (plain matmuls)")
        return
    if a.compile:
        from boost_titan.parallel.compile import check_backend

        try:
            check_backend(a.compile_backend, "--compile-backend")
        except ValueError as e:
            p.error(str(e))
    if a.compile and a.warmup < 1:
        p.error(
            "--compile needs --warmup >= 1 (the first step compiles and must not be timed), "
            f"got {a.warmup}"
        )


def _world_size(p: argparse.ArgumentParser, tp: int) -> int:
    """Exactly ``tp`` ranks: GPUs 0..tp-1 when CUDA is visible, else gloo CPU ranks."""
    if torch.cuda.is_available():
        visible = torch.cuda.device_count()
        if visible < tp:
            p.error(f"--tp {tp} needs {tp} GPUs; only {visible} visible")
    return tp


def _run_gemm(a: argparse.Namespace, out: Path) -> None:
    given = {k: getattr(a, k) for k in GEMM_DEFAULTS}
    tp, batch, seq = (
        {**GEMM_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}[k]
        for k in ("tp", "batch", "seq")
    )
    res = gemm_bench(a.flavor, tp, batch, seq, a.dtype, a.m_scale, a.gemm_seconds)
    res.update(batch=batch, seq=seq)
    (out / "gemm.json").write_text(json.dumps(res, indent=2))
    print(
        f"{a.flavor} TP{tp}, m = {res['m']} tokens "
        f"(batch {batch} x seq {seq} x m-scale {a.m_scale:g}), {a.dtype}, {res['device']}"
    )
    for plan, r in res["plans"].items():
        print(
            f"{plan:9s} block GEMMs {r['block_gemm_time_s'] * 1e3:8.2f} ms  "
            f"{r['tflops']:.2f} TFLOP/s"
        )


def _variant_names(
    p: argparse.ArgumentParser, a: argparse.Namespace, tp: int
) -> tuple[list[str], dict[str, str]]:
    """The variants to run, compiled twins included, and those refused compilation."""
    try:
        names = resolve_variants(a.variants)
    except ValueError as e:
        p.error(str(e))
    return with_compiled(names, tp) if a.compile else (names, {})


def render(
    out: Path,
    raw: dict,
    shape: Shape,
    world: int,
    device: str,
    backend: str | None = None,
    not_compiled: dict[str, str] | None = None,
) -> dict:
    """raw.json's measurements -> results.json, results.md, charts and tb/ in ``out``."""
    summary = summarise(raw, shape, world, device, backend)
    if not_compiled:
        summary["compile"]["not_compiled"] = not_compiled
    (out / "results.json").write_text(json.dumps(summary, indent=2))
    md = markdown(summary)
    (out / "results.md").write_text(md)
    charts(summary, out)
    tensorboard(summary, out)
    print(md)
    print(f"wrote {out}/results.json, results.md, step_time.png, comm_share.png, tb/")
    return summary


def main(argv: list[str] | None = None) -> None:
    p = _parser()
    a = p.parse_args(argv)
    _check_args(p, a)
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    if a.gemm:
        _run_gemm(a, out)
        return

    shape = (
        SMOKE
        if a.smoke
        else Shape(**{k: getattr(a, k) for k in Shape().__dict__ if getattr(a, k) is not None})
    )
    world = _world_size(p, a.tp or TRAIN_DEFAULT_TP)
    names, not_compiled = _variant_names(p, a, world)
    for n, why in not_compiled.items():
        print(f"--compile: {n!r} runs eager only: {why}")
    cfg = {
        "shape": shape.__dict__,
        "variants": names,
        "threads": a.threads,
        "reps": 1 if a.smoke else a.reps,
        "steps": 2 if a.smoke else a.steps,
        "warmup": a.warmup,
        "comm_steps": a.comm_steps,
        "backend": a.compile_backend,
        "init_method": f"file://{(out / '.rendezvous').resolve()}",
    }
    rendezvous = out / ".rendezvous"
    if rendezvous.exists():
        rendezvous.unlink()
    if a.malloc_cache:  # read by glibc when the spawned ranks start
        os.environ["GLIBC_TUNABLES"] = (
            "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=1099511627776"
        )
    torch.multiprocessing.spawn(worker, args=(world, cfg, str(out)), nprocs=world, join=True)
    raw = json.loads((out / "raw.json").read_text())
    device = (
        torch.cuda.get_device_name(0)
        if torch.cuda.is_available()
        else f"CPU ({a.threads} thread/rank, gloo{', caching malloc' if a.malloc_cache else ''})"
    )
    summary = render(
        out, raw, shape, world, device, a.compile_backend if a.compile else None, not_compiled
    )
    mismatches = loss_mismatches(summary)
    if mismatches:  # outputs are written first, so the numbers can be inspected
        raise SystemExit(
            "compiled first-step loss differs from eager:\n  " + "\n  ".join(mismatches)
        )
