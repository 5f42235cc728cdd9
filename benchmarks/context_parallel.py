"""Long sequences on 2 ranks: context parallelism (CP2) against vanilla TP2 and BTP TP2.

    .venv/bin/python benchmarks/context_parallel.py [--seq 8192] [--steps 3] [--arch cola]

Each layout trains the same seeded debug model (fp32, local batch 1) with the trainer's
``parallelize_boost`` on 2 gloo ranks, one after the other in one launch: one untimed
step, then ``--steps`` timed steps (forward, backward, AdamW). It prints tokens/s of the
whole batch, and the bytes one rank moves in one step (``CommCounter``: every collective,
all-reduce-equivalent bytes), split into attention's ring (CP), FSDP's parameter
all-gathers and gradient reduce-scatters (CP2 shards parameters over its 2 ranks, as
torchtitan does) and TP's collectives. Figures: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist

LAYOUTS = {  # name: (cp, tp, tp_plan)
    "CP2": (2, 1, "auto"),
    "vanilla TP2": (1, 2, "vanilla"),
    "BTP TP2": (1, 2, "btp"),
}


def _kind(record, cp: int) -> str:
    """Attention's ring (CP's only traffic besides FSDP), else FSDP's (the CP layout
    has no TP) or TP's (the TP layouts have no FSDP)."""
    if "inner_attention" in record.module:
        return "ring"
    return "fsdp" if cp > 1 else "tp"


def _layout(name: str, a, world: int) -> dict:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.context_parallel import prepare_context_parallel_input

    from boost_titan.models.flavors import flavors_for
    from boost_titan.models.model import Transformer
    from boost_titan.observability.comm_stats import CommCounter
    from boost_titan.parallel.parallelize import parallelize_boost
    from boost_titan.parallel.pipeline import build_loss_fn
    from boost_titan.train.config_check import parse_config

    cp, tp, plan = LAYOUTS[name]
    config = parse_config([
        "--parallelism.context_parallel_degree", str(cp),
        "--parallelism.tensor_parallel_degree", str(tp),
        "--boost.tp_plan", plan, "--training.seq_len", str(a.seq),
        "--training.mixed_precision_param", "float32",
    ])  # fmt: skip
    args = flavors_for(a.arch)["debugmodel"]
    args.max_seq_len = a.seq
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=cp, tp=tp, pp=1, ep=1, etp=1,
                        world_size=world)  # fmt: skip
    dims.build_mesh()
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    model = parallelize_boost(model, dims, config)
    loss_fn = build_loss_fn(config)
    context = dist_utils.get_train_context(dims.tp_enabled)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab_size, (1, a.seq), generator=g)
    labels = torch.randint(0, args.vocab_size, (1, a.seq), generator=g)
    extra = {}
    if cp > 1:
        tokens, labels, extra = prepare_context_parallel_input(
            tokens, labels, {}, dims.get_mesh("cp"), torch.device("cpu"), "headtail"
        )

    def step(counter=None):
        with context(), counter or _null():
            loss = loss_fn(model(tokens, **extra), labels) / a.seq
            loss.backward()
        opt.step()
        opt.zero_grad()

    counter = CommCounter()
    step(counter)  # untimed, counted
    bytes_by = {"ring": 0.0, "fsdp": 0.0, "tp": 0.0}
    for r in counter.records:
        bytes_by[_kind(r, cp)] += r.volume
    dist.barrier()
    start = time.perf_counter()
    for _ in range(a.steps):
        step()
    dist.barrier()
    seconds = (time.perf_counter() - start) / a.steps
    return {"layout": name, "tokens_per_s": a.seq / seconds, "step_s": seconds,
            **{f"{k}_MiB": v / 2**20 for k, v in bytes_by.items()}}  # fmt: skip


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _worker(rank: int, world: int, init: str, a, out: str) -> None:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        rows = [_layout(name, a, world) for name in LAYOUTS]
        if rank == 0:
            with open(out, "w") as f:
                json.dump(rows, f)
    finally:
        dist.destroy_process_group()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--arch", default="cola", choices=["dense", "svd", "cola", "lax"])
    a = p.parse_args(argv)
    import torch.multiprocessing as mp

    work = tempfile.mkdtemp()
    out = os.path.join(work, "rows.json")
    mp.start_processes(_worker, args=(2, os.path.join(work, "init"), a, out), nprocs=2,
                       join=True, start_method="spawn")  # fmt: skip
    with open(out) as f:
        rows = json.load(f)
    base = rows[0]["tokens_per_s"]
    print(f"{a.arch} debugmodel, seq {a.seq}, batch 1, 2 gloo ranks, fp32, {a.steps} steps")
    print("| layout | tokens/s | x CP2 | ring MiB | FSDP MiB | TP MiB | total MiB |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        total = r["ring_MiB"] + r["fsdp_MiB"] + r["tp_MiB"]
        cells = [
            r["layout"],
            f"{r['tokens_per_s']:,.0f}",
            f"{r['tokens_per_s'] / base:.2f}",
            *(f"{r[k]:.1f}" for k in ("ring_MiB", "fsdp_MiB", "tp_MiB")),
            f"{total:.1f}",
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
