"""Memory per rank of CoLA 7B and its dense twin at 32k and 128k tokens, for each way to
split the GPUs between tensor and context parallelism: the dry run's figures
(``boost_titan.perf.dryrun``, FakeTensor traces at full shape, one process per layout).

    .venv/bin/python benchmarks/long_context_memory.py            # the table in docs/recipes.md

Each row is the long-context recipe (``recipes/<model>_7b_<seq>.toml``: one sequence
per data-parallel replica, RoPE theta 500000) with its TP and CP degrees overridden;
the GPUs they leave shard parameters with FSDP (which folds CP in). "act/mb" is one
sequence's activations on a rank: ``seq / cp`` tokens through its ``1/tp`` of every
block."""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2**30
# (sequence label, GPUs, [(tp, cp), ...]): every TP of a node with the CP that fills
# the GPUs (or less: FSDP takes the rest)
GRID = (
    ("32k", 8, [(8, 1), (4, 2), (2, 4), (1, 8)]),
    ("128k", 32, [(8, 1), (8, 4), (4, 8), (2, 16)]),
)
MODELS = ("cola_llama2", "llama2")


def jobs() -> list[tuple[str, str, int, int, int, list[str]]]:
    out = []
    for seq, gpus, layouts in GRID:
        for tp, cp in layouts:
            for model in MODELS:
                recipe = os.path.join(REPO, "recipes", f"{model}_7b_{seq}.toml")
                args = [
                    "--job.config_file", recipe,
                    "--parallelism.tensor_parallel_degree", str(tp),
                    "--parallelism.context_parallel_degree", str(cp),
                    "--parallelism.data_parallel_shard_degree", "-1",
                ]  # fmt: skip
                out.append((model, seq, gpus, tp, cp, args))
    return out


def main(argv: list[str] | None = None) -> int:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    from boost_titan.perf.dryrun import fits, quiet_warnings
    from boost_titan.perf.dryrun.run import dry_run_many
    from boost_titan.train.config_check import check_config, parse_config

    quiet_warnings()
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpu-memory", type=float, default=80.0)
    a = ap.parse_args(argv)
    todo = jobs()
    for _, _, gpus, _, _, args in todo:
        check_config(parse_config(args), world_size=gpus, files=False)
    reports = dry_run_many([(args, gpus, 1) for *_, gpus, _, _, args in todo])
    print(f"dry run, {a.gpu_memory:g} GiB GPUs less 10% headroom; GiB per rank")
    print("| model | seq | GPUs | layout | act/mb | params+grads+optimizer | peak | fits |")
    print("|---|---|---|---|---|---|---|---|")
    for (model, seq, gpus, tp, cp, _), roles in zip(todo, reports):
        r = roles[0]
        dp = gpus // (tp * cp)
        layout = f"TP{tp}" + (f" x CP{cp}" if cp > 1 else "") + (f" x FSDP{dp}" if dp > 1 else "")
        static = r.params_bytes + r.grads_bytes + r.optimizer_bytes
        ok = "yes" if fits(roles, a.gpu_memory) else "**no**"
        print(
            f"| {model}_7b | {seq} | {gpus} | {layout} | {r.activation_peak_bytes / GIB:.1f} | "
            f"{static / GIB:.1f} | {r.peak_bytes / GIB:.1f} | {ok} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
