"""The command ``from-dense`` prints, run as printed: does the converted model end below
its conversion on held-out text?

    PYTHONPATH=. .venv/bin/python benchmarks/from_dense_continue.py [--dense STEP_DIR] \\
        [--train-steps 200] [--threads 1] [--out outputs/from_dense_continue]

Without ``--dense`` it first trains the dense ``llama2`` debug model
(train_configs/debug_llama2.toml through ``run_train.sh``, one process, a full last
checkpoint: its data position records the run's ``dataset_seed``). Then it converts the
step to CoLA (train_configs/debug_cola.toml, the defaults: rank 64, fitted), takes the
last line ``from-dense`` prints and runs it in a shell as printed (``OMP_NUM_THREADS`` is
the only thing added, the environment's thread count), and scores the dense step, the
converted step and the run's last step on the whole validation split (the tokenized
``boost_corpus_val``, windows of 256 + 1 tokens; fp32, nats/token). Writes
``results.json`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from from_dense_loss import load, val_loss  # noqa: E402


def _env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(threads)}


def train_dense(out: Path, steps: int, threads: int) -> Path:
    dump = out / "dense"
    cmd = [
        "./run_train.sh", "--job.dump_folder", str(dump), "--checkpoint.enable",
        "--checkpoint.interval", str(steps), "--training.steps", str(steps),
        "--validation.freq", str(steps), "--metrics.no-enable-tensorboard",
    ]  # fmt: skip
    env = {**_env(threads), "CONFIG_FILE": "train_configs/debug_llama2.toml", "NGPU": "1"}
    with open(out / "dense_train.log", "w") as f:
        subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, check=True)
    return dump / "checkpoint" / f"step-{steps}"


def validation_windows() -> torch.Tensor:
    """The whole tokenized validation split, in windows of 257 tokens (the tokenized
    copies of it, one per path the split was reached through, hold the same part)."""
    root = REPO / "data" / "boost_corpus" / "tokenized"
    found = [
        json.loads(p.read_text()) | {"folder": p.parent} for p in sorted(root.glob("*/corpus.json"))
    ]
    copies = [c for c in found if c["source"]["path"].endswith("boost_corpus/validation")]
    assert copies and len({c["parts"][0]["digest"] for c in copies}) == 1, copies
    part = copies[0]["folder"] / "part-00000.bin"
    ids = torch.from_numpy(np.fromfile(part, dtype=np.uint16).astype(np.int64))
    n = ids.numel() // 257
    return ids[: n * 257].view(n, 257)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dense", help="a llama2 debugmodel DCP step folder (default: train one)")
    p.add_argument("--train-steps", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(REPO / "outputs" / "from_dense_continue"))
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    out = Path(o.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    dense_dir = Path(o.dense).resolve() if o.dense else train_dense(out, o.train_steps, o.threads)
    step = out / "cola" / "step-0"
    convert = [
        sys.executable, "-m", "boost_titan.cli", "checkpoint", "from-dense",
        "--job.config_file", "train_configs/debug_cola.toml", "--from", str(dense_dir),
        "--to", str(step), "--threads", str(o.threads), "--no-progress",
    ]  # fmt: skip
    proc = subprocess.run(convert, cwd=REPO, env=_env(o.threads), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"conversion failed:\n{proc.stderr[-3000:]}")
    printed = proc.stdout.rstrip().splitlines()[-1].strip()
    print(f"running as printed: {printed}", flush=True)
    with open(out / "continue_train.log", "w") as f:
        subprocess.run(
            ["bash", "-c", printed], cwd=REPO, env=_env(o.threads), stdout=f,
            stderr=subprocess.STDOUT, check=True,
        )  # fmt: skip
    last = max(Path(f"{step}-train", "checkpoint").glob("step-*"), key=lambda s: int(s.name[5:]))

    from boost_titan.checkpoint import integrity, safe_metadata
    from boost_titan.models.flavors import flavors_for
    from boost_titan.models.recorded import read_model_args, record_path

    safe_metadata.install()
    integrity.install()
    val = validation_windows()
    converted = replace(read_model_args(record_path(step)), max_seq_len=256)
    dense = replace(flavors_for("dense")["debugmodel"], max_seq_len=256)
    rows = {
        "dense": val_loss(load(dense, dense_dir), val),
        "converted": val_loss(load(converted, step), val),
        f"printed command, {last.name}": val_loss(load(converted, last), val),
    }
    for k, v in rows.items():
        print(f"{k:<34} {v:.4f}")
    result = {
        "dense": str(dense_dir), "printed": printed,
        "validation_tokens": val.shape[0] * 256, "val_loss": rows,
    }  # fmt: skip
    (out / "results.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
