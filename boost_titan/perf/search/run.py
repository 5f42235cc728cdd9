"""The search itself: rank every layout by predicted tokens/s, walk the ranking until
one passes the config checks and fits, verify the winner with the full dry run; the
command's options and output (``boost-titan search``)."""

from __future__ import annotations

import os
import sys
import tempfile

from boost_titan.config import refuse
from boost_titan.perf.hardware import GPU
from boost_titan.perf.search.layouts import (
    BASE_RECIPE,
    GIB,
    Candidate,
    check_candidate,
    enumerate_layouts,
    recipe_text,
    sections_for,
    write_recipe,
)
from boost_titan.perf.search.memory import (
    estimate_memory,
    trace_activations,
    trace_key,
    trace_pool,
)
from boost_titan.perf.step_time import Efficiency, step_time

# ----------------------------------------------------------------------------- search


def search(
    model: str,
    flavor: str,
    gpus: int,
    hw: GPU,
    eff: Efficiency,
    gpus_per_node: int | None = None,
    seq: int = 4096,
    global_batch_tokens: int | None = None,
    top: int = 5,
    headroom: float = 0.1,
    verify: bool = True,
    log=print,
) -> list[Candidate]:
    """The ``top`` fastest layouts that pass the config checks and fit (estimated);
    with ``verify`` the first is the fastest whose full dry run fits too."""
    from boost_titan.models.flavors import MODEL_ARCH, flavors_for

    if model not in MODEL_ARCH:
        raise ValueError(f"unknown model {model!r}; valid: {sorted(MODEL_ARCH)}")
    table = flavors_for(MODEL_ARCH[model])
    if flavor not in table:
        raise ValueError(f"unknown flavor {flavor!r} of {model}; valid: {sorted(table)}")
    args = table[flavor].with_overrides(max_seq_len=seq)
    gpn = gpus_per_node or hw.gpus_per_node
    if gpus < 1 or (gpus > gpn and gpus % gpn):
        raise ValueError(f"--gpus {gpus}: must be >= 1 and, beyond one node, a multiple of {gpn}")
    gpn = min(gpn, gpus)
    tokens = global_batch_tokens or 1024 * seq
    if tokens % seq:
        raise ValueError(f"--global-batch-tokens {tokens}: not a multiple of --seq {seq}")
    layouts = enumerate_layouts(args, gpus, gpn, seq, tokens // seq)
    if not layouts:
        raise ValueError(
            f"no layout of {gpus} GPUs splits a global batch of {tokens // seq} sequences "
            f"(try --global-batch-tokens as a multiple of {gpus * seq})"
        )
    ranked = sorted(
        (
            Candidate(lay, step_time(args, lay, hw, eff), sections_for(model, flavor, lay, args))
            for lay in layouts
        ),
        key=lambda c: -c.tokens_per_s,
    )
    log(f"{len(ranked)} layouts ranked by the step-time model")
    budget = hw.memory_gib * GIB * (1 - headroom)
    traces: dict = {}
    chosen: list[Candidate] = []
    with trace_pool() as pool:
        _walk(ranked, traces, chosen, pool, args, model, flavor, seq, gpus, budget, top, log)
    if verify and chosen:
        chosen = _verify_first(chosen, ranked, model, flavor, gpus, hw, headroom, log)
    return chosen


def _walk(ranked, traces, chosen, pool, args, model, flavor, seq, gpus, budget, top, log):
    """From the fastest: the first ``top`` that fit (estimated) and pass the checks."""
    for i, c in enumerate(ranked):
        if len(chosen) == top:
            break
        key = trace_key(c.layout)
        if key not in traces:
            # this one, and what the next few of its TP degree need, in one process
            batch = {key} | {
                k
                for k in (trace_key(x.layout) for x in ranked[i : i + 16])
                if k[0] == key[0] and k not in traces
            }
            log(f"tracing activations (TP, plan, checkpointing): {sorted(batch)}")
            traces.update(trace_activations(model, flavor, batch, pool))
        c.memory = estimate_memory(args, c.layout, traces[key])
        if c.memory["total"] > budget:
            continue
        c.refused = check_candidate(c.sections, gpus)
        if c.refused:
            log(f"refused by the config check: {c.layout.describe()}: {c.refused}")
            continue
        chosen.append(c)


def _verify_first(chosen, ranked, model, flavor, gpus, hw, headroom, log):
    """The full dry run of the first; while it does not fit, drop it and try the next."""
    from boost_titan.perf.dryrun.run import dry_run

    while chosen:
        c = chosen[0]
        with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
            f.write(recipe_text(c.sections, [], BASE_RECIPE))
        try:
            roles = dry_run(["--job.config_file", f.name], gpus, c.layout.pp)
        finally:
            os.unlink(f.name)
        peak = max(r.peak_bytes for r in roles)
        c.verified = dict(peak_bytes=peak, fits=peak <= hw.memory_gib * GIB * (1 - headroom))
        log(
            f"dry run of the winner ({c.layout.describe()}): peak {peak / GIB:.1f} GiB "
            f"(estimated {c.memory['total'] / GIB:.1f} GiB): "
            f"{'fits' if c.verified['fits'] else 'does NOT fit; next'}"
        )
        if c.verified["fits"]:
            return chosen
        chosen = chosen[1:]
    return chosen


# ---------------------------------------------------------------------------- output


def format_results(cands: list[Candidate], hw: GPU, gpus: int) -> str:
    lines = [
        f"{'#':>2s} {'layout':68s} {'tokens/s':>10s} {'step s':>7s} {'mem GiB':>8s}",
    ]
    for k, c in enumerate(cands, 1):
        mem = c.memory["total"] / GIB
        ver = f" (dry run {c.verified['peak_bytes'] / GIB:.1f})" if c.verified else ""
        lines.append(
            f"{k:2d} {c.layout.describe():68s} {c.tokens_per_s:10,.0f} "
            f"{c.breakdown.step_s:7.2f} {mem:8.1f}{ver}"
        )
    if cands:
        c = cands[0]
        m = c.memory
        lines.append(f"winner on {gpus} x {hw.name} ({hw.memory_gib:g} GiB): {c.layout.describe()}")
        lines.append(
            "memory per rank (estimated): "
            f"params+grads+AdamW {m['params_grads_optimizer'] / GIB:.1f} GiB, "
            f"FSDP gathered {m['fsdp_gathered'] / GIB:.1f} GiB, "
            f"activations {m['activations'] / GIB:.1f} GiB, "
            f"fp32 logit gradient {m['temporaries'] / GIB:.1f} GiB"
        )
        lines.append("time per step:")
        lines.append(c.breakdown.format())
    return "\n".join(lines)


def add_arguments(p, search: bool = False) -> None:
    """The search's options; ``search``: for ``boost-titan search`` (no --search flag)."""
    g = p.add_argument_group("layout search" if search else "layout search (--search)")
    if not search:
        g.add_argument("--search", action="store_true", help="search the fastest layout that fits")
    g.add_argument(
        "--gpus",
        type=int,
        default=8,
        help="GPUs the layout must fill (default 8; beyond one node a multiple of a node)",
    )
    g.add_argument("--gpu", default="h100-80", help="a GPU of boost_titan.perf.hardware")
    g.add_argument("--gpu-file", help="a custom GPU (TOML; keys in boost_titan.perf.hardware)")
    g.add_argument(
        "--gpus-per-node", type=int, default=None, help="GPUs per node (default: the GPU's node)"
    )
    g.add_argument("--global-batch-tokens", type=int, default=None, help="default 1024 x seq")
    g.add_argument("--top", type=int, default=5, help="layouts to print, fastest first (default 5)")
    g.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of GPU memory kept free for what the trace does not see (default 0.1)",
    )
    g.add_argument("--calibrate", help="refit the model on a gpu_check.json first")
    g.add_argument("--write", help="write the winner as a recipe (TOML)")
    g.add_argument("--no-verify", action="store_true", help="skip the winner's full dry run")


def run_search(a, prog: str) -> int:
    """``plan --search``'s body (``prog``: the command that refuses bad input)."""
    from boost_titan.perf.calibration import default_efficiency
    from boost_titan.perf.dryrun.run import quiet_warnings
    from boost_titan.perf.hardware import resolve_gpu

    quiet_warnings()
    try:
        hw = resolve_gpu(a.gpu, a.gpu_file)
        eff, source = default_efficiency(a.calibrate)
        if a.write and not a.write.endswith(".toml"):
            raise ValueError(f"--write {a.write}: a recipe file ends in .toml")
        log = lambda s: print(s, file=sys.stderr)  # noqa: E731
        cands = search(
            a.model, a.flavor, a.gpus, hw, eff, a.gpus_per_node, a.seq,
            a.global_batch_tokens, a.top, a.headroom, not a.no_verify, log,
        )  # fmt: skip
    except ValueError as e:
        refuse(prog, e)
    print(source)
    if not cands:
        print(f"no layout of {a.model} {a.flavor} fits {a.gpus} x {hw.name}", file=sys.stderr)
        return 1
    print(format_results(cands, hw, a.gpus))
    if a.write:
        c = cands[0]
        name = os.path.splitext(os.path.basename(a.write))[0]
        sections = {"job": {"dump_folder": f"./outputs/{name}", "description": name}}
        sections.update(c.sections)
        write_recipe(
            a.write,
            sections,
            [
                f"{a.model} {a.flavor} on {a.gpus} x {hw.name}: {c.layout.describe()}",
                f"(boost-titan search; predicted {c.tokens_per_s:,.0f} "
                f"tokens/s, {c.breakdown.step_s:.2f} s/step)",
                f"  dry run: boost-titan dryrun --config {a.write} --ngpu {a.gpus} "
                f"--gpu-memory {hw.memory_gib:g}",
            ],
        )
        print(f"wrote {a.write}")
    return 0
