"""Compiled vs eager on real gloo TP ranks, many configurations per launch.

Each configuration builds the model from the same seed on every rank, parallelizes it
with ``parallelize_boost`` (the trainer's own function: TP plan, latent checkpointing,
per-block compile) and trains a few AdamW steps with torchtitan's loss (compiled with
the model, loss-parallel on) and gradient clipping; the compiled copy must give the
eager copy's losses and grad norms. Used by ``tests/test_compile.py``; run directly to
check one configuration: ``python tests/compile_check.py btp cola none attention``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from launcher import spawn

from boost_titan.observability.comm_stats import CommCounter
from boost_titan.observability.step_profile import StepProfiler

TP = 2
STEPS = 3
PROFILED_STEP, COUNTED_STEP = 1, 2  # 0-based


def _job_config(
    plan: str,
    latent_checkpoint: str,
    keep: str,
    compiled: bool,
    ac: str,
    backend: str,
    dtype: str = "float32",
):
    from boost_titan.train.config_check import parse_config

    # "btp_sp": btp with sequence-parallel latents (the planner's name)
    sp = ["--boost.sequence_parallel"] if plan == "btp_sp" else []
    argv = [
        *sp,
        "--activation_checkpoint.mode",
        ac,
        "--boost.tp_plan",
        "btp" if sp else plan,
        "--boost.latent_checkpoint",
        latent_checkpoint,
        "--boost.latent_checkpoint_keep",
        keep,
        "--training.seq_len",
        "32",
        "--parallelism.tensor_parallel_degree",
        str(TP),
        # bf16 on TP-only: autocast around the model's forward (parallelize_boost)
        "--training.mixed_precision_param",
        dtype,
    ]
    if compiled:
        argv += ["--compile.enable", "--compile.backend", backend]
    return parse_config(argv)


def _optimizer(name: str, model, args):
    """AdamW, or LORO with an exact step at step 2 (of 3): its exact step rewrites the
    factors in place between compiled calls."""
    if name == "AdamW":
        return torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4, weight_decay=0.1)
    from boost_titan.optim.loro import LORO

    return LORO(
        model,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-4,
        weight_decay=0.1,
        exact_every=2,
        lr_scaler=-1.0,
        refresh="all",
        restart_warmup=0,
        model_dim=args.dim,
    )


def _run(parallel_dims, args, case: dict, compiled: bool, batches):
    from torchtitan.distributed import utils as dist_utils

    from boost_titan.models.model import Transformer
    from boost_titan.parallel.parallelize import parallelize_boost
    from boost_titan.parallel.pipeline import build_loss_fn

    plan, latent_checkpoint, keep, ac = (
        case[k] for k in ("plan", "latent_checkpoint", "keep", "ac")
    )
    job_config = _job_config(
        plan, latent_checkpoint, keep, compiled, ac, case["backend"], case["dtype"]
    )
    torch.manual_seed(0)  # same weights on every rank and in both runs
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    model = parallelize_boost(model, parallel_dims, job_config)
    loss_fn = build_loss_fn(job_config)
    context = dist_utils.get_train_context(True)  # loss-parallel, as the trainer
    opt = _optimizer(case["optimizer"], model, args)
    losses, norms = [], []
    # step 2 runs under the trainer's step profiler; eager step 3's forward/backward is
    # counted by CommCounter (a dispatch mode: compiled code refuses it), the reference
    profiler = StepProfiler(1, "cpu")
    profile: dict = {}
    start = time.perf_counter()
    for i, (tokens, labels) in enumerate(batches):
        profiled = profiler.profile() if i == PROFILED_STEP else contextlib.nullcontext({})
        counter = CommCounter() if i == COUNTED_STEP and not compiled else None
        with profiled as scalars:
            with profiler.forward_backward(), counter or contextlib.nullcontext(), context():
                loss = loss_fn(model(tokens), labels) / labels.numel()
                loss.backward()
            norm = dist_utils.clip_grad_norm_(list(model.parameters()), max_norm=1.0, foreach=True)
            opt.step()
            opt.zero_grad()
        if i == PROFILED_STEP:
            profile.update(scalars, flops=profiler.flops_per_step)
        if counter is not None:
            profile["counted_collectives"] = len(counter.records)
            profile["counted_volume_MiB"] = sum(r.volume for r in counter.records) / 2**20
        losses.append(loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item())
        norms.append(norm.full_tensor().item() if hasattr(norm, "full_tensor") else norm.item())
    if compiled:
        profile["block_graphs"] = _block_graphs(model)
    return losses, norms, time.perf_counter() - start, profile


def _block_graphs(model) -> int:
    """Compiled graphs Dynamo holds for the blocks' forward (one code object shared by
    every block): 1 when all blocks share one graph; a graph per block when something
    a block reads differs per block (the recompile limit, 8, then stops the 9th)."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    blocks = [b._orig_mod for b in model.layers.values()]
    codes = {type(b).forward.__code__ for b in blocks}
    return sum(len(_debug_get_cache_entry_list(code)) for code in codes)


FIELDS = (
    "plan",
    "arch",
    "flavor",
    "latent_checkpoint",
    "keep",
    "ac",
    "optimizer",
    "backend",
    "layers",
    "dtype",
)
DEFAULTS = {"optimizer": "AdamW", "backend": "inductor", "layers": 2, "dtype": "float32"}


def as_row(case: tuple) -> dict:
    """A case (plan, arch, flavor, latent_checkpoint, keep, ac[, optimizer[, backend[,
    layers[, dtype]]]]) as a dict; AdamW, inductor, 2 blocks and float32 unless given."""
    row = dict(DEFAULTS, **dict(zip(FIELDS, case)))
    assert len(case) <= len(FIELDS) and set(row) == set(FIELDS), case
    return row


def _worker(rank: int, init_file: str, cases: list, out_file: str, cache_dir: str):
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    torch.set_num_threads(1)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir  # parallelize_boost makes it rank-local
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=TP)
    try:
        from torchtitan.distributed import ParallelDims

        from boost_titan.models.flavors import flavors_for

        sys.path.insert(0, os.path.dirname(__file__))
        from tp_sim import small_args

        dims = ParallelDims(
            dp_replicate=1, dp_shard=1, cp=1, tp=TP, pp=1, ep=1, etp=1, world_size=TP
        )
        dims.build_mesh()
        results, statistic = [], None
        for case in cases:
            row = as_row(case)
            if row["dtype"] == "bfloat16":  # bf16 rows carry the statistic's check
                statistic = statistic or _bf16_statistic(dims.get_mesh("tp"))
                row["statistic"] = statistic
            args = small_args(flavors_for(row["arch"])[row["flavor"]], n_layers=row["layers"])
            g = torch.Generator().manual_seed(1)
            batches = [
                tuple(torch.randint(0, args.vocab_size, (2, 32), generator=g) for _ in range(2))
                for _ in range(STEPS)
            ]
            for mode in ("eager", "compiled"):
                losses, norms, secs, profile = _run(
                    dims, copy.deepcopy(args), row, mode == "compiled", batches
                )
                row[mode] = {
                    "loss": losses,
                    "grad_norm": norms,
                    "seconds": secs,
                    "profile": profile,
                }
            results.append(row)
            torch._dynamo.reset()
        if rank == 0:
            with open(out_file, "w") as f:
                json.dump(results, f, indent=1)
    finally:
        dist.destroy_process_group()


def _bf16_statistic(mesh) -> dict:
    """BTP's bf16 Online-RMSNorm statistic (``BTPComm.reduce_down``: each rank's fp32
    sum of squares as hi/lo bf16 columns of the latent all-reduce) compiled with
    inductor, against eager and the exact (float64) sum of the ranks' fp32 statistics.
    Inductor once dropped lo (937.50739 came back 936.0): only its code generation
    shows that, so this is compiled with inductor whatever the matrix rows use."""
    from boost_titan.tp_plans.btp import BTPComm

    comm = BTPComm(mesh)
    g = torch.Generator().manual_seed(7 + dist.get_rank())
    stats = torch.rand(2, 16, 1, generator=g) * 1000
    stats[0, 0, 0] = 937.50739 / TP  # the value, summed over the ranks
    latent = torch.randn(2, 16, 8, generator=g).bfloat16()
    exact = stats.double()
    dist.all_reduce(exact)
    eager = comm.reduce_down(latent, stats)
    compiled = torch.compile(comm.reduce_down, backend="inductor", fullgraph=True)(latent, stats)

    def rel_err(total):
        return ((total.double() - exact).abs() / exact).max().item()

    return {
        "latent_bitwise": torch.equal(eager[0], compiled[0]),
        "statistic_bitwise": torch.equal(eager[1], compiled[1]),
        "rel_err_eager": rel_err(eager[1]),
        "rel_err_compiled": rel_err(compiled[1]),
    }


def run_cases(cases: list, workdir: str, cache_dir: str | None = None) -> list[dict]:
    """Run ``cases`` in one launch of TP ranks; inductor caches under ``cache_dir``
    (default: a fresh folder in ``workdir``)."""
    os.makedirs(workdir, exist_ok=True)
    out_file = os.path.join(workdir, "results.json")
    cache_dir = cache_dir or os.path.join(workdir, "inductor")
    spawn(_worker, (os.path.join(workdir, "init"), cases, out_file, cache_dir), TP)
    with open(out_file) as f:
        return json.load(f)


if __name__ == "__main__":
    import tempfile

    # plan arch latent_checkpoint keep [flavor [ac [optimizer [backend]]]]
    plan, arch, latent_checkpoint, keep = sys.argv[1:5]
    flavor, *rest = sys.argv[5:] or ["debugmodel"]
    case = (plan, arch, flavor, latent_checkpoint, keep, *(rest or ["none"]))
    for row in run_cases([case], tempfile.mkdtemp()):
        print(json.dumps(row))
