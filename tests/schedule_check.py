"""Every pipeline schedule against the single process, many cases per launch.

Two gloo ranks (PP2), or four (PP2 x CP2: ``cp=2``), build each case as the trainer does
(``parse_config``, the train spec's model args, torchtitan's ``pipeline_llm`` with
``parallelize_boost``: under CP ring attention and FSDP2 over dp x cp, the spec's
optimizer builder, boost_titan's token-mean pipeline loss) and train ``STEPS`` steps
through the trainer's own step functions (torchtitan's ``post_dataloading_process``:
under CP each rank's head-tail shard of the inputs, labels and RoPE positions;
boost_titan's ``pipeline_forward_backward`` inside the trainer's ``train_context``);
every rank also trains the same model in one piece on the same (whole) batches, the
reference. A step's loss is the whole batch's: the last stage's microbatch losses, each
already divided by the batch's token count, summed over the CP ranks (each holds 1/cp
of the tokens), as the trainer's logged loss sums them over its loss mesh. A case whose
config is refused when parsed (or, like the trainer, when it starts on this machine)
records the refusal instead.
Used by ``tests/test_schedules.py``; run directly for one case:
``python tests/schedule_check.py cola ZBVZeroBubble grouped [cp]``.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist
from launcher import spawn

from boost_titan.config import PP_SCHEDULES

PP = 2
STEPS = 3  # step 1's loss precedes any update: steps 2-3 check two updates
BATCH, SEQ = 4, 32
SCHEDULES = PP_SCHEDULES  # every schedule torchtitan 0.2.2 offers
SINGLE_STAGE = ("1F1B", "GPipe")  # one stage per rank; the others two
FEATURES = {
    "grouped": (),
    "ungrouped": ("--boost.no-group-linears",),
    "latent_checkpoint": ("--boost.latent_checkpoint", "both"),
    # exact step at step 2 of 3: rewrites the factors between steps
    # LORO needs W = B A (SVD models: no activation between the factors)
    "loro": ("--optimizer.name", "LORO", "--optimizer.loro_freq", "2"),
    "compiled": ("--compile.enable", "--compile.backend", "aot_eager"),
}


def argv(arch: str, schedule: str, feature: str, cp: int = 1) -> list[str]:
    """The case's command line: debug model, fp32, one block per stage, microbatches
    of one sample (4 per step), torchtitan's default (fused) AdamW unless LORO; context
    parallel degree ``cp`` (SEQ must be a multiple of 2 x cp)."""
    per_stage = "2" if schedule in SINGLE_STAGE else "1"
    return [
        "--model.name",
        f"{arch}_llama2",
        "--training.seq_len",
        str(SEQ),
        "--training.local_batch_size",
        str(BATCH),
        "--training.mixed_precision_param",
        "float32",
        "--parallelism.pipeline_parallel_degree",
        str(PP),
        "--parallelism.pipeline_parallel_schedule",
        schedule,
        "--parallelism.pipeline_parallel_layers_per_stage",
        per_stage,
        "--parallelism.pipeline_parallel_first_stage_less_layers",
        "0",
        "--parallelism.pipeline_parallel_last_stage_less_layers",
        "0",
        "--parallelism.pipeline_parallel_microbatch_size",
        "1",
        "--activation_checkpoint.mode",
        "none",
        "--parallelism.context_parallel_degree",
        str(cp),
        *FEATURES[feature],
    ]


def _model(config, args):
    from boost_titan.models.model import Transformer

    torch.manual_seed(0)  # the same weights on every rank and in the reference
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _sum_of_squares(params) -> torch.Tensor:
    """The float64 sum of squares of this rank's gradient entries (of a parameter sharded
    by FSDP2, its own shard). float64: the fp32 norm torchtitan's clipping computes
    depends on the summation order (here the reference's is 2.3e-4 off the exact norm and
    a CP2 x FSDP2 run's, over half-tensors, 1.6e-4): too coarse for 1e-5."""
    total = torch.zeros((), dtype=torch.float64)
    for p in params:
        if p.grad is not None:
            grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            total += grad.double().square().sum()
    return total


def _reference(config, args, batches) -> tuple[list[float], list[float]]:
    """The same training in one piece on this rank: the eager single process; its
    losses and gradient norms."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import ParallelDims

    from boost_titan.train.specs import build_optimizers

    single = copy.deepcopy(config)
    single.parallelism.pipeline_parallel_degree = 1
    single.compile.enable = False
    model = _model(single, args)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    opt = build_optimizers([model], single.optimizer, dims)
    losses, norms = [], []
    for tokens, labels in batches:
        loss = cross_entropy_loss(model(tokens), labels) / labels.numel()
        loss.backward()
        norms.append(_sum_of_squares(model.parameters()).sqrt().item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms


def _pipelined(config, args, dims, batches) -> tuple[list[float], list[float]] | None:
    """The case under its schedule, stepped by the trainer's functions; on the ranks
    with the last stage its losses (each CP rank's share of the batch's mean) and
    gradient norms (over every stage and shard: Adam's first steps barely see a wrong
    gradient scale, the norm does)."""
    from types import SimpleNamespace

    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.distributed.utils import get_train_context
    from torchtitan.train import Trainer

    from boost_titan.parallel.parallelize import parallelize_boost
    from boost_titan.parallel.pipeline import build_loss_fn, pipeline_forward_backward
    from boost_titan.train.specs import build_optimizers

    loss_fn = build_loss_fn(config)
    schedule, parts, first, last = pipeline_llm(
        _model(config, args), dims, config, torch.device("cpu"), args, parallelize_boost, loss_fn
    )
    opt = build_optimizers(parts, config.optimizer, dims)
    # what the two functions read of the trainer (no TP: no loss parallel)
    trainer = SimpleNamespace(
        job_config=config,
        parallel_dims=dims,
        model_args=args,
        model_parts=parts,
        tokenizer=None,
        device=torch.device("cpu"),
        loss_fn=loss_fn,
        pp_schedule=schedule,
        pp_has_first_stage=first,
        pp_has_last_stage=last,
        train_context=get_train_context(False),
    )
    params = [p for m in parts for p in m.parameters()]
    losses, norms = [], []
    for tokens, labels in batches:
        # the data-parallel token count (dp = 1: the whole batch), before the CP split
        global_valid_tokens = torch.tensor(labels.numel(), dtype=torch.float32)
        inputs, labels, extra_inputs, extra_kwargs = Trainer.post_dataloading_process(
            trainer, {"input": tokens}, labels
        )
        loss = pipeline_forward_backward(
            trainer, inputs, labels, extra_inputs, extra_kwargs, global_valid_tokens
        )
        squares = _sum_of_squares(params)  # every entry lives on one rank: sum them all
        dist.all_reduce(squares)
        norms.append(squares.sqrt().item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return (losses, norms) if last else None


def _worker(rank: int, init_file: str, cases: list, out_file: str, cp: int):
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    torch.set_num_threads(1)
    world = PP * cp
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from torchtitan.distributed import ParallelDims

        from boost_titan.parallel.pipeline import check_schedule_runs_here
        from boost_titan.train.config_check import config_args, parse_config

        dims = ParallelDims(
            dp_replicate=1, dp_shard=1, cp=cp, tp=1, pp=PP, ep=1, etp=1, world_size=world
        )
        dims.build_mesh()
        results, references = [], {}
        for arch, schedule, feature in cases:
            row = {"arch": arch, "schedule": schedule, "feature": feature, "cp": cp}
            results.append(row)
            try:
                config = parse_config(argv(arch, schedule, feature, cp))
                check_schedule_runs_here(config)  # as the trainer's main does
            except ValueError as e:
                row["refused"] = str(e)
                continue
            args = config_args(config)
            g = torch.Generator().manual_seed(1)
            batches = [
                tuple(torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g) for _ in "xy")
                for _ in range(STEPS)
            ]
            key = (arch, feature if feature in ("ungrouped", "loro") else "grouped")
            if key not in references:
                references[key] = _reference(config, copy.deepcopy(args), batches)
            row["reference"], row["reference_grad_norm"] = references[key]
            try:
                mine = _pipelined(config, copy.deepcopy(args), dims, batches)
            except Exception as e:  # a crash is an outcome the test reports
                mine, row["error"] = None, f"{type(e).__name__}: {e}"[:2000]
            gathered = [None] * world
            dist.all_gather_object(gathered, mine)
            # the last stage's CP ranks each hold a share of the batch's mean loss
            shares = [g for g in gathered if g is not None]
            row["loss"] = [sum(step) for step in zip(*(s[0] for s in shares))] if shares else None
            row["grad_norm"] = shares[0][1] if shares else None
            torch._dynamo.reset()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


def run_cases(cases: list, workdir: str, cp: int = 1) -> list[dict]:
    """Run ``cases`` ((arch, schedule, feature) triples) in one launch of PP x ``cp``
    ranks."""
    os.makedirs(workdir, exist_ok=True)
    out_file = os.path.join(workdir, "results.json")
    spawn(_worker, (os.path.join(workdir, "init"), cases, out_file, cp), PP * cp)
    with open(out_file) as f:
        return json.load(f)


if __name__ == "__main__":
    import tempfile

    cp = int(sys.argv[4]) if len(sys.argv) > 4 else 1
    for row in run_cases([tuple(sys.argv[1:4])], tempfile.mkdtemp(), cp):
        print(json.dumps(row))
