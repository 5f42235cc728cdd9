"""How far a full-rank conversion is from the dense weights, per SVD dtype and width.

    PYTHONPATH=. .venv/bin/python benchmarks/svd_dtype_error.py [--threads 1] \\
        [--out benchmarks/results_from_dense/svd_dtype_error.json]

At full rank ``B A`` equals ``W`` up to rounding: the SVD's (LAPACK's backward error
grows with the matrix' size times the dtype's epsilon) and the float32 the factors are
stored in. Per shape of the Llama widths (the debug model's 256 up to Llama-2-7B's
4096 x 4096 attention and 11008 x 4096 MLP projections), for ``--svd-dtype`` float64 and
float32 (``boost_titan.models.from_dense.svd_factors``, the conversion's own): the
relative Frobenius error ``||W - B A|| / ||W||`` and the relative error of one
projection's output ``||W x - B (A x)|| / ||W x||`` on random inputs. ``W`` is Gaussian
(std 0.02, as LLaMA initialises). Writes the JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from boost_titan.models.from_dense import svd_factors, weight_error

SHAPES = [(256, 256), (1024, 1024), (2048, 2048), (4096, 4096), (11008, 4096)]


def output_error(w: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> float:
    x = torch.randn(w.shape[1], 64, generator=torch.Generator().manual_seed(1))
    want = w.double() @ x.double()
    got = up.double() @ (down.double() @ x.double())
    return float((got - want).norm() / want.norm())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results_from_dense/svd_dtype_error.json")
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    rows = []
    for out_f, in_f in SHAPES:
        w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(0)) * 0.02
        for dtype in (torch.float64, torch.float32):
            t0 = time.process_time()
            f = svd_factors(w, min(out_f, in_f), dtype)
            cpu = time.process_time() - t0
            row = {
                "shape": [out_f, in_f],
                "svd_dtype": str(dtype).removeprefix("torch."),
                "weight_rel_err": weight_error(w, f.down, f.up),
                "output_rel_err": output_error(w, f.down, f.up),
                "svd_cpu_s": round(cpu, 2),
            }
            rows.append(row)
            print(row, flush=True)
    Path(o.out).write_text(json.dumps({"threads": o.threads, "rows": rows}, indent=1) + "\n")
    print(f"\n{'shape':>14} {'svd dtype':>9} {'||W-BA||/||W||':>15} {'output':>9} {'cpu s':>7}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        print(f"{shape:>14} {r['svd_dtype']:>9} {r['weight_rel_err']:>15.2e} "
              f"{r['output_rel_err']:>9.2e} {r['svd_cpu_s']:>7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
