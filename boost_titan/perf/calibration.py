"""Calibration of the step-time model (:mod:`boost_titan.perf.step_time`): its three
fractions fitted to the BOOST paper's A100 times (``calibration``: per point the
published and predicted time, the error, the leave-one-out error, the plans' order), or
refitted on this project's own GPU measurements (``calibrate_from_gpu_check``: the GEMM
rates of ``boost-titan gpu-check``). Printed by ``boost-titan
step-time --paper [--calibrate gpu_check.json]``."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace

from boost_titan.perf.hardware import GPU, gpu
from boost_titan.perf.step_time import Efficiency, Layout, gemm_time, step_time

# The BOOST paper's weak-scaling times (s/iteration), Perlmutter A100 40GB, 4 GPUs per
# node, seq 4096, micro-batch 4, bf16 (../shared/design/boost.md section 7): size ->
# (arch, layout, {plan: seconds}).
START = Efficiency()  # where the fit starts

PAPER_A100 = [
    ("3b", "cola", (2, 1), {"fullrank": 1.14, "vanilla": 1.41, "btp": 0.78}),
    ("7b", "cola", (4, 1), {"fullrank": 1.06, "vanilla": 1.64, "btp": 0.72}),
    ("13b", "cola", (4, 2), {"fullrank": 2.07, "vanilla": 2.42, "btp": 1.30}),
    ("30b", "cola", (4, 4), {"fullrank": 2.43, "vanilla": 2.58, "btp": 1.27}),
    ("7b", "svd", (4, 1), {"vanilla": 1.57, "btp": 0.70}),
    ("7b", "lax", (4, 1), {"vanilla": 1.72, "btp": 0.75}),
]
PAPER_GPU = "a100-40-hgx4"  # Perlmutter's node: 4 A100 40GB on an NVLink mesh
PAPER_NOTE = (
    "assumed for every point (the paper states neither): no data-parallel sharding or "
    "sync counted (weak scaling: each GPU's work is one TP/PP group's), one microbatch "
    "of 4 per iteration, PP as 1F1B, no activation checkpointing"
)


@dataclass
class Point:
    label: str
    arch: str
    flavor: str
    layout: Layout
    published_s: float
    group: str  # points sharing a size and architecture: their plan order is checked


def paper_points() -> list[Point]:
    out = []
    for flavor, arch, (tp, pp), times in PAPER_A100:
        for plan, sec in times.items():
            lay = Layout(plan, tp=tp, pp=pp, micro_batch=4, seq=4096, gpus_per_node=4)
            lay_note = f"TP{tp}" + (f"xPP{pp}" if pp > 1 else "")
            out.append(
                Point(
                    f"{arch} {flavor} {lay_note} {plan}", arch, flavor, lay, sec, f"{arch} {flavor}"
                )
            )
    return out


def _args(arch: str, flavor: str):
    from boost_titan.models.flavors import flavors_for

    return flavors_for(arch)[flavor]


def predict(points: list[Point], hw: GPU, eff: Efficiency) -> list[float]:
    return [step_time(_args(p.arch, p.flavor), p.layout, hw, eff).step_s for p in points]


def fit(points: list[Point], hw: GPU, start: Efficiency, loss_fn=None) -> Efficiency:
    """The fractions (e_gemm, e_hbm, e_link) in (0, 1] minimising the squared relative
    error over ``points``: Nelder-Mead on their logits (numpy only)."""
    import numpy as np

    def unpack(x):
        g, h, lk = 1 / (1 + np.exp(-np.asarray(x)))
        return replace(start, gemm=float(g), hbm=float(h), link=float(lk))

    def loss(x):
        e = unpack(x)
        pred = np.array(predict(points, hw, e))
        pub = np.array([p.published_s for p in points])
        return float(np.sum(((pred - pub) / pub) ** 2))

    logit = lambda v: math.log(v / (1 - v))  # noqa: E731
    x0 = np.array([logit(min(v, 0.99)) for v in start.fitted()])
    return unpack(_nelder_mead(loss if loss_fn is None else loss_fn, x0))


def _nelder_mead(f, x0, iters: int = 300, step: float = 0.5, tol: float = 1e-10):
    import numpy as np

    n = len(x0)
    simplex = [x0] + [x0 + step * np.eye(n)[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex = [simplex[i] for i in order]
        values = [values[i] for i in order]
        if values[-1] - values[0] < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                simplex = [simplex[0] + 0.5 * (x - simplex[0]) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def in_fit(p: Point) -> bool:
    """The points the fit uses: TP alone. The PP points depend on a schedule and a
    microbatch count the paper does not state: they are predicted, not fitted."""
    return p.layout.pp == 1


def calibration(hw: GPU | None = None, start: Efficiency = START) -> dict:
    """Fit on the paper's TP-only points; per point the published and predicted time,
    the error, and the leave-one-out error (the fit without that point; PP points are
    never in the fit, so theirs is their plain error); whether the plans' order
    matches the paper's at each size and architecture."""
    hw = hw or gpu(PAPER_GPU)
    pts = paper_points()
    fitted = [p for p in pts if in_fit(p)]
    eff = fit(fitted, hw, start)
    pred = predict(pts, hw, eff)
    rows = []
    for p, y in zip(pts, pred):
        if in_fit(p):
            e_loo = fit([q for q in fitted if q is not p], hw, eff)
            loo = predict([p], hw, e_loo)[0]
        else:
            loo = y
        rows.append(
            dict(
                point=p.label,
                group=p.group,
                plan=p.layout.plan,
                fitted=in_fit(p),
                published_s=p.published_s,
                predicted_s=y,
                error=(y - p.published_s) / p.published_s,
                loo_predicted_s=loo,
                loo_error=(loo - p.published_s) / p.published_s,
            )
        )
    order_ok = {}
    for grp in dict.fromkeys(r["group"] for r in rows):
        rs = [r for r in rows if r["group"] == grp]
        pub = [r["plan"] for r in sorted(rs, key=lambda r: r["published_s"])]
        mod = [r["plan"] for r in sorted(rs, key=lambda r: r["predicted_s"])]
        loo = [r["plan"] for r in sorted(rs, key=lambda r: r["loo_predicted_s"])]
        order_ok[grp] = dict(paper=pub, model=mod, loo=loo, ok=pub == mod and pub == loo)
    return dict(gpu=hw.name, efficiency=asdict(eff), rows=rows, order=order_ok, note=PAPER_NOTE)


def format_calibration(cal: dict) -> str:
    e = cal["efficiency"]
    lines = [
        f"fit on the paper's TP-only points ({cal['gpu']}): e_gemm {e['gemm']:.3f}  "
        f"e_hbm {e['hbm']:.3f}  e_link {e['link']:.3f}  (alpha {e['alpha_s'] * 1e6:g} us, fixed)",
        f"{cal['note']}",
        f"{'point':34s} {'fit':>4s} {'paper s':>8s} {'model s':>8s} {'error':>7s} "
        f"{'LOO s':>7s} {'LOO err':>8s}",
    ]
    for r in cal["rows"]:
        lines.append(
            f"{r['point']:34s} {'yes' if r['fitted'] else 'no':>4s} {r['published_s']:8.2f} "
            f"{r['predicted_s']:8.2f} {r['error']:+7.1%} {r['loo_predicted_s']:7.2f} "
            f"{r['loo_error']:+8.1%}"
        )
    fitted = [abs(r["error"]) for r in cal["rows"] if r["fitted"]]
    loo = [abs(r["loo_error"]) for r in cal["rows"] if r["fitted"]]
    lines.append(
        f"mean |error| fitted points {sum(fitted) / len(fitted):.1%}, leave-one-out "
        f"{sum(loo) / len(loo):.1%}"
    )
    for grp, o in cal["order"].items():
        lines.append(
            f"order {grp:10s} paper {' < '.join(o['paper'])}; model {' < '.join(o['model'])}"
            f"{'' if o['model'] == o['loo'] else '; LOO ' + ' < '.join(o['loo'])}: "
            f"{'same' if o['ok'] else 'DIFFERENT'}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------ refit on gpu_check.json


def calibrate_from_gpu_check(path: str, start: Efficiency = START) -> tuple[GPU, Efficiency, str]:
    """Refit e_gemm and e_hbm on this project's own GPU measurements
    (``boost-titan gpu-check``'s JSON): its ``gemm`` section's per-plan
    per-GEMM TFLOP/s (7B/TP4 shapes on one GPU), the GPU named in ``versions.gpus``.
    One GPU has no link: e_link keeps its paper fit. Returns the GPU, the refitted
    efficiency and a report."""
    import numpy as np

    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--calibrate {path}: no such file (run boost-titan gpu-check)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"--calibrate {path}: not JSON ({e})") from None
    gemm = data.get("gemm")
    if not isinstance(gemm, dict) or "plans" not in gemm:
        raise ValueError(
            f"--calibrate {path}: no 'gemm' section with 'plans' (gpu_check's GEMM rates)"
        )
    names = data.get("versions", {}).get("gpus") or []
    hw = _gpu_from_name(names[0] if names else "", path)
    rows = [
        (g["m"], g["k"], g["n"], g["tflops"] * 1e12)
        for plan in gemm["plans"].values()
        for g in plan["gemms"]
    ]
    if not rows:
        raise ValueError(f"--calibrate {path}: the 'gemm' section has no GEMMs")

    def loss(x):
        g, h = 1 / (1 + np.exp(-np.asarray(x)))
        e = replace(start, gemm=float(g), hbm=float(h))
        err = [2 * m * k * n / gemm_time(m, k, n, hw, e) / rate - 1 for m, k, n, rate in rows]
        return float(np.sum(np.square(err)))

    logit = lambda v: math.log(v / (1 - v))  # noqa: E731
    x = _nelder_mead(loss, np.array([logit(start.gemm), logit(start.hbm)]))
    g, h = (1 / (1 + np.exp(-x))).tolist()
    eff = replace(start, gemm=g, hbm=h)
    lines = [
        f"refit on {path} ({names[0] if names else '?'} -> {hw.name}): e_gemm {g:.3f} e_hbm {h:.3f}"
    ]
    lines.append(
        f"{'m':>7s} {'k':>6s} {'n':>6s} {'measured TF/s':>14s} {'model TF/s':>11s} {'error':>7s}"
    )
    for m, k, n, rate in rows:
        model = 2 * m * k * n / gemm_time(m, k, n, hw, eff)
        lines.append(
            f"{m:7d} {k:6d} {n:6d} {rate / 1e12:14.1f} {model / 1e12:11.1f} "
            f"{model / rate - 1:+7.1%}"
        )
    return hw, eff, "\n".join(lines)


def _gpu_from_name(name: str, path: str) -> GPU:
    """torch.cuda.get_device_name -> the table's entry."""
    n = name.upper()
    if "H200" in n:
        return gpu("h200")
    if "H100" in n:
        return gpu("h100-80")
    if "A100" in n:
        return gpu("a100-80" if "80" in n else "a100-40")
    raise ValueError(
        f"--calibrate {path}: GPU {name!r} (versions.gpus) is not in the hardware table "
        "(A100, H100, H200); add --gpu-file for it"
    )


def default_efficiency(gpu_check: str | None = None) -> tuple[Efficiency, str]:
    """The paper's A100 fit (refitted on ``gpu_check`` when given)."""
    cal = calibration()
    eff = Efficiency(**cal["efficiency"])
    if gpu_check:
        _, eff, report = calibrate_from_gpu_check(gpu_check, eff)
        return eff, report
    return eff, "efficiency: the paper's A100 fit (boost-titan step-time --paper)"
