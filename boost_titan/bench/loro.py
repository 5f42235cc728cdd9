"""LORO's cost under BTP: the exact step vs a lazy step vs AdamW, side by side in one run.

    python -m boost_titan.bench.loro [--tp 2] [--reps 5] [--smoke] [--json out.json]

Each rank builds svd_llama2 at the benchmark's shape (``boost_titan.bench`` Shape:
d 1024, f 2736, r 256, 4 blocks, batch 4 x seq 1024), applies BTP, runs forward +
backward once for real gradients, then times (interleaved, median of ``--reps``):
a forward + backward, an AdamW step, a lazy LORO step and an exact LORO step. The
exact step's collectives and bytes per rank are counted. Amortised overhead of LORO
over AdamW at exact-step period K = (lazy - adamw + (exact - lazy) / K) / (fwd+bwd+adamw).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boost_titan.bench.variants import SMOKE, Shape, lm_loss, sync

PERIODS = (500, 200)


def _model(shape: Shape, mesh, device):
    from boost_titan.models.model import Transformer
    from boost_titan.tp_plans.btp import apply_btp

    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(shape.args("svd"))
    with torch.no_grad():
        model.init_weights()
    apply_btp(model, mesh, True)
    return model


def _timed(fn, device) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def _worker(rank: int, world: int, cfg: dict, out: str) -> None:
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from boost_titan.bench.worker import init_rank
    from boost_titan.comm_stats import CommCounter
    from boost_titan.optim.loro import LORO

    device = init_rank(rank, world, cfg["init"], cfg["threads"])
    shape = Shape(**cfg["shape"])
    model = _model(shape, init_device_mesh(device.type, (world,)), device)
    g = torch.Generator().manual_seed(1)
    tokens, labels = (
        torch.randint(0, shape.vocab_size, (shape.batch, shape.seq), generator=g).to(device)
        for _ in range(2)
    )

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        with loss_parallel():
            lm_loss(model(tokens), labels).backward()

    hp = dict(lr=1e-4, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, lr_scaler=-1.0)
    hp.update(refresh="none", restart_warmup=0, model_dim=shape.dim)
    steps = {
        "adamw": torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True).step,
        "loro_lazy": LORO(model, exact_every=10**9, **hp).step,
        "loro_exact": LORO(model, exact_every=1, **hp).step,
    }
    fwd_bwd()
    for step in steps.values():  # warm-up (allocations, kernels)
        step()
    times = {k: [] for k in ("fwd_bwd", *steps)}
    for _ in range(cfg["reps"]):
        times["fwd_bwd"].append(_timed(fwd_bwd, device))
        for name, step in steps.items():
            times[name].append(_timed(step, device))
    with CommCounter() as comm:
        steps["loro_exact"]()
    count, nbytes = comm.total()
    ops = {}
    for r in comm.records:
        ops.setdefault(r.op, [0, 0])
        ops[r.op][0] += 1
        ops[r.op][1] += r.nbytes
    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        result = dict(
            shape=asdict(shape),
            tp=world,
            device=torch.cuda.get_device_name(rank) if device.type == "cuda" else "cpu",
            reps=cfg["reps"],
            seconds=med,
            spread={k: (min(v), max(v)) for k, v in times.items()},
            exact_collectives=count,
            exact_bytes_per_rank=nbytes,
            exact_ops={k: tuple(v) for k, v in ops.items()},
        )
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.destroy_process_group()


def report(res: dict) -> str:
    s = res["seconds"]
    train = s["fwd_bwd"] + s["adamw"]
    lines = [
        f"LORO under BTP TP{res['tp']} on {res['device']}, shape {res['shape']}, "
        f"median of {res['reps']}",
        f"  forward+backward  {s['fwd_bwd'] * 1e3:9.1f} ms",
        f"  AdamW step        {s['adamw'] * 1e3:9.1f} ms",
        f"  LORO lazy step    {s['loro_lazy'] * 1e3:9.1f} ms",
        f"  LORO exact step   {s['loro_exact'] * 1e3:9.1f} ms  "
        f"({s['loro_exact'] / s['loro_lazy']:.1f}x lazy; {res['exact_collectives']} collectives, "
        f"{res['exact_bytes_per_rank'] / 2**20:.2f} MiB per rank: "
        + ", ".join(f"{op} {n} x / {b / 2**20:.2f} MiB" for op, (n, b) in res["exact_ops"].items())
        + ")",
    ]
    for k in PERIODS:
        loro = s["loro_lazy"] + (s["loro_exact"] - s["loro_lazy"]) / k
        lines.append(
            f"  K = {k}: LORO {loro * 1e3:.1f} ms/step amortised; step time vs AdamW "
            f"{(s['fwd_bwd'] + loro) / train:.4f}x (exact steps alone add "
            f"{(s['loro_exact'] - s['loro_lazy']) / k / train * 100:.2f}%)"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--smoke", action="store_true", help="tiny shape (tests)")
    p.add_argument("--json", help="also write the figures here")
    a = p.parse_args(argv)
    if a.tp < 1 or a.reps < 1:
        p.error(f"--tp and --reps must be >= 1, got {a.tp}, {a.reps}")
    shape = SMOKE if a.smoke else Shape()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "loro.json")
        cfg = dict(
            shape=asdict(shape),
            reps=a.reps,
            threads=a.threads,
            init=f"file://{os.path.join(tmp, 'pg')}",
        )
        mp.spawn(_worker, args=(a.tp, cfg, out), nprocs=a.tp, join=True)
        with open(out) as f:
            res = json.load(f)
    print(report(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
