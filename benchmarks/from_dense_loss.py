"""What converting a trained dense model costs in validation loss, before any training:
plain SVD against the activation-aware fit, for SVD, CoLA and LaX (``from-dense``).

    PYTHONPATH=. .venv/bin/python benchmarks/from_dense_loss.py [--dense STEP_DIR] \\
        [--train-steps 600] [--rank 64] [--threads 1] [--out outputs/from_dense_loss]

Without ``--dense`` it first trains the dense ``llama2`` debug model (train_configs/
debug_llama2.toml, one process, ``--train-steps`` steps) and converts its last
checkpoint. Every conversion runs the real command (``boost-titan checkpoint
from-dense``, the default calibration: 16 x 256 tokens of the corpus' train split); the
loss is the mean next-token cross-entropy (nats) of each model on the same validation
sequences (the corpus' validation split, 32 x 256 tokens), in fp32, one process. The
dense model is scored twice: as trained, and with the low-rank flavors' RMSNorm eps
(1e-6 instead of 1e-5), which every converted model inherits. Writes ``results.json``
in ``--out``."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}


def train_dense(out: Path, steps: int, threads: int) -> Path:
    dump = out / "dense"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1",
        "-m", "boost_titan.train", "--job.config_file",
        str(REPO / "train_configs" / "debug_llama2.toml"), "--job.dump_folder", str(dump),
        "--checkpoint.enable", "--checkpoint.interval", str(steps),
        "--checkpoint.last_save_model_only", "--training.steps", str(steps),
        "--validation.freq", str(steps), "--metrics.no-enable-tensorboard",
        "--metrics.disable_color_printing",
    ]  # fmt: skip
    log = out / "dense_train.log"
    with open(log, "w") as f:
        subprocess.run(
            cmd, cwd=REPO, env=_env(threads), stdout=f, stderr=subprocess.STDOUT, check=True
        )
    return dump / "checkpoint" / f"step-{steps}"


def load(args, step_dir: Path):
    import torch.distributed.checkpoint as dcp

    from boost_titan.models.model import Transformer

    m = Transformer(args)
    state = {k: torch.zeros(v.shape) for k, v in m.state_dict().items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    m.load_state_dict(state, strict=True)
    with torch.device("cpu"):
        m.freqs_cis = m._precompute_freqs_cis()
    return m.eval()


@torch.no_grad()
def val_loss(model, tokens: torch.Tensor, batch: int = 8) -> float:
    total, count = 0.0, 0
    for s in range(0, tokens.shape[0], batch):
        t = tokens[s : s + batch]
        logits = model(t[:, :-1])
        total += float(F.cross_entropy(logits.flatten(0, 1), t[:, 1:].flatten(), reduction="sum"))
        count += t[:, 1:].numel()
    return total / count


def convert(src: Path, out: Path, config: str, rank: int, fit: str, threads: int) -> dict:
    cmd = [
        sys.executable, "-m", "boost_titan.cli", "checkpoint", "from-dense",
        "--job.config_file", str(REPO / "train_configs" / config), "--from", str(src),
        "--to", str(out), "--rank", str(rank), "--fit", fit, "--threads", str(threads),
        "--no-progress",
    ]  # fmt: skip
    if fit == "none":
        cmd += ["--calib-sequences", "16"]  # the plain factors' activation errors too
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(threads), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"conversion failed:\n{proc.stderr[-3000:]}")
    report = json.loads((out.parent / f"{out.name}.from_dense.json").read_text())
    report["wall_s"] = round(time.perf_counter() - t0, 2)
    return report


def _mean(report: dict, key: str) -> float | None:
    vals = [p[key] for layer in report["layers"] for p in layer["projections"].values() if key in p]
    return sum(vals) / len(vals) if vals else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", help="a llama2 debugmodel DCP step folder (default: train one)")
    p.add_argument("--train-steps", type=int, default=600)
    p.add_argument("--rank", type=int, default=64, help="debugmodel's flavor rank: d/4")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "outputs" / "from_dense_loss"))
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    dense_dir = Path(o.dense) if o.dense else train_dense(out, o.train_steps, o.threads)

    from boost_titan.checkpoint import integrity, safe_metadata
    from boost_titan.data.calibration import calibration_tokens, default_corpus
    from boost_titan.models.flavors import flavors_for

    safe_metadata.install()
    integrity.install()
    val = calibration_tokens(
        str(default_corpus().parent / "validation"),
        default_corpus().parent / "tokenizer",
        32,
        257,
        8192,
        seed=1,
    )
    dense_args = replace(flavors_for("dense")["debugmodel"], max_seq_len=256)
    dense = load(dense_args, dense_dir)
    rows = [{"model": "llama2 (dense, as trained)", "val_loss": val_loss(dense, val)}]
    dense.norm.eps = 1e-6
    for layer in dense.layers.values():
        layer.attention_norm.eps = layer.ffn_norm.eps = 1e-6
    rows.append({"model": "llama2, RMSNorm eps 1e-6", "val_loss": val_loss(dense, val)})
    for arch, config in (("svd", "debug_svd.toml"), ("cola", "debug_cola.toml"),
                         ("lax", "debug_lax.toml")):  # fmt: skip
        for fit in ("none", "activations"):
            step = out / f"{arch}_{fit}" / "step-0"
            if step.exists():
                import shutil

                shutil.rmtree(step.parent)
            report = convert(dense_dir, step, config, o.rank, fit, o.threads)
            args = replace(flavors_for(arch)["debugmodel"], max_seq_len=256, rank=o.rank)
            how = "fitted" if fit != "none" else "plain SVD"
            rows.append(
                {
                    "model": f"{arch}_llama2 r{o.rank} {how}",
                    "val_loss": val_loss(load(args, step), val),
                    "act_err_calib": _mean(report, "act_fitted" if fit != "none" else "act_plain"),
                    "act_err_heldout": _mean(
                        report, "heldout_fitted" if fit != "none" else "heldout_plain"
                    ),
                    "svd_rel_err": _mean(report, "svd_rel_err"),
                    "convert_s": report["wall_s"],
                }
            )
            print(rows[-1], flush=True)
    print(f"\nvalidation loss (nats/token, {val.shape[0]} x {val.shape[1] - 1} tokens) of "
          f"{dense_dir}, converted at rank {o.rank}, before any training:")  # fmt: skip
    print(f"{'model':<34} {'val loss':>9} {'act err calib':>14} {'held-out':>9} {'s':>6}")
    for r in rows:
        calib, held = r.get("act_err_calib"), r.get("act_err_heldout")
        print(
            f"{r['model']:<34} {r['val_loss']:>9.4f} "
            f"{'' if calib is None else f'{calib:.3f}':>14} "
            f"{'' if held is None else f'{held:.3f}':>9} {r.get('convert_s', ''):>6}"
        )
    (out / "results.json").write_text(json.dumps({"dense": str(dense_dir), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
