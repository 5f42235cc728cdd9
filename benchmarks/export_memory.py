"""Peak RSS of ``boost-titan checkpoint export`` and of ``from-dense`` at Llama-3.2-1B's width.

    PYTHONPATH=. .venv/bin/python benchmarks/export_memory.py [--layers 16] \\
        [--convert-layers 4] [--baseline DIR] [--work outputs/bench_export_memory] [--keep]

1. Synthesizes an ``svd_llama2`` step at Llama-3.2-1B's shapes (d 2048, 32 heads, 8 kv
   heads, f 8192, vocabulary 128256, llama3 RoPE; rank 512, kv rank 256; ``--layers``
   blocks), random float32, written a tensor at a time with ``model_args.json``: what
   ``from-dense`` writes, without its SVDs (15+ minutes at 1B on a 2-core VM).
2. Exports it, ``--format hf`` and safetensors, each in a fresh interpreter; the peak RSS
   is that process' ``VmHWM``. With ``--baseline DIR`` the same commands run another
   tree's code too (e.g. ``git archive ec92d6c boost_titan | tar -x -C DIR``: before the
   export streamed).
3. ``--convert-layers N`` (0: skip): a random dense Hugging Face folder at the same width
   with N blocks (bfloat16), converted by the real ``from-dense`` (plain SVD, rank 512, kv
   rank 256), then exported: both commands' peaks on one model.

Results: ``benchmarks/results_export_memory/``; docs/from-dense.md, "Cost and memory".
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "train_configs" / "debug_svd.toml"
# the child: run the CLI as `python -m boost_titan.cli`, then print its own VmHWM
_CHILD = """
import runpy, sys
sys.path = [p for p in sys.path if p not in ("", ".")]  # the tree is PYTHONPATH's, not cwd's
sys.argv = ["boost-titan", *sys.argv[1:]]
rc = 0
try:
    runpy.run_module("boost_titan.cli", run_name="__main__", alter_sys=True)
except SystemExit as e:
    rc = e.code or 0
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0].split()[1]
print(f"VmHWM_KIB {hwm} RC {rc}")
"""


def llama32_1b(layers: int, arch: str = "svd"):
    from boost_titan.models.flavors import flavors_for

    base = flavors_for(arch)["debugmodel"]
    args = replace(
        base, dim=2048, n_layers=layers, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        vocab_size=128256, norm_eps=1e-5, rope_theta=500000.0, rope_scaling_factor=32.0,
        rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_positions=8192,
        max_positions=131072, max_seq_len=2048,
    )  # fmt: skip
    if arch != "dense":
        args = replace(args, rank=512, kv_rank=256)
    args.validate()
    return args


def synthesize(step: Path, layers: int) -> int:
    """The svd step, one random tensor in memory at a time. Returns its parameters."""
    import torch

    from boost_titan.checkpoint import integrity, safe_metadata
    from boost_titan.checkpoint.from_dense.source import model_shapes
    from boost_titan.checkpoint.from_dense.stream import write_lazily
    from boost_titan.models.recorded import write_model_args

    safe_metadata.install()
    integrity.install()  # sealed, as from-dense's steps are (their loads read in place)
    args = llama32_1b(layers)
    shapes = model_shapes(args)
    gen = torch.Generator().manual_seed(0)
    step.mkdir(parents=True)
    write_lazily(step, shapes, lambda k: torch.randn(shapes[k], generator=gen) * 0.02)
    write_model_args(step, args)
    return sum(torch.Size(s).numel() for s in shapes.values())


def run(tree: Path, *argv: str) -> dict:
    """One CLI command in a fresh interpreter importing ``tree``'s boost_titan."""
    env = {"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHILD, *argv], cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    wall = time.perf_counter() - t0
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    if not last.startswith("VmHWM_KIB") or not last.endswith("RC 0"):
        raise SystemExit(
            f"{argv[:2]} failed in {tree}:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}"
        )
    return {"peak_rss_gib": round(int(last.split()[1]) / 2**20, 3), "wall_s": round(wall, 1)}


def exports(tree: Path, step: Path, work: Path, tag: str) -> dict:
    out = {}
    for fmt, dst in (("hf", work / f"hf_{tag}"), ("safetensors", work / f"{tag}.safetensors")):
        out[fmt] = run(tree, "checkpoint", "export", "--format", fmt, "--job.config_file",
                       str(CONFIG), "--from", str(step), "--to", str(dst))  # fmt: skip
        shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        print(f"  export --format {fmt} ({tag}): {out[fmt]}", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--convert-layers", type=int, default=4)
    p.add_argument("--baseline", type=Path, help="another tree's root (holding boost_titan/)")
    p.add_argument("--work", type=Path, default=REPO / "outputs" / "bench_export_memory")
    p.add_argument("--keep", action="store_true")
    o = p.parse_args()
    if o.work.exists():
        shutil.rmtree(o.work)
    o.work.mkdir(parents=True)
    trees = {"streamed": REPO, **({"whole_model": o.baseline} if o.baseline else {})}
    result: dict = {"shapes": "Llama-3.2-1B width, svd_llama2 rank 512 / kv 256, float32"}
    try:
        step = o.work / "svd" / "step-0"
        params = synthesize(step, o.layers)
        print(f"synthesized {o.layers} blocks, {params / 1e9:.3f}B parameters", flush=True)
        result["synthesized"] = {"layers": o.layers, "params": params}
        for tag, tree in trees.items():
            result["synthesized"][tag] = exports(tree, step, o.work, tag)
        if o.convert_layers:
            sys.path.insert(0, str(REPO / "benchmarks"))
            from from_dense import write_hf_llama

            src = o.work / "dense_hf"
            n = write_hf_llama(llama32_1b(o.convert_layers, "dense"), src)
            converted = o.work / "converted" / "step-0"
            conv = run(REPO, "checkpoint", "from-dense", "--job.config_file", str(CONFIG),
                       "--model.flavor", str(src), "--from", str(src), "--to", str(converted),
                       "--rank", "512", "--kv-rank", "256", "--threads", "1",
                       "--no-progress")  # fmt: skip
            print(f"  from-dense ({o.convert_layers} blocks): {conv}", flush=True)
            result["converted"] = {"layers": o.convert_layers, "dense_params": n,
                                   "from_dense": conv}  # fmt: skip
            for tag, tree in trees.items():
                result["converted"][tag] = exports(tree, converted, o.work, tag)
    finally:
        if not o.keep:
            shutil.rmtree(o.work, ignore_errors=True)
    out = REPO / "benchmarks" / "results_export_memory" / "export_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
