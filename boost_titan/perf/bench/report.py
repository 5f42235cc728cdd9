"""Render a benchmark summary: results.md (markdown), PNG charts, TensorBoard runs.

Communication volume is all-reduce-equivalent bytes everywhere (``volume_per_step``,
``boost_titan.observability.comm_stats.allreduce_equivalent``). TensorBoard: one run per variant,
``tb/<variant id>/``, every run with the same tags (:data:`TB_TAGS`), so TensorBoard
overlays the variants in one chart, plus ``tb/ratios/`` with the plan ratios.
"""

from __future__ import annotations

from pathlib import Path

from boost_titan.perf.bench.variants import DESCRIPTIONS, SMOKE, base_name, compiled_name

VOLUME_NOTE = (
    "Communication volume in all-reduce-equivalent bytes (the planner's convention, "
    "`boost_titan.observability.comm_stats.allreduce_equivalent`: an all-gather or "
    "reduce-scatter counts half its payload); results.json keeps the raw counted payload "
    "in `bytes_per_step`."
)

# Per timed step (x-axis: the variant's timed-step index, repetitions in order):
# tag -> the variant's figure in results.json it equals (the per-step ones: the step's).
TB_TAGS = {
    "time/step_ms": "step_times_s",  # x 1e3, per step
    "throughput/tokens_per_s": "tokens_per_s",  # tokens / step time, per step
    "loss_metrics/global_avg_loss": "step_losses",  # per step
    "tp/comm_share_pct": "comm_share",  # x 100, the instrumented steps' share
    "tp/bytes_MiB": "volume_per_step",  # all-reduce-equivalent, / 2**20
    "tp/collectives": "collectives_per_step",
    "memory/peak_step_MiB": "peak_step_mem_mib",
}


def markdown(summary: dict) -> str:
    s = summary["shape"]
    lines = [
        f"TP{summary['tp']} on {summary['device']}; d={s['dim']} f={s['ffn_dim']} "
        f"heads={s['n_heads']} r={s['rank']} layers={s['n_layers']} vocab={s['vocab_size']}, "
        f"batch {s['batch']} x seq {s['seq']}, fp32",
        "",
        "| variant | step time median (min-max) | tokens/s | comm share "
        "| comm/step MiB (all-reduce-equiv.) | collectives/step | saved activations MiB/rank "
        "| peak step RSS rise MiB/rank "
        "| params MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, v in summary["variants"].items():
        lines.append(
            f"| {n} | {v['step_time_median_s']:.3f} s "
            f"({v['step_time_min_s']:.3f}-{v['step_time_max_s']:.3f}) "
            f"| {v['tokens_per_s']:.0f} | {100 * v['comm_share']:.1f}% "
            f"| {v['volume_per_step'] / 2**20:.1f} "
            f"| {v['collectives_per_step']} | {v['saved_activation_mib']:.0f} "
            f"| {v['peak_step_mem_mib']:.0f} "
            f"| {v['param_mib_per_rank']:.1f} |"
        )
    lines += ["", legend(summary["variants"]), "", VOLUME_NOTE, ""]
    if "compile" in summary:
        lines += _compile_markdown(summary["compile"])
    for n, e in summary.get("checkpoint_efficiency", {}).items():
        per_rep = ", ".join(f"{d:+.0f}" for d in e["added_ms_per_rep"])
        value = (
            f"{e['mb_per_ms']:.2f} MB/ms"
            if e["mb_per_ms"] is not None
            else "no measurable added time"
        )
        lines.append(
            f"- {n}: saves {e['saved_mb']:.0f} MB of activations for {e['added_ms']:+.0f} ms "
            f"(median of per-repetition differences {per_rep}) = {value}"
        )
    for k, val in summary["ratios"].items():
        lines.append(f"- {k}: **{val:.2f}x**")
    return "\n".join(lines) + "\n"


def legend(variants) -> str:
    """What each variant id in the table is (a compiled twin: its eager twin, compiled)."""
    bases = dict.fromkeys(base_name(n) for n in variants)
    compiled = " `<id>-compiled`: the same, torch.compile'd." if len(bases) < len(variants) else ""
    return "Variants: " + "; ".join(f"`{n}`: {DESCRIPTIONS[n]}" for n in bases) + "." + compiled


def _compile_markdown(comp: dict) -> list[str]:
    lines = [
        f"Compiled ({comp['backend']}, per block + loss) vs eager; the compiling first step "
        "is not in the step times:",
        "",
        "| variant | eager tokens/s | compiled tokens/s | compiled/eager "
        "| compile step s (eager first step s) "
        "| first-step loss eager / compiled (rel diff) |",
        "|---|---|---|---|---|---|",
    ]
    for n, c in comp["variants"].items():
        flag = "" if c["loss_match"] else " **MISMATCH**"
        lines.append(
            f"| {n} | {c['eager_tokens_per_s']:.0f} | {c['compiled_tokens_per_s']:.0f} "
            f"| {c['compiled_vs_eager_tokens_per_s']:.2f}x "
            f"| {c['compile_step_s']:.1f} ({c['eager_first_step_s']:.2f}) "
            f"| {c['eager_first_step_loss']:.5f} / {c['compiled_first_step_loss']:.5f} "
            f"({c['first_step_loss_rel_diff']:.1e}){flag} |"
        )
    lines.append(
        "\nCompiled rows' collectives are counted and timed under torch.profiler (torch.compile "
        "refuses the dispatch modes that count and time the eager rows')."
    )
    for n, why in comp.get("not_compiled", {}).items():
        lines.append(f"\n{n}: eager only; {why}")
    recompiled = [n for n, c in comp["variants"].items() if c["graphs_compiled_in_timed_steps"]]
    if recompiled:
        lines.append(
            f"\nWarning: graphs were compiled during timed steps of {recompiled}; their step "
            "times include compilation (raise --warmup)."
        )
    return lines + [""]


def chart_title(summary: dict, what: str) -> str:
    """A chart's title: what it shows, the layout and device, the shape, and whether
    this was a ``--smoke`` run (its tiny shape checks the outputs, not the speed)."""
    s = summary["shape"]
    shape = (
        f"d={s['dim']} f={s['ffn_dim']} r={s['rank']}, {s['n_layers']} layers, "
        f"batch {s['batch']} x seq {s['seq']}, fp32"
    )
    lines = [f"BTP vs baselines: {what}", f"TP{summary['tp']} on {summary['device']}", shape]
    if s == SMOKE.__dict__:
        lines.append("SMOKE RUN (--smoke): checks the outputs, not a measurement")
    return "\n".join(lines)


def step_time_figure(summary: dict):
    """The step-time chart (a matplotlib Figure): each variant's median with min-max."""
    import matplotlib.pyplot as plt

    names = list(summary["variants"])
    v = summary["variants"]
    fig, ax = plt.subplots(figsize=(8, _chart_height(names)))
    med = [v[n]["step_time_median_s"] for n in names]
    err = [
        [med[i] - v[n]["step_time_min_s"] for i, n in enumerate(names)],
        [v[n]["step_time_max_s"] - med[i] for i, n in enumerate(names)],
    ]
    ax.barh(
        names, med, xerr=err, color=["#2a9d8f" if n.startswith("btp") else "#e76f51" for n in names]
    )
    ax.set_xlabel("step time (s), median with min-max")
    ax.invert_yaxis()
    ax.set_title(chart_title(summary, "training step time"))
    fig.tight_layout()
    return fig


def comm_share_figure(summary: dict):
    """The communication chart (a matplotlib Figure): volume per step, share of step time."""
    import matplotlib.pyplot as plt

    names = list(summary["variants"])
    v = summary["variants"]
    fig, ax = plt.subplots(figsize=(8, _chart_height(names)))
    ax.barh(names, [v[n]["volume_per_step"] / 2**20 for n in names], color="#457b9d")
    ax.set_xlabel("communication per step (MiB, all-reduce-equivalent)")
    for i, n in enumerate(names):
        ax.text(
            v[n]["volume_per_step"] / 2**20,
            i,
            f" {100 * v[n]['comm_share']:.0f}% of step time",
            va="center",
        )
    ax.invert_yaxis()
    ax.set_title(chart_title(summary, "TP communication per step"))
    fig.tight_layout()
    return fig


def _chart_height(names: list[str]) -> float:
    return max(4.0, 0.35 * len(names) + 2.0)  # --compile doubles the bars; 3-4 line title


def charts(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for build, name in ((step_time_figure, "step_time.png"), (comm_share_figure, "comm_share.png")):
        fig = build(summary)
        fig.savefig(out / name, dpi=110)
        plt.close(fig)


def tb_scalars(v: dict, tokens: int) -> dict[str, list[float]]:
    """One variant's TensorBoard series: tag -> value at each timed step."""
    steps = v["step_times_s"]
    n = len(steps)
    series = {
        "time/step_ms": [1e3 * t for t in steps],
        "throughput/tokens_per_s": [tokens / t for t in steps],
        "tp/comm_share_pct": [100 * v["comm_share"]] * n,
        "tp/bytes_MiB": [v["volume_per_step"] / 2**20] * n,
        "tp/collectives": [float(v["collectives_per_step"])] * n,
        "memory/peak_step_MiB": [v["peak_step_mem_mib"]] * n,
    }
    if len(v.get("step_losses", [])) == n:
        series["loss_metrics/global_avg_loss"] = list(v["step_losses"])
    return series


def tensorboard(summary: dict, out: Path) -> None:
    """``tb/<variant id>/``: one run per variant, the same tags in each (TensorBoard
    overlays the runs in one chart per tag) and the dashboard's custom-scalars layout
    of these tags (``dashboard.BENCH_CHARTS``, charted as training runs are);
    ``tb/ratios/``: the plan ratios (and compile step times) at step 0 and results.md
    as text."""
    import shutil

    from torch.utils.tensorboard import SummaryWriter

    from boost_titan.observability.dashboard import BENCH_CHARTS, layout

    shutil.rmtree(out / "tb", ignore_errors=True)  # a rerun's events replace, not add
    s = summary["shape"]
    tokens = s["batch"] * s["seq"]
    for n, v in summary["variants"].items():
        w = SummaryWriter(str(out / "tb" / n))
        w.add_custom_scalars(layout(validation=False, charts=BENCH_CHARTS))
        for tag, values in tb_scalars(v, tokens).items():
            for step, val in enumerate(values):
                w.add_scalar(tag, val, step)
        w.close()
    w = SummaryWriter(str(out / "tb" / "ratios"))
    for k, val in summary["ratios"].items():
        w.add_scalar(f"ratios/{k}", val, 0)
    for n, c in summary.get("compile", {}).get("variants", {}).items():
        w.add_scalar(f"compile/{compiled_name(n)}_step_s", c["compile_step_s"], 0)
    w.add_text("results", markdown(summary), 0)
    w.close()
