"""Render a benchmark summary: results.md (markdown), PNG charts, TensorBoard scalars."""

from __future__ import annotations

from pathlib import Path

from boost_titan.bench.stats import slug
from boost_titan.bench.variants import compiled_name


def markdown(summary: dict) -> str:
    s = summary["shape"]
    lines = [
        f"TP{summary['tp']} on {summary['device']}; d={s['dim']} f={s['ffn_dim']} "
        f"heads={s['n_heads']} r={s['rank']} layers={s['n_layers']} vocab={s['vocab_size']}, "
        f"batch {s['batch']} x seq {s['seq']}, fp32",
        "",
        "| variant | step time median (min-max) | tokens/s | comm share | MiB comm/step "
        "| collectives/step | saved activations MiB/rank | peak step RSS rise MiB/rank "
        "| params MiB/rank |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n, v in summary["variants"].items():
        lines.append(
            f"| {n} | {v['step_time_median_s']:.3f} s "
            f"({v['step_time_min_s']:.3f}-{v['step_time_max_s']:.3f}) "
            f"| {v['tokens_per_s']:.0f} | {100 * v['comm_share']:.1f}% "
            f"| {v['bytes_per_step'] / 2**20:.1f} "
            f"| {v['collectives_per_step']} | {v['saved_activation_mib']:.0f} "
            f"| {v['peak_step_mem_mib']:.0f} "
            f"| {v['param_mib_per_rank']:.1f} |"
        )
    lines.append("")
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


def charts(summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(summary["variants"])
    v = summary["variants"]
    height = max(3.5, 0.35 * len(names) + 1)  # --compile doubles the bars
    fig, ax = plt.subplots(figsize=(8, height))
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
    ax.set_title(f"TP{summary['tp']} training step, {summary['device']}")
    fig.tight_layout()
    fig.savefig(out / "step_time.png", dpi=110)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(8, height))
    ax.barh(names, [v[n]["bytes_per_step"] / 2**20 for n in names], color="#457b9d")
    ax.set_xlabel("communication per step (MiB, counted)")
    for i, n in enumerate(names):
        ax.text(
            v[n]["bytes_per_step"] / 2**20,
            i,
            f" {100 * v[n]['comm_share']:.0f}% of step time",
            va="center",
        )
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(out / "comm_share.png", dpi=110)
    plt.close(fig)


def tensorboard(summary: dict, out: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    w = SummaryWriter(str(out / "tb"))
    for n, v in summary["variants"].items():
        tag = slug(n)
        for k in (
            "step_time_median_s",
            "tokens_per_s",
            "comm_share",
            "bytes_per_step",
            "peak_step_mem_mib",
        ):
            w.add_scalar(f"{tag}/{k}", v[k], 0)
    for n, c in summary.get("compile", {}).get("variants", {}).items():
        w.add_scalar(f"{slug(compiled_name(n))}/compile_step_s", c["compile_step_s"], 0)
    for k, val in summary["ratios"].items():
        w.add_scalar(f"ratios/{k}", val, 0)
    w.close()
