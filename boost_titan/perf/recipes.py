"""Write ``recipes/<model>_<size>.toml`` and the recipe table (docs/recipes.md).

    boost-titan recipes --write      # (re)write every recipe
    boost-titan recipes --table      # markdown table from the dry run
    boost-titan recipes --write --table   # both, one dry run per choice

Every recipe extends ``recipes/base/gpu.toml`` and sets only its model, its layout (the
BOOST paper's: 3B TP2, 7B TP4, 13B TP4 x PP2, 30B/34B TP4 x PP4, FSDP2 over the rest;
1B FSDP2 only) and its activation memory option. The long-context recipes (``7b_32k``
on 8 GPUs, ``7b_128k`` on 32; CoLA and its dense twin) keep the 7B's TP4 and split
the sequence over the GPUs it leaves (context parallelism: CP2, CP8), one sequence per
step per replica, RoPE theta raised to 500000 (``LONG_CONTEXT``). That last choice is the dry run's
(:mod:`boost_titan.perf.dryrun`), not ours: the first option, in order of cost, whose peak
fits ``--gpu-memory`` less the headroom. Low-rank models under BTP: nothing, then
latent checkpointing of the MLP chunks, the attention chunks, both, each first
without and then with sequence-parallel latents (``[boost] sequence_parallel``: not
LaX, not at TP 1). Dense models:
none, then torchtitan's full AC (which the compiled TP path refuses: those recipes then
run eager). The vanilla low-rank TP baseline is one override: ``--boost.tp_plan vanilla``
(its latent checkpointing does not apply: add ``--boost.latent_checkpoint none``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from boost_titan.config import Parser

ARCHS = ("dense", "svd", "cola", "lax")
MODEL_NAME = {"dense": "llama2", "svd": "svd_llama2", "cola": "cola_llama2", "lax": "lax_llama2"}
# size -> (tp, pp, gpus)
LAYOUTS = {
    "1b": (1, 1, 8),
    "3b": (2, 1, 8),
    "7b": (4, 1, 8),
    "13b": (4, 2, 16),
    "30b": (4, 4, 32),
    "34b": (4, 4, 32),
    "7b_32k": (4, 1, 8),
    "7b_128k": (4, 1, 32),
}


@dataclass(frozen=True)
class LongContext:
    flavor: str
    seq: int
    cp: int


# sizes trained on long sequences: the flavor, the sequence and its CP degree. RoPE
# theta 500000 (Xiong et al. 2023, "Effective Long-Context Scaling": a larger base
# keeps the slowest rotation longer than the sequence; LLaMA 3 pre-trains with it)
LONG_CONTEXT = {
    "7b_32k": LongContext("7b", 32768, 2),
    "7b_128k": LongContext("7b", 131072, 8),
}
LONG_CONTEXT_ARCHS = ("dense", "cola")
LONG_CONTEXT_ROPE_THETA = 500000.0


def flavor_of(size: str) -> str:
    return LONG_CONTEXT[size].flavor if size in LONG_CONTEXT else size


def cp_of(size: str) -> int:
    return LONG_CONTEXT[size].cp if size in LONG_CONTEXT else 1


def layout_label(size: str, sep: str = " x ") -> str:
    """``TP4 x CP2`` / ``TP4 x PP2 x FSDP2`` (the data-parallel rest: FSDP; under CP
    FSDP shards over the CP ranks too, unnamed here when it is CP alone)."""
    tp, pp, gpus = LAYOUTS[size]
    cp = cp_of(size)
    dp = gpus // (tp * pp * cp)
    parts = [f"TP{tp}"] + ([f"PP{pp}"] if pp > 1 else []) + ([f"CP{cp}"] if cp > 1 else [])
    if dp > 1 or cp == 1:
        parts.append(f"FSDP{dp}")
    return sep.join(parts)


LR = {"dense": 3e-4, "svd": 3e-3, "cola": 3e-3, "lax": 3e-3}
# svd_llama2 trained with LORO (boost_titan.optim.loro) at these sizes. 1B is the
# reference's own script (mzf666/LORO-main scripts/loro_c4/llama_1b.sh: lr 5e-3, exact
# step every 200, weight decay 0, lazy lr r/d, Adam states refreshed at exact steps,
# LOROAdamW's betas (0.9, 0.999) and eps 1e-6); the reference has no 7B run: 7B keeps
# those settings with our svd lr.
LORO_SIZES = ("1b", "7b")
_LORO_REF = {"name": "LORO", "beta2": 0.999, "eps": 1e-6, "weight_decay": 0.0, "loro_freq": 200}
LORO = {"1b": {**_LORO_REF, "lr": 5e-3}, "7b": {**_LORO_REF, "lr": 3e-3}}
PP_SCHEDULE = "Interleaved1F1B"
STAGES_PER_RANK = 2
RECIPES_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "recipes")


@dataclass(frozen=True)
class Checkpointing:
    label: str
    toml: dict[str, dict[str, object]]


_SP = {"sequence_parallel": True}
LOW_RANK_OPTIONS = (
    Checkpointing("none", {}),
    # sequence-parallel latents: 1/T of each latent per rank for one more all-gather
    # per latent in backward (cheaper than re-running a chunk)
    Checkpointing("SP latents", {"boost": _SP}),
    Checkpointing("latent mlp", {"boost": {"latent_checkpoint": "mlp"}}),
    Checkpointing("SP latents + latent mlp", {"boost": {**_SP, "latent_checkpoint": "mlp"}}),
    Checkpointing("latent attention", {"boost": {"latent_checkpoint": "attention"}}),
    Checkpointing(
        "SP latents + latent attention", {"boost": {**_SP, "latent_checkpoint": "attention"}}
    ),
    Checkpointing("latent both", {"boost": {"latent_checkpoint": "both"}}),
    Checkpointing("SP latents + latent both", {"boost": {**_SP, "latent_checkpoint": "both"}}),
)


def options_for(arch: str, tp: int) -> tuple[Checkpointing, ...]:
    """The memory options of a recipe, in order of cost. Sequence-parallel latents
    need TP and a model whose latents stay in their block (not LaX)."""
    if arch == "dense":
        return DENSE_OPTIONS
    if arch == "lax" or tp == 1:
        return tuple(
            o for o in LOW_RANK_OPTIONS if "sequence_parallel" not in o.toml.get("boost", {})
        )
    return LOW_RANK_OPTIONS


DENSE_OPTIONS = (
    Checkpointing("none", {}),
    Checkpointing(
        "full AC (eager)",
        {"activation_checkpoint": {"mode": "full"}, "compile": {"enable": False}},
    ),
)


def recipe_name(arch: str, size: str, optimizer: str = "AdamW") -> str:
    return f"{MODEL_NAME[arch]}{'_loro' if optimizer == 'LORO' else ''}_{size}"


def all_recipes() -> list[tuple[str, str, str]]:
    """(arch, size, optimizer) of every recipe, in table order."""
    out = []
    for size in LAYOUTS:
        archs = LONG_CONTEXT_ARCHS if size in LONG_CONTEXT else ARCHS
        out += [(arch, size, "AdamW") for arch in archs]
        if size in LORO_SIZES:
            out.append(("svd", size, "LORO"))
    return out


def stage_split_of(n_layers: int, stages: int) -> tuple[int, int]:
    """first/last stage 'less layers' (embedding, head) that make the split exact."""
    for less in (2, 1, 0):
        if (n_layers + 2 * less) % stages == 0:
            return less, less
    raise ValueError(f"{n_layers} layers do not split into {stages} stages")


def recipe_toml(arch: str, size: str, ckpt: Checkpointing, optimizer: str = "AdamW") -> str:
    from boost_titan.models.flavors import flavors_for

    tp, pp, gpus = LAYOUTS[size]
    plan = "fullrank" if arch == "dense" else "btp"
    name = recipe_name(arch, size, optimizer)
    layout = layout_label(size)
    lines = [
        f"# {MODEL_NAME[arch]} {size}: {layout} on {gpus} GPUs, {plan} TP plan, "
        f"activation memory: {ckpt.label}"
        + (
            f", LORO optimizer (exact step every {LORO[size]['loro_freq']})"
            if optimizer == "LORO"
            else ""
        ),
        "# (chosen by the dry run: boost-titan recipes --write).",
        f"#   dry run:   boost-titan dryrun --config recipes/{name}.toml --ngpu {gpus}",
        f"#   one node:  CONFIG_FILE=recipes/{name}.toml NGPU=8 ./run_train.sh",
        f"#   SLURM:     sbatch --nodes={max(1, gpus // 8)} recipes/slurm_train.sh "
        f"recipes/{name}.toml",
    ]
    if arch != "dense":
        lines.append(
            "#   vanilla TP baseline: --boost.tp_plan vanilla --boost.latent_checkpoint none"
        )
    sections: dict[str, dict[str, object]] = {
        "job": {"dump_folder": f"./outputs/{name}", "description": f"{name}, {layout}"},
        "model": {"name": MODEL_NAME[arch], "flavor": flavor_of(size)},
        "optimizer": LORO[size] if optimizer == "LORO" else {"lr": LR[arch]},
        "parallelism": {"tensor_parallel_degree": tp},
        "boost": {"tp_plan": plan},
    }
    if size in LONG_CONTEXT:
        sections["parallelism"]["context_parallel_degree"] = cp_of(size)
        sections["training"] = {"seq_len": LONG_CONTEXT[size].seq, "local_batch_size": 1}
        sections["boost"]["rope_theta"] = LONG_CONTEXT_ROPE_THETA
    if pp > 1:
        n_layers = flavors_for(arch)[flavor_of(size)].n_layers
        first, last = stage_split_of(n_layers, pp * STAGES_PER_RANK)
        sections["parallelism"].update(
            pipeline_parallel_degree=pp,
            pipeline_parallel_schedule=PP_SCHEDULE,
            pipeline_parallel_first_stage_less_layers=first,
            pipeline_parallel_last_stage_less_layers=last,
        )
    for section, values in ckpt.toml.items():
        sections.setdefault(section, {}).update(values)
    lines += ['extends = "base/gpu.toml"', ""]
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def _dry_runs(recipes: list[tuple[str, int]], extra: tuple[str, ...] = ()):
    """The roles of each (recipe path, world size), with ``extra`` overrides, checked as
    the dry-run CLI does; all traced in one pool of processes."""
    from boost_titan.perf.dryrun.run import dry_run_many
    from boost_titan.train.config_check import check_config, parse_config

    jobs = []
    for path, gpus in recipes:
        config = parse_config(["--job.config_file", path, *extra])
        check_config(config, world_size=gpus, files=False)
        pp = config.parallelism.pipeline_parallel_degree
        jobs.append((["--job.config_file", path, *extra], gpus, pp))
    return dry_run_many(jobs)


def _sp_peaks(recipes: list[tuple[str, str, str]], labels: list[str]) -> list[float | None]:
    """Each recipe's peak (GiB) with sequence-parallel latents added to its chosen
    option, where they apply and are not already chosen (else None)."""
    todo = [
        (i, os.path.join(RECIPES_DIR, f"{recipe_name(a, z, o)}.toml"), LAYOUTS[z][2])
        for i, ((a, z, o), label) in enumerate(zip(recipes, labels))
        if "SP latents" not in label and any("SP" in c.label for c in options_for(a, LAYOUTS[z][0]))
    ]
    peaks: list[float | None] = [None] * len(recipes)
    runs = _dry_runs([(path, gpus) for _, path, gpus in todo], ("--boost.sequence_parallel",))
    for (i, _, _), roles in zip(todo, runs):
        peaks[i] = max(r.peak_bytes for r in roles) / 2**30
    return peaks


def _dry_run(path: str, gpus: int):
    return _dry_runs([(path, gpus)])[0]


def choose(arch: str, size: str, optimizer: str, gpu_gib: float, headroom: float, log=print):
    """Write the first checkpointing option that fits; returns (option, roles)."""
    from boost_titan.perf.dryrun import fits

    name = recipe_name(arch, size, optimizer)
    path = os.path.join(RECIPES_DIR, f"{name}.toml")
    tp, _, gpus = LAYOUTS[size]
    options = options_for(arch, tp)
    for ckpt in options:
        with open(path, "w") as f:
            f.write(recipe_toml(arch, size, ckpt, optimizer))
        try:
            roles = _dry_run(path, gpus)
        except ValueError as e:  # refused at parse time (e.g. compiled TP + AC)
            log(f"{name}: {ckpt.label}: refused ({e})")
            continue
        peak = max(r.peak_bytes for r in roles) / 2**30
        log(f"{name}: {ckpt.label}: peak {peak:.1f} GiB")
        if fits(roles, gpu_gib, headroom):
            return ckpt, roles
    raise SystemExit(f"{name}: no option fits {gpu_gib:g} GiB")


TABLE_HEAD = [
    "| recipe | layout | GPUs | activation memory | peak GiB/rank | "
    "params+grads+optimizer GiB/rank | TP GiB/step/rank (all-reduce-equiv.) | "
    "peak with SP latents |",
    "|---|---|---|---|---|---|---|---|",
]


def table_row(
    arch: str, size: str, optimizer: str, label: str, roles, sp_peak: float | None
) -> str:
    gpus = LAYOUTS[size][2]
    worst = max(roles, key=lambda r: r.peak_bytes)
    static = max(r.params_bytes + r.grads_bytes + r.optimizer_bytes for r in roles)
    layout = layout_label(size)
    return (
        f"| {recipe_name(arch, size, optimizer)} | {layout} | {gpus} | {label} | "
        f"{worst.peak_bytes / 2**30:.1f} | {static / 2**30:.1f} | "
        f"{max(r.tp_bytes_per_step for r in roles) / 2**30:.2f} | "
        f"{'-' if sp_peak is None else f'{sp_peak:.1f}'} |"
    )


def table() -> str:
    """The table of the recipes as written (one dry run each)."""
    import re

    rows, labels, recipes = list(TABLE_HEAD), [], []
    for arch, size, optimizer in all_recipes():
        path = os.path.join(RECIPES_DIR, f"{recipe_name(arch, size, optimizer)}.toml")
        with open(path) as f:
            labels.append(re.search(r"activation memory: ([^,]*)", f.readline()).group(1))
        recipes.append((path, LAYOUTS[size][2]))
    labels = [label.strip() for label in labels]
    sp = _sp_peaks(all_recipes(), labels)
    for (arch, size, optimizer), label, roles, sp_peak in zip(
        all_recipes(), labels, _dry_runs(recipes), sp
    ):
        rows.append(table_row(arch, size, optimizer, label, roles, sp_peak))
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    from boost_titan.parallel import cpu_runtime
    from boost_titan.perf.dryrun import quiet_warnings

    cpu_runtime.activate()
    quiet_warnings()
    ap = Parser(
        prog="boost-titan recipes",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # its examples, line by line
    )
    ap.add_argument("--write", action="store_true", help="(re)write every recipe")
    ap.add_argument("--table", action="store_true", help="print docs/recipes.md's table")
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of --gpu-memory kept free for what the trace does not see (default 0.1)",
    )
    ap.add_argument("--only", nargs="*", default=None, help="recipe names to write")
    a = ap.parse_args(argv)
    if not (a.write or a.table):
        ap.error("say --write and/or --table")
    if a.write:
        chosen = []
        for recipe in all_recipes():
            if a.only and recipe_name(*recipe) not in a.only:
                continue
            chosen.append((recipe, *choose(*recipe, a.gpu_memory, a.headroom)))
        if a.table:  # the figures of the choices just made
            recipes = [recipe for recipe, _, _ in chosen]
            sp = _sp_peaks(recipes, [ckpt.label for _, ckpt, _ in chosen])
            rows = list(TABLE_HEAD)
            for (recipe, ckpt, roles), sp_peak in zip(chosen, sp):
                rows.append(table_row(*recipe, ckpt.label, roles, sp_peak))
            print("\n".join(rows))
    elif a.table:
        print(table())
    return 0
