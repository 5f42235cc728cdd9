"""LORO's cost under BTP: the exact step vs a lazy step vs AdamW, side by side in one run.

    boost-titan bench-loro [--tp 2] [--reps 5] [--smoke] [--json out.json]
    boost-titan bench-loro --pair 7b --tp 4 --dp 2 [--reps 3] [--mfu 0.4]

Each rank builds svd_llama2 at the benchmark's shape (``boost_titan.perf.bench`` Shape:
d 1024, f 2736, r 256, 4 blocks, batch 4 x seq 1024), applies BTP, runs forward +
backward once for real gradients, then times (interleaved, median of ``--reps``):
a forward + backward, an AdamW step, a lazy LORO step and an exact LORO step. The
exact step's collectives and bytes per rank are counted. Amortised overhead of LORO
over AdamW at exact-step period K = (lazy - adamw + (exact - lazy) / K) / (fwd+bwd+adamw).

``--pair FLAVOR`` times instead, in this one process, what ONE rank computes for one
factor pair of each projection shape of svd_llama2 FLAVOR under BTP TP ``--tp`` x FSDP
``--dp`` (B's rows split tp x dp, A's rows split tp, A's r gathered over dp), in float64
and float32: the row-local work (QRs, solves, products of local rows), the TSQR's
replicated small QRs of stacked R factors, the 2r x 2r core SVD, the final products;
collectives are not run (their bytes are listed). It extrapolates to the whole exact
step (7 pairs x layers) with the SVD replicated on every rank vs spread over the tp x dp
ranks that hold each pair, and states the amortised overhead at K against a training
step time derived from the flavor's FLOPs at an assumed MFU of an assumed GPU (no GPU
measurement: an extrapolation from CPU timings).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from boost_titan.config import Parser
from boost_titan.perf.bench.variants import SMOKE, Shape, lm_loss, sync

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
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from boost_titan.observability.comm_stats import CommCounter
    from boost_titan.optim.loro import LORO
    from boost_titan.perf.bench.worker import init_rank

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


GPU_PEAK_BF16 = 989e12  # H100 SXM dense bf16 FLOP/s (the assumed step-time yardstick)


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def pair_times(d_in: int, d_out: int, r: int, tp: int, dp: int, dtype, reps: int) -> dict:
    """Seconds one rank spends on one factor pair's exact step, by part (see --pair)."""
    from boost_titan.optim import manifold

    g = torch.Generator().manual_seed(0)
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    rows_m, rows_n = d_out // (tp * dp), d_in // tp
    M, dM = rand(rows_m, r), rand(rows_m, r) * 1e-3
    N, dN = rand(rows_n, r), rand(rows_n, r) * 1e-3
    stacks_m = [p for p in (dp, tp) if p > 1]
    stacks_n = [tp] if tp > 1 else []

    # the replicated part of the 4 TSQRs: per row split, a QR of P stacked r x r R's and
    # the local Q times its block of the stacked Q (M and Y2 on B's splits, N and Y1 on A's)
    work = [
        (rand(rows, r), rand(p * r, r))
        for rows, sp in ((rows_m, stacks_m), (rows_n, stacks_n))
        for p in sp
    ]

    def stacks():
        for q, r_stack in work:
            for _ in range(2):
                q_stack, _ = torch.linalg.qr(r_stack)
                q @ q_stack[:r]

    # manifold.tangent_core's local work, with the full R factors the TSQR would return
    # (a rank's rows alone may be fewer than r: its local R is singular)
    Rm, Rn = (torch.linalg.qr(rand(2 * r, r))[1] for _ in range(2))
    solve = torch.linalg.solve_triangular

    def local():
        U, _ = manifold.tsqr(M, [])
        V, _ = manifold.tsqr(N, [])
        GV = solve(Rn, dM, upper=True, left=False)
        GtU = solve(Rm, dN, upper=True, left=False)
        K0 = GtU.T @ V
        Y1 = GtU - V @ K0.T
        Y2 = GV - U @ (U.T @ GV)
        Q1, K1 = manifold.tsqr(Y1, [])
        Q2, K2 = manifold.tsqr(Y2, [])
        core = torch.zeros(2 * r, 2 * r, dtype=M.dtype)
        core[:r, :r] = Rm @ Rn.T - 1e-3 * K0
        core[:r, r:] = -1e-3 * K1.T
        core[r:, :r] = -1e-3 * K2
        parts.update(bases=(U, Q2, V, Q1), core=core)

    out, parts = {}, {}
    out["local"] = _median_time(local, reps)
    out["stacks"] = _median_time(stacks, reps)
    out["svd"] = _median_time(lambda: parts.update(f=manifold.core_factors(parts["core"])), reps)
    out["finish"] = _median_time(lambda: manifold.finish(*parts["bases"], *parts["f"]), reps)
    assert all(t.isfinite().all() for t in parts["f"]), "non-finite core factors"
    return out


def pair_report(flavor: str, tp: int, dp: int, reps: int, threads: int, mfu: float) -> dict:
    from boost_titan.models.flavors import MODEL_ARCH, flavors_for

    torch.set_num_threads(threads)
    args = flavors_for(MODEL_ARCH["svd_llama2"])[flavor]
    shapes = {}  # (d_in, d_out, r) -> projections of a block with that shape
    for name, shape in args.projection_shapes().items():
        shapes.setdefault(shape, []).append(name)
    n_pairs = 7 * args.n_layers
    group = tp * dp  # ranks holding (shards of) each pair: one SVD per rank per batch
    res = dict(flavor=flavor, tp=tp, dp=dp, threads=threads, reps=reps, pairs=n_pairs)
    res["shapes"] = {"x".join(map(str, k)): v for k, v in shapes.items()}
    tokens = 4 * 4096 * dp  # recipes/base/gpu.toml: micro-batch 4 x seq 4096 per DP rank
    flops_per_gpu = args.flops_per_token(4096) * tokens / (tp * dp)
    res["step_s_assumed"] = flops_per_gpu / (GPU_PEAK_BF16 * mfu)
    res["mfu"] = mfu
    for dtype in (torch.float64, torch.float32):
        name = str(dtype).removeprefix("torch.")
        per_shape = {}
        for (d_in, d_out, r), names in shapes.items():
            per_shape["x".join(map(str, (d_in, d_out, r)))] = t = pair_times(
                d_in, d_out, r, tp, dp, dtype, reps
            )
            print(
                f"  {name} {names} in {d_in} out {d_out} r {r}: "
                + ", ".join(f"{k} {v:.2f} s" for k, v in t.items()),
                flush=True,
            )
        rest = sum(
            len(names) * args.n_layers * (t["local"] + t["stacks"] + t["finish"])
            for names, t in zip(shapes.values(), per_shape.values())
        )
        svd = statistics.median(t["svd"] for t in per_shape.values())
        replicated = rest + n_pairs * svd
        spread = rest + math.ceil(n_pairs / group) * svd
        res[name] = dict(
            per_pair=per_shape, svd=svd, rest=rest, exact_replicated=replicated, exact_spread=spread
        )
    return res


def report_pair(res: dict) -> str:
    step = res["step_s_assumed"]
    lines = [
        f"LORO exact step, svd_llama2 {res['flavor']} under BTP TP{res['tp']} x FSDP{res['dp']}: "
        f"per rank, {res['pairs']} pairs, CPU ({res['threads']} thread(s)), median of "
        f"{res['reps']}; assumed training step {step:.2f} s (flavor FLOPs at "
        f"{res['mfu']:.0%} MFU of {GPU_PEAK_BF16 / 1e12:.0f} TFLOP/s, micro-batch 4 x seq 4096)",
    ]
    for dtype in ("float64", "float32"):
        f = res[dtype]
        lines.append(
            f"  {dtype}: core SVD {f['svd']:.2f} s/pair; the rest {f['rest']:.1f} s/step; exact "
            f"step {f['exact_replicated']:.1f} s with the SVD on every rank, "
            f"{f['exact_spread']:.1f} s spread over {res['tp'] * res['dp']} ranks"
        )
        for k in PERIODS:
            rep, spr = f["exact_replicated"] / k, f["exact_spread"] / k
            lines.append(
                f"    K = {k}: +{rep:.2f} s/step replicated, +{spr:.2f} s/step spread: "
                f"{rep / step:.0%} / {spr / step:.0%} of the assumed step at this CPU's speed; "
                f"<= 1% needs the GPU {rep / step / 0.01:.0f}x / {spr / step / 0.01:.0f}x faster"
            )
    return "\n".join(lines)


def main(argv=None) -> None:
    p = Parser(
        prog="boost-titan bench-loro",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--tp", type=int, default=2, help="TP degree = ranks (default 2)")
    p.add_argument(
        "--reps", type=int, default=5, help="interleaved repetitions, median taken (default 5)"
    )
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--smoke", action="store_true", help="tiny shape (tests)")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--pair", metavar="FLAVOR", help="time one rank's exact step per pair")
    p.add_argument("--dp", type=int, default=1, help="--pair: FSDP degree")
    p.add_argument("--mfu", type=float, default=0.4, help="--pair: assumed MFU of the step")
    a = p.parse_args(argv)
    if a.tp < 1 or a.reps < 1 or a.dp < 1:
        p.error(f"--tp, --dp and --reps must be >= 1, got {a.tp}, {a.dp}, {a.reps}")
    if not 0 < a.mfu <= 1:
        p.error(f"--mfu must be in (0, 1], got {a.mfu}")
    if a.pair is not None:
        from boost_titan.parallel import cpu_runtime

        cpu_runtime.activate()  # the flavors import torchtitan
        from boost_titan.models.flavors import FLAVORS

        if a.pair not in FLAVORS:
            p.error(f"--pair {a.pair!r} is not a flavor; choose one of {list(FLAVORS)}")
        res = pair_report(a.pair, a.tp, a.dp, a.reps, a.threads, a.mfu)
        print(report_pair(res))
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
        return
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
