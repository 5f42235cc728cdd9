"""``boost-titan``: one command for every tool besides training (which ``run_train.sh``
launches). Each subcommand is the ``main(argv)`` (or another ``entry``) of the module that owns the
tool; this table is the only place that names them::

    boost-titan --help
    boost-titan <command> --help

Nothing is imported until a command runs (``--help`` stays instant); before the
command's module is imported, the CPU runtime is activated (a no-op with a GPU), since
torchtitan fixes its device type when first imported.
"""

from __future__ import annotations

import importlib
import sys
import textwrap
from typing import NamedTuple

from boost_titan.cli.args import fail


class Command(NamedTuple):
    module: str  # whose main(argv) runs
    summary: str
    entry: str = "main"  # the module's function that runs it: entry(argv)


# name -> what runs, grouped as --help lists them
COMMANDS: dict[str, Command] = {
    # models on disk
    "checkpoint": Command(
        "boost_titan.cli.checkpoint",
        "export / import a checkpoint's weights (safetensors or a Hugging Face folder), "
        "verify a checkpoint step against its manifest, start a low-rank model from a dense one "
        "(from-dense)",
    ),
    "eval": Command(
        "boost_titan.cli.eval",
        "lm-eval perplexity of an exported Hugging Face folder, offline",
    ),
    # data
    "data": Command(
        "boost_titan.data.cli",
        "build the embedded corpus (build, info), train a tokenizer on your files (tokenizer), "
        "tokenize raw text into a tokenized corpus (tokenize) or make Megatron .bin/.idx files "
        "one (seal)",
    ),
    # before a run
    "check-config": Command(
        "boost_titan.train.launch_check",
        "check a training config for a world size, as run_train.sh does before torchrun",
    ),
    # training across replica groups
    "replicas": Command(
        "boost_titan.train.replica_launch",
        "a torchft lighthouse and N replica groups on this machine, each its own run_train.sh "
        "(fault tolerance: a group dies and rejoins while the others train on)",
    ),
    "plan": Command(
        "boost_titan.perf.plan_cli",
        "every TP plan of a model: collectives, GEMM shapes, traced memory per rank",
    ),
    "search": Command(
        "boost_titan.perf.plan_cli",
        "the fastest layout that fits N GPUs (= plan --search); --write writes the recipe",
        "search_main",
    ),
    "step-time": Command(
        "boost_titan.perf.step_time_cli",
        "a layout's predicted step time, term by term; --paper: the calibration table",
    ),
    "dryrun": Command(
        "boost_titan.perf.dryrun.cli",
        "a config at its real world size on CPU: memory per rank, TP traffic, fits or not",
    ),
    "recipes": Command(
        "boost_titan.perf.recipes", "write recipes/ and its table (docs/recipes.md)"
    ),
    # measuring
    "bench": Command(
        "boost_titan.perf.bench.cli",
        "side-by-side benchmark of TP plans: step time, memory, communication",
    ),
    "bench-loro": Command(
        "boost_titan.perf.bench.loro", "the LORO optimizer step's cost on TP ranks"
    ),
    "gpu-check": Command(
        "boost_titan.perf.gpu_check.cli",
        "one-command check of a GPU machine: numerics, BTP, kernels, throughput",
    ),
    "peak-flops": Command(
        "boost_titan.perf.bench.peak_flops", "this machine's measured matmul peak (MFU's base)"
    ),
    "screenshot": Command(
        "boost_titan.observability.screenshot",
        "a run's TensorBoard dashboard as a PNG (headless Chromium)",
    ),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [
        "usage: boost-titan <command> [options]   (boost-titan <command> --help)",
        "",
        "Tools of boost_titan; training itself: ./run_train.sh (torchrun -m boost_titan.train).",
        "",
        "commands:",
    ]
    indent = " " * (width + 4)
    lines += [
        textwrap.fill(
            cmd.summary, 92, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent
        )
        for name, cmd in COMMANDS.items()
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        fail("boost-titan", f"unknown command {name!r}; valid: {', '.join(COMMANDS)}")
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()  # before any command's module imports torchtitan
    cmd = COMMANDS[name]
    code = getattr(importlib.import_module(cmd.module), cmd.entry)(rest)
    return code or 0


def console_script() -> None:
    """``[project.scripts] boost-titan``."""
    raise SystemExit(main())
