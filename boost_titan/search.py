"""Layout search: the fastest layout that fits, for a model on N GPUs of a type.

    python -m boost_titan.plan --search --model cola_llama2 --flavor 13b --gpus 32 \\
        --gpu h100-80 [--gpus-per-node 8] [--seq 4096] [--global-batch-tokens N] \\
        [--top K] [--write recipes/X.toml]

1. Enumerate: every TP (dividing the node) x PP x data-parallel split of the GPUs
   (FSDP, or HSDP with the replicas across nodes), every plan of the model (low-rank:
   btp, btp with sequence-parallel latents, vanilla; dense: fullrank), micro-batch
   sizes 1/2/4/8 with the microbatches the global batch leaves, PP schedules 1F1B and
   Interleaved1F1B (2 stages per rank; GPipe has 1F1B's bubble and more memory, so it
   never wins), and the activation-memory choices of each plan (latent checkpointing
   none/mlp/attention/both for btp; none/full AC otherwise).
2. Rank all of them by the step-time model's tokens/s (:mod:`boost_titan.perf_model`,
   no tracing: microseconds each).
3. Walk the ranking from the top: each layout must pass the config checks the trainer
   runs (``check_config`` at the world size) and fit the GPU's memory less the dry
   run's headroom. Memory is the dry run's, split as it scales: one microbatch's
   activations per block and at the stack's ends are traced (FakeTensor, the dry
   run's ``trace_role``) once per (TP, plan, checkpointing) at micro-batch 1 in a
   1- and a 2-layer model, and scaled by micro-batch, layers per stage and the
   schedule's microbatches in flight; parameters, gradients and AdamW states (fp32,
   16 bytes per parameter) are divided by FSDP analytically, plus FSDP's gathered bf16
   parameters and one block's fp32 gradients. A 13B model's traces take seconds each;
   a search traces only the combinations its walk reaches.
4. The winner is checked with the full dry run (``boost_titan.dryrun``: every pipeline
   rank traced at full size); if it does not fit there, the next one is.
"""

from __future__ import annotations

import math
import os
import sys
import tempfile
from dataclasses import dataclass, field

from boost_titan.hardware import GPU
from boost_titan.perf_model import Breakdown, Efficiency, Layout, step_time

GIB = 2**30
RECIPES_DIR = os.path.normpath(os.path.join(os.path.dirname(__file__), "..", "recipes"))
BASE_RECIPE = os.path.join(RECIPES_DIR, "base", "gpu.toml")
MICRO_BATCHES = (1, 2, 4, 8)
PP_CHOICES = (("1F1B", 1), ("Interleaved1F1B", 2))
LATENT_CKPT = ("none", "mlp", "attention", "both")
BYTES_PARAM_GRAD_ADAM = 16  # fp32 parameter, gradient, two AdamW moments


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


def stage_split(n_layers: int, stages: int) -> tuple[int, int] | None:
    """First/last stage 'less layers' that split the stack exactly (the recipes' rule:
    the embedding and the head count as layers), or None."""
    from boost_titan.tools.recipes import _stage_split

    try:
        return _stage_split(n_layers, stages)
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
            for pp in _divisors(gpus // tp):
                dp = gpus // (tp * pp)
                for rep in _divisors(dp):
                    shard = dp // rep
                    if rep > 1 and (shard == 1 or tp * shard % gpus_per_node):
                        continue  # HSDP: a replica is whole nodes, sharded within
                    if global_batch % dp:
                        continue
                    per_replica = global_batch // dp
                    for mb in MICRO_BATCHES:
                        if per_replica % mb:
                            continue
                        n_mb = per_replica // mb
                        scheds = PP_CHOICES if pp > 1 else (("1F1B", 1),)
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
    from boost_titan.tools.recipes import _toml_value

    lines = [f"# {h}" for h in header] + [f'extends = "{extends}"', ""]
    for section, values in sections.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
        lines.append("")
    return "\n".join(lines)


def write_recipe(path: str, sections: dict, header: list[str]) -> None:
    base = os.path.relpath(BASE_RECIPE, os.path.dirname(os.path.abspath(path)))
    with open(path, "w") as f:
        f.write(recipe_text(sections, header, base))


def check_candidate(sections: dict, gpus: int) -> str:
    """'' when the trainer's config checks accept the layout at ``gpus`` ranks, else
    their message."""
    from boost_titan.config_check import check_config, parse_config

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


# ---------------------------------------------------------------------------- memory


def _trace_key(lay: Layout) -> tuple[int, str, str]:
    return (lay.tp, lay.plan, lay.checkpoint)


def _trace_worker(model: str, flavor: str, seq: int, tp: int, combos: list) -> dict:
    """In a forked process: one fake world of ``tp`` ranks, each (plan, checkpointing)
    traced at micro-batch 1 in a 1- and a 2-layer model (LaX: 2 and 3, as
    ``dryrun.plans``); the difference is one block's activations."""
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    import logging

    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torchtitan.tools.logging import logger

    from boost_titan.config_check import config_args, parse_config
    from boost_titan.dryrun.run import quiet_warnings
    from boost_titan.dryrun.trace import _parallel_dims, trace_role

    quiet_warnings()
    logger.setLevel(logging.ERROR)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=tp)
    out = {}
    try:
        for plan, ckpt in combos:
            argv = [
                "--job.config_file", BASE_RECIPE,
                "--model.name", model, "--model.flavor", flavor,
                "--parallelism.tensor_parallel_degree", str(tp),
                "--parallelism.data_parallel_shard_degree", "1",
                "--training.local_batch_size", "1", "--training.seq_len", str(seq),
                "--training.dtype", "bfloat16", "--training.mixed_precision_param", "bfloat16",
                "--boost.tp_plan", "btp" if plan == "btp_sp" else plan,
            ]  # fmt: skip
            if plan == "btp_sp":
                argv.append("--boost.sequence_parallel")
            if ckpt == "full":
                argv += ["--activation_checkpoint.mode", "full"]
            elif ckpt != "none":
                argv += ["--boost.latent_checkpoint", ckpt]
            config = parse_config(argv, layout=False)
            config.compile.enable = False
            full = config_args(config)
            acts = []
            # LaX's first block has no crossing: its constant part needs 2 blocks
            layers = (2, 3) if full.arch == "lax" else (1, 2)
            for n in layers:
                rep = trace_role(
                    config,
                    _parallel_dims(config, tp),
                    fake=True,
                    args=full.with_overrides(n_layers=n),
                )
                acts.append(rep.activation_peak_bytes)
            per_block = acts[1] - acts[0]
            out[(plan, ckpt)] = (per_block, acts[0] - layers[0] * per_block)
    finally:
        dist.destroy_process_group()
    return out


def trace_pool():
    """Processes forked from one server that imported torch and torchtitan once (the
    dry run's pattern, ``dryrun.run.dry_run_many``): one fresh process per TP degree's
    traces (DTensor caches sharding decisions with the process group)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["boost_titan.preload"])
    return ProcessPoolExecutor(1, mp_context=ctx, max_tasks_per_child=1)


def trace_activations(model: str, flavor: str, seq: int, keys: set, pool) -> dict:
    """{(tp, plan, ckpt): ActTrace}, one process of ``pool`` per TP degree."""
    by_tp: dict[int, list] = {}
    for tp, plan, ck in sorted(keys):
        by_tp.setdefault(tp, []).append((plan, ck))
    futures = {
        tp: pool.submit(_trace_worker, model, flavor, seq, tp, combos)
        for tp, combos in by_tp.items()
    }
    out = {}
    for tp, fut in futures.items():
        for (plan, ck), (pb, ends) in fut.result().items():
            out[(tp, plan, ck)] = ActTrace(pb, ends)
    return out


def in_flight(lay: Layout) -> float:
    """Microbatches whose activations pipeline rank 0 holds at its peak, in units of
    one microbatch through all its stages (the dry run's rules: 1F1B ``min(n, p)``;
    Interleaved1F1B walks torch's order: its warm-up is ``2(p-1) + (v-1)p`` chunks
    plus the one in steady state, each chunk 1/v of the rank's layers)."""
    if lay.pp == 1:
        return 1.0
    if lay.schedule == "Interleaved1F1B":
        v = lay.stages_per_rank
        chunks = min(lay.microbatches * v, 2 * (lay.pp - 1) + (v - 1) * lay.pp + 1)
        return chunks / v
    return float(min(lay.microbatches, lay.pp))


def estimate_memory(args, lay: Layout, act: ActTrace) -> dict:
    """Bytes per rank of the fullest pipeline rank (see the module docstring)."""
    from boost_titan.perf_model import block_plan_args
    from boost_titan.plan import _params_per_rank

    a = block_plan_args(args, lay.plan)
    params_tp = _params_per_rank(a, "btp" if lay.plan == "btp_sp" else lay.plan, lay.tp)
    ends = 2 * a.vocab_size * a.dim / lay.tp + a.dim
    block = (params_tp - ends) / a.n_layers
    layers = math.ceil(a.n_layers / lay.pp)
    stage_params = block * layers + (ends if lay.pp == 1 else ends / 2)
    static = BYTES_PARAM_GRAD_ADAM * stage_params / lay.dp_shard
    if lay.dp_shard * lay.dp_replicate == 1:
        gathered = 0.0
    elif lay.pp == 1:  # this block and the prefetched one in bf16, one block's fp32 grads
        gathered = block * (2 * 2 + 4)
    else:  # PP: parameters stay gathered through the step
        gathered = stage_params * 2 + block * 4
    mb = lay.micro_batch
    # backward's largest temporary: the loss's fp32 gradient of the (vocab-parallel)
    # logits, alive on the last stage while the traced activations are
    temporaries = mb * lay.seq * a.vocab_size / lay.tp * 4
    stage_act = act.per_block * layers
    if lay.pp == 1:
        activations = mb * (stage_act + act.ends)
    else:
        activations = mb * max(stage_act * in_flight(lay), stage_act + act.ends)
    return dict(
        params_grads_optimizer=static,
        fsdp_gathered=gathered,
        activations=activations,
        temporaries=temporaries,
        total=static + gathered + activations + temporaries,
    )


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
        key = _trace_key(c.layout)
        if key not in traces:
            # this one, and what the next few of its TP degree need, in one process
            batch = {key} | {
                k
                for k in (_trace_key(x.layout) for x in ranked[i : i + 16])
                if k[0] == key[0] and k not in traces
            }
            log(f"tracing activations (TP, plan, checkpointing): {sorted(batch)}")
            traces.update(trace_activations(model, flavor, seq, batch, pool))
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
    from boost_titan.dryrun.run import dry_run

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


def add_arguments(p) -> None:
    g = p.add_argument_group("layout search (--search)")
    g.add_argument("--search", action="store_true", help="search the fastest layout that fits")
    g.add_argument("--gpus", type=int, default=8)
    g.add_argument("--gpu", default="h100-80", help="a GPU of boost_titan.hardware")
    g.add_argument("--gpu-file", help="a custom GPU (TOML; keys in boost_titan.hardware)")
    g.add_argument("--gpus-per-node", type=int, default=None)
    g.add_argument("--global-batch-tokens", type=int, default=None, help="default 1024 x seq")
    g.add_argument("--top", type=int, default=5)
    g.add_argument("--headroom", type=float, default=0.1)
    g.add_argument("--calibrate", help="refit the model on a gpu_check.json first")
    g.add_argument("--write", help="write the winner as a recipe (TOML)")
    g.add_argument("--no-verify", action="store_true", help="skip the winner's full dry run")


def run_search(a) -> int:
    """``plan --search``'s body."""
    from boost_titan.dryrun.run import quiet_warnings
    from boost_titan.perf_model import default_efficiency, resolve_gpu

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
        print(f"plan --search: {e}", file=sys.stderr)
        return 2
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
                f"(python -m boost_titan.plan --search; predicted {c.tokens_per_s:,.0f} "
                f"tokens/s, {c.breakdown.step_s:.2f} s/step)",
                f"  dry run: python -m boost_titan.dryrun --config {a.write} --ngpu {a.gpus} "
                f"--gpu-memory {hw.memory_gib:g}",
            ],
        )
        print(f"wrote {a.write}")
    return 0
