"""Context parallelism against one process, gradient by gradient, on real gloo ranks.

Every rank builds the same seeded model twice: once whole, trained on the whole batch in
this process (the reference), and once parallelized by ``parallelize_boost`` for a
layout with ``context_parallel_degree`` 2 (the trainer's function: ring attention on
every block, BTP, FSDP2 over the dp x cp ranks). The layout's copy sees its rank's
head-tail shard of the sequence (torchtitan's ``prepare_context_parallel_input``, RoPE
positions included) and divides its loss sum by the whole batch's token count, as the
trainer does with ``global_valid_tokens``. Each of ``STEPS`` AdamW steps compares the
loss and every parameter's gradient (``full_tensor()``) with the reference's. Used by
``tests/test_context_parallel.py``; many cases per launch.
"""

from __future__ import annotations

import copy
import json
import os
import sys

import torch
import torch.distributed as dist

STEPS = 3
BATCH, SEQ = 2, 64  # SEQ divisible by 2 x cp x tp


def _job_config(case: dict):
    from boost_titan.train.config_check import parse_config

    argv = [
        "--parallelism.context_parallel_degree", str(case["cp"]),
        "--parallelism.tensor_parallel_degree", str(case["tp"]),
        "--parallelism.data_parallel_shard_degree", str(case["dp"]),
        "--boost.tp_plan", case["plan"],
        "--boost.latent_checkpoint", case.get("latent_checkpoint", "none"),
        "--activation_checkpoint.mode", case.get("ac", "none"),
        "--training.seq_len", str(SEQ),
        "--training.mixed_precision_param", "float32",
    ]  # fmt: skip
    if case.get("sp"):
        argv.append("--boost.sequence_parallel")
    if case.get("compile"):
        argv += ["--compile.enable", "--compile.backend", "aot_eager"]
    if case.get("optimizer") == "LORO":  # its exact step (W = B A rewritten) at step 2
        argv += ["--model.name", "svd_llama2", "--optimizer.name", "LORO"]
        argv += ["--optimizer.loro_freq", "2"]
    return parse_config(argv)


def _optimizer(case: dict, parts: list, dims):
    """torch's AdamW, or (``optimizer``: LORO) the trainer's builder for the case's
    config on ``dims`` (the reference: one rank)."""
    if case.get("optimizer") == "LORO":
        from boost_titan.train.specs import build_optimizers

        return build_optimizers(parts, _job_config(case).optimizer, dims)
    return torch.optim.AdamW(parts[0].parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)


def _model(args):
    from boost_titan.models.model import Transformer

    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def _reference(case: dict, args, batches):
    """(losses, gradients per step) of the whole model on whole batches."""
    from torchtitan.distributed import ParallelDims

    model = _model(args)
    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    opt = _optimizer(case, [model], one)
    losses, grads = [], []
    for tokens, labels in batches:
        logits = model(tokens)
        loss = (
            torch.nn.functional.cross_entropy(
                logits.flatten(0, 1).float(), labels.flatten(), reduction="sum"
            )
            / labels.numel()
        )
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
    return losses, grads


def _layout(case: dict, args, batches, world: int):
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    from boost_titan.parallel.parallelize import parallelize_boost
    from boost_titan.parallel.pipeline import build_loss_fn

    job_config = _job_config(case)
    dims = ParallelDims(dp_replicate=1, dp_shard=case["dp"], cp=case["cp"], tp=case["tp"],
                        pp=1, ep=1, etp=1, world_size=world)  # fmt: skip
    dims.build_mesh()
    model = parallelize_boost(_model(args), dims, job_config)
    loss_fn = build_loss_fn(job_config)
    context = dist_utils.get_train_context(dims.tp_enabled)  # loss-parallel under TP
    opt = _optimizer(case, [model], dims)
    dp_rank = dims.get_mesh("batch").get_local_rank() if dims.dp_enabled else 0
    losses, grads = [], []
    for tokens, labels in batches:
        rows = slice(dp_rank * BATCH // case["dp"], (dp_rank + 1) * BATCH // case["dp"])
        inputs, local_labels, extra = prepare_context_parallel_input(
            tokens[rows], labels[rows], {}, dims.get_mesh("cp"), torch.device("cpu"), "headtail"
        )
        with context():
            loss = loss_fn(model(inputs, **extra), local_labels) / labels.numel()
            loss.backward()
        total = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        total = total.detach().clone()
        dist.all_reduce(total, group=dims.get_mesh("loss").get_group())  # the dp x cp ranks' sums
        losses.append(total.item())
        grads.append({
            n.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", ""):
            p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
            for n, p in model.named_parameters()
        })  # fmt: skip
        opt.step()
        opt.zero_grad()
    # FSDP2 renames a sharded module's class (FSDPOptimizedModule): ask isinstance
    compiled = sum(isinstance(m, torch._dynamo.eval_frame.OptimizedModule) for m in model.modules())
    return losses, grads, compiled


def _compare(ref, got) -> dict:
    """Worst relative loss error and worst per-parameter gradient error over the steps
    (max |diff| / max |reference| of each parameter)."""
    (ref_loss, ref_grads), (loss, grads, compiled) = ref, got
    loss_err = max(abs(a - b) / abs(a) for a, b in zip(ref_loss, loss))
    grad_err, worst = 0.0, ""
    for step_ref, step_got in zip(ref_grads, grads):
        assert set(step_ref) == set(step_got), sorted(set(step_ref) ^ set(step_got))
        for name, g in step_ref.items():
            err = ((step_got[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
            if err > grad_err:
                grad_err, worst = err, name
    return {"loss": ref_loss, "cp_loss": loss, "loss_err": loss_err, "grad_err": grad_err,
            "worst": worst, "compiled_blocks": compiled}  # fmt: skip


def _worker(rank: int, world: int, init_file: str, cases: list, out_file: str):
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        from boost_titan.models.flavors import flavors_for

        sys.path.insert(0, os.path.dirname(__file__))
        from tp_sim import small_args

        results = []
        for case in cases:
            args = small_args(flavors_for(case["arch"])[case.get("flavor", "debugmodel")],
                              n_layers=case.get("layers", 2))  # fmt: skip
            args.max_seq_len = SEQ
            g = torch.Generator().manual_seed(1)
            batches = [
                tuple(
                    torch.randint(0, args.vocab_size, (BATCH, SEQ), generator=g) for _ in range(2)
                )
                for _ in range(STEPS)
            ]
            ref = _reference(case, copy.deepcopy(args), batches)
            got = _layout(case, copy.deepcopy(args), batches, world)
            results.append(dict(case, **_compare(ref, got)))
            torch._dynamo.reset()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


def run_cases(cases: list[dict], world: int, workdir: str) -> list[dict]:
    """Run ``cases`` (each: arch, cp, tp, dp, plan[, sp, compile, latent_checkpoint, ac,
    flavor, layers, optimizer]) in one launch of ``world`` gloo ranks."""
    from launcher import spawn

    os.makedirs(workdir, exist_ok=True)
    out_file = os.path.join(workdir, "results.json")
    spawn(_worker, (world, os.path.join(workdir, "init"), cases, out_file), world)
    with open(out_file) as f:
        return json.load(f)
