"""GEMM mode: single device, each TP plan's per-rank forward GEMMs at a flavor's shapes, timed."""

from __future__ import annotations

import time

import torch

# GEMM mode's shapes when --tp/--batch/--seq are not given: 7B at TP4, b 4 x s 4096
GEMM_DEFAULTS = {"tp": 4, "batch": 4, "seq": 4096}


def gemm_bench(
    flavor: str, tp: int, batch: int, seq: int, dtype: str, m_scale: float, seconds: float
) -> dict:
    """Single device: time each plan's per-rank forward GEMMs at a flavor's shapes."""
    from boost_titan.models.flavors import flavors_for
    from boost_titan.perf.plan import PLANS, block_gemms

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dt = getattr(torch, dtype)
    args = flavors_for("cola")[flavor]
    m = max(1, int(batch * seq * m_scale))
    out = {"flavor": flavor, "tp": tp, "m": m, "dtype": dtype, "device": str(dev), "plans": {}}
    # btp_sp runs btp's GEMMs (the latents are gathered back to the whole sequence
    # before each B): timing them twice says nothing
    for plan in (p for p in PLANS if p != "btp_sp"):
        a = args.with_overrides(arch="dense", rank=0) if plan == "fullrank" else args
        total_flops, total_s, rows = 0.0, 0.0, []
        for gm in block_gemms(a, plan, tp, m):
            x = torch.randn(gm.m, gm.k, device=dev, dtype=dt)
            w = torch.randn(gm.k, gm.n, device=dev, dtype=dt)
            x @ w
            if dev.type == "cuda":
                torch.cuda.synchronize()
            n, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                x @ w
                n += 1
            if dev.type == "cuda":
                torch.cuda.synchronize()
            dt_s = (time.perf_counter() - t0) / n
            flops = 2 * gm.m * gm.k * gm.n
            rows.append(
                {"gemm": gm.name, "m": gm.m, "k": gm.k, "n": gm.n, "tflops": flops / dt_s / 1e12}
            )
            total_flops += flops
            total_s += dt_s
        out["plans"][plan] = {
            "gemms": rows,
            "block_gemm_time_s": total_s,
            "tflops": total_flops / total_s / 1e12,
        }
    return out
