"""``boost-titan plan``: the planner's report of every tensor-parallel plan of a model
(collectives and their volume, GEMM shapes and arithmetic intensity, traced per-rank
memory), and ``boost-titan search`` (= ``plan --search``), the layout search.

    boost-titan plan --model cola_llama2 --flavor 7b --tp 4 --batch 4 --seq 4096
    boost-titan plan ... --json
    boost-titan plan ... --no-memory    # communication and GEMMs only, no trace
    boost-titan search --model cola_llama2 --flavor 13b --gpus 32 --gpu h100-80
        # the fastest layout that fits (boost_titan.perf.search; --write recipes/X.toml)

What is computed: :mod:`boost_titan.perf.plan`; the search: :mod:`boost_titan.perf.search`.
"""

from __future__ import annotations

import argparse
import json

from boost_titan.config import RMSNORM_MODES, Parser
from boost_titan.perf.plan import DTYPE_BYTES, GIB, analyse
from boost_titan.perf.search.run import add_arguments, run_search


def _format_memory(rep: dict) -> list[str]:
    traced = [e for e in rep["plans"].values() if e.get("total_bytes_per_rank") is not None]
    if not traced:
        requested = rep["memory"].startswith("traced")
        return [f"memory per rank: not traced{' (no valid plan)' if requested else ''}"]
    big = max(e["total_bytes_per_rank"] for e in traced) >= GIB
    unit, div = ("GiB", GIB) if big else ("MiB", 2**20)
    cols = ("params", "grads", "optimizer", "activation", "total")
    lines = [
        f"memory per rank, {rep['memory']}:",
        f"{'plan':9s}" + "".join(f"{c:>13s}" for c in cols),
    ]
    for plan, e in rep["plans"].items():
        if e.get("total_bytes_per_rank") is None:
            lines.append(f"{plan:9s} not traced ({e['why_invalid'] or 'invalid plan'})")
        else:
            lines.append(
                f"{plan:9s}"
                + "".join(f"{e[f'{c}_bytes_per_rank'] / div:10.2f}{unit}" for c in cols)
            )
    lines += _format_breakdowns(rep, div, unit)
    return lines


def _format_breakdowns(rep: dict, div: int, unit: str) -> list[str]:
    """One line per traced plan: the saved bytes per block by role, and the stack's ends.
    Their sum is the bytes autograd saves; the table's activation column is MemTracker's
    allocations alive at the forward's end, stated where the two differ."""
    from boost_titan.perf.dryrun.breakdown import ActivationBreakdown, format_breakdown

    lines = []
    for plan, e in rep["plans"].items():
        b = e.get("activation_breakdown")
        if b is None:
            continue
        lines.append(f"activation per block ({plan}): {format_breakdown(b, div, unit)}")
        saved, act = ActivationBreakdown.from_json(b).saved_total, e["activation_bytes_per_rank"]
        if saved != act:
            lines.append(
                f"  saved {saved} B vs activation {act} B ({saved - act:+d} B): the table "
                f"counts allocations alive at the forward's end, the breakdown the "
                f"storages autograd saves"
            )
    return lines


def format_report(rep: dict) -> str:
    mib = 2**20
    m = rep["model"]
    lines = [
        f"{m['arch']} d={m['dim']} f={m['ffn_dim']} L={m['n_layers']} h={m['n_heads']} "
        f"kv={m['n_kv_heads']} r={m['rank']}  "
        f"TP={rep['tp']} b={rep['batch']} s={rep['seq']} {rep['dtype']}",
        f"{'plan':9s} {'fwd/block':>12s} {'bwd/block':>12s} {'fwd/stack':>12s} {'colls f/b':>10s} "
        f"{'params/rank':>13s} {'min AI':>7s} {'mean AI':>8s}",
    ]
    for plan, e in rep["plans"].items():
        if "block_forward" not in e:
            lines.append(f"{plan:9s} n/a ({e['why_invalid']})")
            continue
        ai = [g["intensity"] for g in e["gemms"]]
        flag = "" if e["valid"] else "  (invalid: " + e["why_invalid"] + ")"
        lines.append(
            f"{plan:9s} {e['block_forward_bytes'] / mib:9.1f}MiB "
            f"{e['block_backward_bytes'] / mib:9.1f}MiB "
            f"{e['step_forward_bytes'] / mib:9.0f}MiB "
            f"{len(e['block_forward']):4d}/{len(e['block_backward']):<5d}"
            f"{e['params_per_rank'] / 1e6:11.1f}M "
            f"{min(ai):7.0f} {sum(ai) / len(ai):8.0f}{flag}"
        )
    lines.append(f"recommended: {rep['recommended']} ({rep['why']})")
    lines += _format_memory(rep)
    return "\n".join(lines)


def main(argv: list[str] | None = None, search: bool = False) -> None:
    """``boost-titan plan``; ``search``: ``boost-titan search`` (= ``plan --search``),
    which takes the options the search reads, no others."""
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()  # before torchtitan is imported: the memory is traced here
    from boost_titan.models.flavors import MODEL_ARCH, flavors_for

    p = Parser(
        prog="boost-titan search" if search else "boost-titan plan",
        description="The fastest layout of a model that fits --gpus GPUs (boost-titan plan "
        "--search); --write writes it as a recipe."
        if search
        else __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", default="cola_llama2", choices=sorted(MODEL_ARCH), help="default %(default)s"
    )
    p.add_argument("--flavor", default="7b", help="a flavor name, or a converted step folder")
    p.add_argument("--seq", type=int, default=4096, help="sequence length (default 4096)")
    if not search:  # the report of one layout's plans
        p.add_argument("--tp", type=int, default=4, help="tensor parallel degree (default 4)")
        p.add_argument("--batch", type=int, default=4, help="micro-batch size")
        p.add_argument(
            "--dtype",
            default="bfloat16",
            choices=sorted(DTYPE_BYTES),
            help="the activations' and weights' dtype (default %(default)s)",
        )
        p.add_argument("--rank", type=int, default=0, help="override the flavor's rank")
        p.add_argument(
            "--ungrouped",
            action="store_true",
            help="BTP without grouping the projections that share an input",
        )
        p.add_argument(
            "--rmsnorm",
            default="online",
            choices=list(RMSNORM_MODES),
            help="BTP's RMSNorm statistics: in the next latent all-reduce (online) or their "
            "own all-reduce (sync)",
        )
        p.add_argument("--json", action="store_true", help="print the report as JSON")
        p.add_argument(
            "--no-memory",
            action="store_true",
            help="skip the traced per-rank memory: communication and GEMMs only (seconds faster)",
        )
    add_arguments(p, search)  # --search and its options: boost_titan.perf.search
    a = p.parse_args(argv)
    if search or a.search:
        raise SystemExit(run_search(a, p.prog))
    from boost_titan.train.specs import FlavorTable

    # a built-in name, or a path: a converted step's recorded model (docs/from-dense.md)
    table = FlavorTable(a.model, flavors_for(MODEL_ARCH[a.model]))
    if a.flavor not in table:
        p.error(f"unknown flavor {a.flavor!r}; valid: {sorted(table)} or a step's path")
    try:
        args = table[a.flavor]
    except ValueError as e:
        p.error(str(e))
    if a.rank:
        args = args.with_overrides(rank=a.rank)
    args.validate()
    rep = analyse(
        args,
        a.tp,
        a.batch,
        a.seq,
        a.dtype,
        grouped=not a.ungrouped,
        norm=a.rmsnorm,
        memory=not a.no_memory,
        trace_in_process=True,
    )
    print(json.dumps(rep, indent=2) if a.json else format_report(rep))


def search_main(argv: list[str] | None = None) -> None:
    """``boost-titan search``."""
    main(argv, search=True)
