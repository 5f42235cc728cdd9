"""The plot and table of ``benchmarks/quality.py`` from its ``results.json``:

    PYTHONPATH=. .venv/bin/python benchmarks/quality_plot.py outputs/quality/results.json \\
        docs/quality.png
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

COLORS = {"llama2": "black", "svd": "tab:blue", "cola": "tab:orange", "lax": "tab:green",
          "loro": "tab:purple"}  # fmt: skip
LABELS = {"llama2": "dense llama2", "svd": "SVD", "cola": "CoLA", "lax": "LaX", "loro": "SVD+LORO"}


def points(run: dict, dense: dict | None) -> tuple[list[float], list[float], list[float]]:
    """(tokens, training FLOPs, val loss) of a run; a converted run starts where the dense
    run it was converted from stood (its tokens and FLOPs)."""
    tps, fpt = run["tokens_per_step"], run["flops_per_token"]
    tokens0 = flops0 = 0.0
    if run["group"] == "converted":
        tokens0 = run["steps"] * tps  # it trains the second half of the budget
        flops0 = tokens0 * dense["flops_per_token"]
    steps = [s for s, _ in run["val"]]
    tokens = [tokens0 + s * tps for s in steps]
    flops = [flops0 + s * tps * fpt for s in steps]
    return tokens, flops, [v for _, v in run["val"]]


def label(run: dict) -> str:
    name = LABELS[run["model"]]
    if run["group"] == "converted":
        return f"{name} from dense, r={run['rank']}"
    return f"{name} seed {run['seed']}" if run["model"] in ("llama2", "cola") else name


def plot(summary: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = summary["runs"]
    dense = next(r for r in runs if r["model"] == "llama2" and r["seed"] == summary["seeds"][0])
    low, high = min(summary["ranks"]), max(summary["ranks"])
    fig, axes = plt.subplots(2, 2, figsize=(13, 10))
    for row, question in enumerate(("scratch", "converted")):
        for col, axis in enumerate(("tokens", "training FLOPs")):
            ax = axes[row][col]
            for run in runs:
                if run["group"] not in ("dense", question):
                    continue
                x_tok, x_flops, loss = points(run, dense)
                second_seed = run["seed"] != summary["seeds"][0]
                style = "-"
                if run["group"] == "converted":
                    style = "-" if run["rank"] == high else ":"
                elif second_seed:
                    style = "--"
                ax.plot(
                    x_tok if col == 0 else x_flops,
                    loss,
                    style,
                    color=COLORS[run["model"]],
                    lw=1 if second_seed else 1.6,
                    label=label(run),
                )
            if question == "converted":  # the from-scratch low-rank runs, for reference
                for run in runs:
                    if run["group"] == "scratch" and run["seed"] == summary["seeds"][0]:
                        x_tok, x_flops, loss = points(run, dense)
                        ax.plot(x_tok if col == 0 else x_flops, loss, color=COLORS[run["model"]],
                                alpha=0.25, lw=1)  # fmt: skip
            ax.set_xlabel(axis)
            ax.set_ylabel("validation loss (nats/token)")
            ax.set_ylim(top=min(7.6, ax.get_ylim()[1]))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    axes[0][0].set_title("from scratch: same tokens")
    axes[0][1].set_title("from scratch: training FLOPs")
    axes[1][0].set_title(
        f"converted from dense step {dense['steps'] // 2}: r={high} solid, r={low} dotted\n"
        "(faint: from scratch)",
        fontsize=10,
    )
    axes[1][1].set_title("converted: training FLOPs (the dense half included)", fontsize=10)
    fig.suptitle(
        f"{summary['flavor']} on the embedded corpus, {summary['steps']} steps x "
        f"{dense['tokens_per_step']} tokens, validation on {summary['val_tokens']} tokens "
        "(benchmarks/quality.py)",
        fontsize=10,
    )
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)


def table(summary: dict) -> str:
    runs = summary["runs"]
    dense = next(r for r in runs if r["model"] == "llama2" and r["seed"] == summary["seeds"][0])
    lines = [
        "| run | group | rank | final val loss | training PFLOPs | FLOPs/token | wall s |",
        "|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        _, flops, loss = points(run, dense)
        rank = run["rank"] or ("" if run["model"] == "llama2" else "flavor")
        lines.append(
            f"| {run['name']} | {run['group']} | {rank} | {loss[-1]:.4f} | "
            f"{flops[-1] / 1e15:.3f} | {run['flops_per_token'] / 1e6:.1f}M | {run['wall_s']:.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    data = json.loads(Path(sys.argv[1]).read_text())
    plot(data, Path(sys.argv[2]))
    print(table(data))
