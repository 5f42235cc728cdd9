"""The layouts the search ranks (every TP x PP x data-parallel split, plan, micro-batch,
schedule and activation-memory choice) and the recipe TOML each one is written as."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

from boost_titan.config import CP_PP_SCHEDULES
from boost_titan.perf.step_time import Breakdown, Layout

GIB = 2**30
# what every recipe extends; package data (recipes/base/gpu.toml in a checkout links here)
BASE_RECIPE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "gpu_base.toml")
MICRO_BATCHES = (1, 2, 4, 8)
PP_CHOICES = (("1F1B", 1), ("Interleaved1F1B", 2))
LATENT_CKPT = ("none", "mlp", "attention", "both")
BYTES_PARAM_GRAD_ADAM = 16  # fp32 parameter, gradient, two AdamW moments
# context parallelism is ranked from this sequence length up: below it one rank's
# sequence fits beside TP and the ring only adds traffic
CP_FROM_SEQ = 16384


@dataclass
class ActTrace:
    """One microbatch of 1 sequence: activation bytes per block and at the stack's ends."""

    per_block: float
    ends: float


@dataclass
class Candidate:
    layout: Layout
    breakdown: Breakdown
    sections: dict
    memory: dict | None = None  # estimated bytes per rank, by part
    refused: str = ""  # the config check's message
    verified: dict | None = field(default=None)  # the full dry run's figures

    @property
    def tokens_per_s(self) -> float:
        return self.breakdown.tokens_per_s()


# ----------------------------------------------------------------------- enumeration


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def plans_for(args) -> list[str]:
    return ["btp", "btp_sp", "vanilla"] if args.low_rank else ["fullrank"]


def checkpoints_for(plan: str) -> tuple[str, ...]:
    return LATENT_CKPT if plan in ("btp", "btp_sp") else ("none", "full")


def cp_choices(seq: int, tp: int, ranks: int) -> list[int]:
    """CP degrees for ``ranks`` GPUs left after TP: 1, and from ``CP_FROM_SEQ`` every
    divisor whose shards split the sequence in 2 x cp x tp (torch's load balancing)."""
    if seq < CP_FROM_SEQ:
        return [1]
    return [cp for cp in _divisors(ranks) if seq % (2 * cp * tp) == 0]


def stage_split(n_layers: int, stages: int) -> tuple[int, int] | None:
    """First/last stage 'less layers' that split the stack exactly (the recipes' rule:
    the embedding and the head count as layers), or None."""
    from boost_titan.perf.recipes import stage_split_of

    try:
        return stage_split_of(n_layers, stages)
    except ValueError:
        return None


def enumerate_layouts(
    args, gpus: int, gpus_per_node: int, seq: int, global_batch: int
) -> list[Layout]:
    """Every layout the search ranks (see the module docstring); ``global_batch`` in
    sequences."""
    from boost_titan.tp_plans import validate_tp_degree

    out = []
    for tp in (t for t in _divisors(gpus_per_node) if gpus % t == 0):
        for plan in plans_for(args):
            try:
                validate_tp_degree(args, tp, "btp" if plan == "btp_sp" else plan)
            except ValueError:
                continue
            if plan == "btp_sp" and (tp == 1 or args.arch == "lax" or seq % tp):
                continue
            if plan == "vanilla" and tp == 1:
                continue  # vanilla at TP 1 is btp at TP 1
            for cp, pp in (
                (c, p) for c in cp_choices(seq, tp, gpus // tp) for p in _divisors(gpus // (tp * c))
            ):
                dp = gpus // (tp * cp * pp)
                for rep in _divisors(dp):
                    shard = dp // rep
                    if rep > 1 and (shard == 1 or tp * cp * shard % gpus_per_node):
                        continue  # HSDP: a replica is whole nodes, sharded within
                    if global_batch % dp:
                        continue
                    per_replica = global_batch // dp
                    for mb in MICRO_BATCHES:
                        if per_replica % mb:
                            continue
                        n_mb = per_replica // mb
                        scheds = PP_CHOICES if pp > 1 else (("1F1B", 1),)
                        if cp > 1:  # what the config check accepts under CP
                            scheds = tuple(x for x in scheds if x[0] in CP_PP_SCHEDULES)
                        for sched, v in scheds:
                            if pp > 1 and (
                                stage_split(args.n_layers, pp * v) is None
                                or n_mb < pp
                                or (v > 1 and n_mb % pp)
                            ):
                                continue
                            for ck in checkpoints_for(plan):
                                out.append(
                                    Layout(
                                        plan,
                                        tp,
                                        pp,
                                        shard,
                                        rep,
                                        mb,
                                        seq,
                                        n_mb,
                                        sched,
                                        v,
                                        ck,
                                        gpus_per_node,
                                        cp,
                                    )
                                )
    return out


# ------------------------------------------------------------------------- recipe TOML


def sections_for(model: str, flavor: str, lay: Layout, args) -> dict:
    """The recipe's sections over ``recipes/base/gpu.toml`` for a layout."""
    par = {
        "tensor_parallel_degree": lay.tp,
        "data_parallel_shard_degree": lay.dp_shard,
        "data_parallel_replicate_degree": lay.dp_replicate,
    }
    if lay.cp > 1:
        par["context_parallel_degree"] = lay.cp
    train = {"seq_len": lay.seq}
    if lay.pp > 1:
        first, last = stage_split(args.n_layers, lay.pp * lay.stages_per_rank)
        par.update(
            pipeline_parallel_degree=lay.pp,
            pipeline_parallel_schedule=lay.schedule,
            pipeline_parallel_microbatch_size=lay.micro_batch,
            pipeline_parallel_first_stage_less_layers=first,
            pipeline_parallel_last_stage_less_layers=last,
        )
        train["local_batch_size"] = lay.micro_batch * lay.microbatches
        train["global_batch_size"] = train["local_batch_size"] * lay.dp_shard * lay.dp_replicate
    else:  # gradient accumulation over the microbatches
        train["local_batch_size"] = lay.micro_batch
        train["global_batch_size"] = (
            lay.micro_batch * lay.microbatches * lay.dp_shard * lay.dp_replicate
        )
    boost = {"tp_plan": "btp" if lay.plan == "btp_sp" else lay.plan}
    if lay.plan == "btp_sp":
        boost["sequence_parallel"] = True
    sections = {
        "model": {"name": model, "flavor": flavor},
        "parallelism": par,
        "training": train,
        "boost": boost,
    }
    if lay.checkpoint == "full":  # torchtitan's AC; the compiled TP path refuses it
        sections["activation_checkpoint"] = {"mode": "full"}
        sections["compile"] = {"enable": False}
    elif lay.checkpoint != "none":
        boost["latent_checkpoint"] = lay.checkpoint
    if args.low_rank:
        sections["optimizer"] = {"lr": 3e-3}
    return sections


def recipe_text(sections: dict, header: list[str], extends: str) -> str:
    from boost_titan.perf.recipes import toml_value

    lines = [f"# {h}" for h in header] + [f'extends = "{extends}"', ""]
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def write_recipe(path: str, sections: dict, header: list[str]) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    beside = os.path.join(folder, "base", "gpu.toml")  # written into recipes/: as the others
    if os.path.exists(beside) and os.path.samefile(beside, BASE_RECIPE):
        base = "base/gpu.toml"
    else:
        base = os.path.relpath(BASE_RECIPE, folder)
    with open(path, "w") as f:
        f.write(recipe_text(sections, header, base))


def check_candidate(sections: dict, gpus: int) -> str:
    """'' when the trainer's config checks accept the layout at ``gpus`` ranks, else
    their message."""
    from boost_titan.train.config_check import check_config, parse_config

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as f:
        f.write(recipe_text(sections, [], BASE_RECIPE))
    try:
        config = parse_config(["--job.config_file", f.name])
        check_config(config, world_size=gpus, files=False)
    except (ValueError, FileNotFoundError) as e:
        return str(e).splitlines()[0]
    finally:
        os.unlink(f.name)
    return ""
