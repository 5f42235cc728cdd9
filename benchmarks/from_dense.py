"""Time and memory of ``boost-titan checkpoint from-dense`` at 1B, extrapolated to 7B.

    PYTHONPATH=. .venv/bin/python benchmarks/from_dense.py [--threads 1] [--fit-blocks 2] \\
        [--work outputs/bench_from_dense] [--keep]

1. Writes a dense LLaMA-2 1B (flavor ``1b``: d 2048, 24 blocks, f 5472, vocab 32000,
   1.28B parameters) as a Hugging Face ``LlamaForCausalLM`` folder, random weights
   (N(0, 0.02), bfloat16, 2.6 GB, sharded safetensors with an index), tensor by tensor;
   nothing is downloaded.
2. Converts it with the real command to ``svd_llama2`` 1b (rank 512, plain SVD: the
   whole model) and reports wall time, the command's peak RSS (``VmHWM`` of that
   process, from its JSON report) and seconds per block.
3. Times the activation-aware fit (``cola_llama2`` 1b, the default calibration of 16 x
   256 tokens and 20 L-BFGS iterations) on the first ``--fit-blocks`` blocks through the
   library (the same code, in this process), per block.
4. Extrapolates to LLaMA-2 7B (d 4096, 32 blocks, f 11008, rank 1024) per block by
   operation counts: an SVD of an m x n matrix costs ~ m n min(m, n) (x 8.0 per block
   from 1B to 7B), the fit and the calibration forward ~ tokens x r (in + out), resp.
   the block's parameters (x 4.0); memory beyond the interpreter's by a block's size
   (x 4.0).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SHARD_BYTES = 2 * 10**9


def write_hf_llama(args, folder: Path, dtype=torch.bfloat16) -> int:
    """A random dense LLaMA ``args`` as a sharded HF folder, one tensor in memory at a
    time. Returns its parameter count."""
    from safetensors.torch import save_file

    from boost_titan.checkpoint.hf.llama_format import LLAMA

    folder.mkdir(parents=True)
    config = {**LLAMA.config(args), "torch_dtype": "bfloat16", "bos_token_id": 0,
              "eos_token_id": 1}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    gen = torch.Generator().manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, n_params, weight_map, files = 0, 0, {}, []

    def flush():
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shards[-1], str(folder / name), metadata={"format": "pt"})
        for k in shards[-1]:
            weight_map[k] = name
        files.append(name)
        shards[-1] = {}

    for e in LLAMA.table(args):
        shape = e.hf_shape
        if len(shape) == 1:
            t = torch.ones(shape, dtype=dtype)
        else:
            t = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            flush()
            size = 0
        shards[-1][e.hf] = t
        size += nbytes
        n_params += t.numel()
    flush()
    index = {"metadata": {"total_size": 2 * n_params}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    tok = REPO / "data" / "boost_corpus" / "tokenizer"
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, folder / f)
    return n_params


def run_cli(src: Path, out: Path, config: str, threads: int, *extra: str) -> dict:
    cmd = [
        sys.executable, "-m", "boost_titan.cli", "checkpoint", "from-dense", "--job.config_file",
        str(REPO / "train_configs" / config), "--model.flavor", "1b", "--from", str(src),
        "--to", str(out), "--threads", str(threads), *extra,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"from-dense failed (rc {proc.returncode})")
    report = json.loads((out.parent / f"{out.name}.from_dense.json").read_text())
    report["wall_s"] = wall
    return report


def time_fit(src: Path, blocks: int, threads: int) -> list[float]:
    """Seconds per block of the fitted CoLA conversion, first ``blocks`` blocks."""
    from boost_titan.checkpoint.from_dense.convert import Converter, Options
    from boost_titan.checkpoint.from_dense.source import HFSource
    from boost_titan.data.calibration import calibration_tokens
    from boost_titan.models.flavors import flavors_for

    torch.set_num_threads(threads)
    source = HFSource(src)
    target = replace(flavors_for("cola")["1b"], max_seq_len=256)
    tokens = calibration_tokens(None, src, 16, 256, target.vocab_size)
    conv = Converter(source, target, Options(fit=True, heldout=2), tokens)
    for i in range(blocks):
        for name in [k for k in conv.shapes if k.startswith(f"layers.{i}.")]:
            conv.get(name)
    return [layer["seconds"] for layer in conv.report["layers"]]


def baseline_rss() -> float:
    """GiB: peak RSS of an interpreter that only imports what the command imports."""
    code = (
        "import boost_titan.checkpoint.export, boost_titan.train.config_check, "
        "boost_titan.cli.from_dense "
        "as c; print(c.peak_rss_gib())"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True,
                         text=True, check=True)  # fmt: skip
    return float(out.stdout.strip().splitlines()[-1])


def block_costs(args) -> tuple[float, float]:
    """(SVD cost, fit/forward cost) of one block, in operation-count units."""
    svd = sum(i * o * min(i, o) for i, o, _ in args.projection_shapes().values())
    fit = sum(r * (i + o) for i, o, r in args.projection_shapes().values())
    return svd, fit


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fit-blocks", type=int, default=2)
    p.add_argument("--work", default=str(REPO / "outputs" / "bench_from_dense"))
    p.add_argument("--keep", action="store_true", help="keep the 1B folders")
    o = p.parse_args()
    from boost_titan.models.flavors import flavors_for

    work = Path(o.work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    dense = flavors_for("dense")["1b"]
    t0 = time.perf_counter()
    n = write_hf_llama(dense, work / "llama2_1b_hf")
    t_write = time.perf_counter() - t0
    print(f"wrote a random 1B dense LLaMA ({n / 1e9:.2f}B params, bf16) in {t_write:.0f} s")
    from boost_titan.cli.from_dense import peak_rss_gib

    own_rss = peak_rss_gib()

    svd = run_cli(work / "llama2_1b_hf", work / "svd_1b" / "step-0", "debug_svd.toml", o.threads,
                  "--no-progress")  # fmt: skip
    per_block = [layer["seconds"] for layer in svd["layers"]]
    print(
        f"svd_llama2 1b, plain SVD (float64, {svd['threads']} thread(s)): {svd['wall_s']:.0f} s "
        f"wall ({svd['seconds']:.0f} s in the command), peak RSS {svd['peak_rss_gib']:.2f} GiB, "
        f"{sum(per_block) / len(per_block):.1f} s per block"
    )
    fit_blocks = time_fit(work / "llama2_1b_hf", o.fit_blocks, o.threads) if o.fit_blocks else []
    fit_per_block = sum(fit_blocks) / len(fit_blocks) if fit_blocks else 0.0
    if fit_blocks:
        print(f"cola_llama2 1b, fitted (16 x 256 tokens, 20 L-BFGS iterations): "
              f"{fit_per_block:.1f} s per block (blocks {fit_blocks})")  # fmt: skip

    seven = flavors_for("svd")["7b"]
    one = flavors_for("svd")["1b"]
    (svd7, fit7), (svd1, fit1) = block_costs(seven), block_costs(one)
    svd_ratio, fit_ratio = svd7 / svd1, fit7 / fit1
    t_svd_7b = seven.n_layers * (sum(per_block) / len(per_block)) * svd_ratio
    # the fitted block time holds the block's SVDs too: split them off
    t_fit_only = max(fit_per_block - sum(per_block) / len(per_block), 0.0)
    t_cola_7b = t_svd_7b + seven.n_layers * t_fit_only * fit_ratio
    base = baseline_rss()  # the interpreter with everything the command imports
    rss_7b = base + (svd["peak_rss_gib"] - base) * fit_ratio
    result = {
        "machine": f"{os.cpu_count()} CPU cores, shared with other jobs",
        "threads": o.threads,
        "write_1b_hf_s": round(t_write, 1),
        "svd_1b": {
            "wall_s": round(svd["wall_s"], 1),
            "command_s": svd["seconds"],
            "peak_rss_gib": svd["peak_rss_gib"],
            "s_per_block": per_block,
        },
        "cola_fit_1b_s_per_block": fit_blocks,
        "extrapolation_7b": {
            "svd_cost_ratio_per_block": round(svd_ratio, 2),
            "fit_cost_ratio_per_block": round(fit_ratio, 2),
            "svd_plain_s": round(t_svd_7b),
            "cola_fitted_s": round(t_cola_7b),
            "peak_rss_gib": round(rss_7b, 2),
        },
        "baseline_rss_gib": round(base, 3),
        "benchmark_process_peak_rss_gib": round(own_rss, 2),
    }
    print(json.dumps(result["extrapolation_7b"]))
    (work / "results.json").write_text(json.dumps(result, indent=1))
    print(f"results: {work / 'results.json'}")
    if not o.keep:
        for sub in ("llama2_1b_hf", "svd_1b"):
            shutil.rmtree(work / sub, ignore_errors=True)


if __name__ == "__main__":
    main()
