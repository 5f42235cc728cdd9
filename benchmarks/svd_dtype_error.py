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
(std 0.02, as LLaMA initialises). Then (``--logits``) the whole model: random 2-block
Llama 2 folders of ``transformers`` (as tests/test_from_dense_families.py makes them:
norms off 1, q/k scaled 8x) at widths 128 to 1024, converted at full rank per SVD dtype,
their logits against ``transformers``' own. Writes the JSON and prints a table.
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


def logits_errors(widths=(128, 256, 512, 1024)) -> list[dict]:
    import tempfile
    from dataclasses import replace

    import transformers

    from boost_titan.checkpoint.from_dense.convert import Converter, Options
    from boost_titan.checkpoint.from_dense.source import HFSource
    from boost_titan.models.model import Transformer

    rows = []
    for width in widths:
        folder = Path(tempfile.mkdtemp()) / f"llama2_{width}"
        cfg = transformers.LlamaConfig(
            vocab_size=512, hidden_size=width, intermediate_size=width * 43 // 16,
            num_hidden_layers=2, num_attention_heads=width // 32,
            num_key_value_heads=width // 32, rms_norm_eps=1e-5, max_position_embeddings=256,
        )  # fmt: skip
        torch.manual_seed(0)
        hf = transformers.LlamaForCausalLM(cfg)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "norm" in name:
                    p.normal_(1.0, 0.1)
                if "q_proj" in name or "k_proj" in name:
                    p.mul_(8.0)
        hf.save_pretrained(folder)
        ids = torch.randint(0, 512, (2, 48), generator=torch.Generator().manual_seed(3))
        with torch.no_grad():
            want = hf.float().eval()(ids).logits
        source = HFSource(folder)
        a = source.args
        target = replace(a, arch="svd", rank=a.dim, kv_rank=a.kv_dim, max_seq_len=48)
        for dtype in (torch.float64, torch.float32):
            model = Transformer(target)
            state = Converter(source, target, Options(svd_dtype=dtype)).state_dict()
            model.load_state_dict(state, strict=True)
            with torch.no_grad():
                got = model.eval()(ids)
            err = float((got - want).norm() / want.norm())
            rows.append({"width": width, "svd_dtype": str(dtype)[6:], "logits_rel_err": err})
            print(rows[-1], flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="benchmarks/results_from_dense/svd_dtype_error.json")
    p.add_argument("--logits", action="store_true", help="the whole models' logits too")
    p.add_argument("--no-blocks", action="store_true", help="skip the per-matrix errors")
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    rows = []
    for out_f, in_f in [] if o.no_blocks else SHAPES:
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
    result = json.loads(Path(o.out).read_text()) if o.no_blocks else {"threads": o.threads}
    if rows:
        result["rows"] = rows
    if o.logits:
        result["logits"] = logits_errors()
    Path(o.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{'shape':>14} {'svd dtype':>9} {'||W-BA||/||W||':>15} {'output':>9} {'cpu s':>7}")
    for r in result.get("rows", []):
        shape = "x".join(map(str, r["shape"]))
        print(f"{shape:>14} {r['svd_dtype']:>9} {r['weight_rel_err']:>15.2e} "
              f"{r['output_rel_err']:>9.2e} {r['svd_cpu_s']:>7.1f}")  # fmt: skip


if __name__ == "__main__":
    main()
