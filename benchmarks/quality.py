"""The quality picture: how the low-rank models train against their dense twin, from
scratch and converted from the trained dense model (``checkpoint from-dense``).

    PYTHONPATH=. .venv/bin/python benchmarks/quality.py [--steps 600] [--workers 2] \\
        [--out outputs/quality] [--flavor debugmodel] [--ranks 32 64] [--reuse]

Every run is the real trainer (``python -m torch.distributed.run --nproc-per-node 1 -m
boost_titan.train``, one process, ``OMP_NUM_THREADS=1``, ``--workers`` runs side by side)
on the embedded corpus with the debug configs' recipe (local batch 4 x 256 tokens, AdamW
lr 3e-3, 4 warmup steps then linear decay to 0 over the run, seed 42), validated every
``--val-freq`` steps on the same ``--val-steps`` x 4 x 256 tokens of the validation split:

(a) dense ``llama2``, ``--steps`` steps, seeds 42 and 43 (the seed sets the initial
    weights; the data order is the corpus' one global order, the same for every run);
(b) ``svd_llama2``, ``cola_llama2``, ``lax_llama2`` and ``svd_llama2`` + LORO from random
    weights at the flavor's rank, ``--steps`` steps (CoLA at seeds 42 and 43 too);
(c) the dense seed-42 run's step ``--steps``/2 converted (the default fit: plain SVD for
    SVD, activation-aware for CoLA and LaX) to each low-rank model at each of ``--ranks``,
    then trained the other half of the token budget with the settings ``from-dense``
    recommends for training on (``boost_titan.checkpoint.from_dense.continue_training``: lr
    the config's / 3, 20 warmup steps, then linear decay to 0; the optimizer state starts
    afresh); LORO from the converted SVD model.

Training FLOPs are the models' own count (``LlamaArgs.flops_per_token``: 6 x the GEMMs
they run, plus attention), times the tokens trained; a converted run carries the dense
FLOPs of its first half. Writes ``results.json`` (curves, FLOPs per token, wall times,
commands) and ``quality.png`` into ``--out``; with ``--png`` also there. Every run's
TensorBoard events are in ``OUT/<run>/tb``: ``tensorboard --logdir OUT`` shows them all.
"""

from __future__ import annotations

import argparse
import concurrent.futures as futures
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from boost_titan.checkpoint.from_dense.continue_training import CONTINUE_WARMUP, continue_lr

REPO = Path(__file__).resolve().parents[1]
SEEDS = (42, 43)
_VAL = re.compile(r"validate step:\s*(\d+)\s+loss:\s*([0-9.]+)")
_TRAIN = re.compile(r"\bstep:\s*(\d+)\s+loss:\s*([0-9.]+)")


@dataclass
class Run:
    name: str
    model: str  # llama2, svd, cola, lax, loro
    config: str
    steps: int
    seed: int = SEEDS[0]
    rank: int | None = None  # None: the flavor's
    init: str | None = None  # a converted DCP step the run starts from
    group: str = "scratch"  # dense, scratch, converted
    extra: list[str] = field(default_factory=list)


CONFIGS = {
    "llama2": "debug_llama2.toml",
    "svd": "debug_svd.toml",
    "cola": "debug_cola.toml",
    "lax": "debug_lax.toml",
    "loro": "debug_svd_loro.toml",
}
# the model a conversion writes for each run model (LORO trains the converted SVD model)
CONVERTS_TO = {"svd": "svd", "cola": "cola", "lax": "lax", "loro": "svd"}


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def train_cmd(run: Run, o, dump: Path) -> list[str]:
    cmd = [
        "-m", "torch.distributed.run", "--nproc-per-node", "1", "-m", "boost_titan.train",
        "--job.config_file", f"train_configs/{run.config}", "--job.dump_folder", str(dump),
        # a converted step records its model (the dense eps, ranks): the run names it
        "--model.flavor", run.init or o.flavor, "--training.steps", str(run.steps),
        "--debug.seed", str(run.seed), "--validation.freq", str(o.val_freq),
        "--validation.steps", str(o.val_steps), "--metrics.disable_color_printing",
        "--boost.profile_freq", "0",
    ]  # fmt: skip
    if run.rank is not None and run.init is None:
        cmd += ["--boost.rank", str(run.rank)]
    if run.model == "llama2" and run.seed == SEEDS[0]:  # the step the conversions start from
        cmd += ["--checkpoint.enable", "--checkpoint.interval", str(o.steps // 2)]
        cmd += ["--checkpoint.keep_latest_k", "0"]
    if run.init is not None:
        cmd += ["--optimizer.lr", f"{continue_lr(_config_lr()):.6g}"]
        cmd += ["--lr_scheduler.warmup_steps", str(CONTINUE_WARMUP)]
        cmd += ["--checkpoint.enable", "--checkpoint.initial_load_path", run.init]
        cmd += ["--checkpoint.interval", str(run.steps), "--checkpoint.last_save_model_only"]
    return cmd + run.extra


def _config_lr() -> float:
    """The debug configs' learning rate (train_configs/base/debug.toml)."""
    import tomllib

    base = tomllib.loads((REPO / "train_configs" / "base" / "debug.toml").read_text())
    return base["optimizer"]["lr"]


def curves(log: str) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    val = [(int(s), float(v)) for s, v in _VAL.findall(log)]
    train = [(int(s), float(v)) for s, v in _TRAIN.findall(log) if "validate" not in s]
    return val, train


def train(run: Run, o) -> dict:
    out = Path(o.out)
    done = out / run.name / "result.json"
    if o.reuse and done.exists():
        return json.loads(done.read_text())
    dump = out / run.name
    shutil.rmtree(dump, ignore_errors=True)
    dump.mkdir(parents=True)
    cmd = train_cmd(run, o, dump)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, *cmd], cwd=REPO, env=_env(), capture_output=True, text=True
    )
    wall = time.perf_counter() - t0
    (dump / "train.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        log = dump / "train.log"
        raise SystemExit(f"run {run.name} failed (log: {log}):\n{proc.stderr[-3000:]}")
    val, _ = curves(proc.stdout + proc.stderr)
    result = {
        "name": run.name,
        "model": run.model,
        "group": run.group,
        "seed": run.seed,
        "rank": run.rank,
        "steps": run.steps,
        "init": run.init,
        "val": val,
        "wall_s": round(wall, 1),
        "command": "python " + " ".join(cmd),
    }
    done.write_text(json.dumps(result))
    print(f"{run.name}: {run.steps} steps in {wall:.0f} s, val loss {val[-1][1]:.4f}", flush=True)
    return result


def convert(model: str, rank: int, dense_step: Path, o) -> dict:
    out = Path(o.out) / "converted" / f"{model}_r{rank}"
    step = out / "step-0"
    report_path = out / "step-0.from_dense.json"
    if o.reuse and report_path.exists():
        return {"step": str(step), "report": json.loads(report_path.read_text())}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [
        sys.executable, "-m", "boost_titan.cli", "checkpoint", "from-dense",
        "--job.config_file", f"train_configs/{CONFIGS[model]}", "--model.flavor", o.flavor,
        "--from", str(dense_step), "--to", str(step), "--rank", str(rank),
        "--threads", "1", "--no-progress",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"conversion {model} r{rank} failed:\n{proc.stderr[-3000:]}")
    report = json.loads(report_path.read_text())
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    report_path.write_text(json.dumps(report))
    print(f"converted {model} r{rank} in {report['wall_s']} s", flush=True)
    return {"step": str(step), "report": report}


def flops_per_token(model: str, flavor: str, rank: int | None, seq_len: int) -> int:
    from boost_titan.models.flavors import flavors_for

    arch = {"llama2": "dense", "loro": "svd"}.get(model, model)
    args = flavors_for(arch)[flavor]
    if rank is not None:
        args = replace(args, rank=rank)
    return args.flops_per_token(seq_len)


def plan(o) -> tuple[list[Run], list[Run], list[Run]]:
    dense = [Run(f"llama2_s{s}", "llama2", CONFIGS["llama2"], o.steps, s, group="dense")
             for s in SEEDS]  # fmt: skip
    scratch = [
        Run(f"{m}_scratch_s42", m, CONFIGS[m], o.steps) for m in ("svd", "cola", "lax", "loro")
    ]
    scratch.append(Run("cola_scratch_s43", "cola", CONFIGS["cola"], o.steps, SEEDS[1]))
    converted = [
        Run(f"{m}_from_dense_r{r}", m, CONFIGS[m], o.steps // 2, rank=r, group="converted")
        for r in o.ranks
        for m in ("svd", "cola", "lax", "loro")
    ]
    return dense, scratch, converted


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600, help="the token budget in steps")
    p.add_argument("--flavor", default="debugmodel")
    p.add_argument("--ranks", type=int, nargs=2, default=[32, 64])
    p.add_argument("--val-freq", type=int, default=50)
    p.add_argument("--val-steps", type=int, default=8)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--out", default=str(REPO / "outputs" / "quality"))
    p.add_argument("--png", help="also write the plot here (e.g. docs/quality.png)")
    p.add_argument("--reuse", action="store_true", help="keep runs that finished before")
    o = p.parse_args()
    if o.steps % 2 or o.steps // 2 % o.val_freq:
        raise SystemExit(f"--steps {o.steps}: need an even number whose half --val-freq divides")
    out = Path(o.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    dense, scratch, converted = plan(o)
    results: dict[str, dict] = {}
    with futures.ThreadPoolExecutor(o.workers) as pool:
        first = {pool.submit(train, r, o): r for r in dense}
        # the from-scratch runs need no dense step: they fill the pool while it trains
        rest = {pool.submit(train, r, o): r for r in scratch}
        results.update({first[f].name: f.result() for f in futures.as_completed(first)})
        dense_step = out / "llama2_s42" / "checkpoint" / f"step-{o.steps // 2}"
        conversions = {
            (m, r): pool.submit(convert, m, r, dense_step, o)
            for r in o.ranks
            for m in ("svd", "cola", "lax")
        }
        done = {k: f.result() for k, f in conversions.items()}
        for run in converted:
            run.init = done[(CONVERTS_TO[run.model], run.rank)]["step"]
            rest[pool.submit(train, run, o)] = run
        results.update({rest[f].name: f.result() for f in futures.as_completed(rest)})
    seq_len = 256
    tokens_per_step = 4 * seq_len
    for r in [*dense, *scratch, *converted]:
        res = results[r.name]
        res["flops_per_token"] = flops_per_token(r.model, o.flavor, r.rank, seq_len)
        res["tokens_per_step"] = tokens_per_step
    conv = {
        f"{m}_r{r}": {k: v for k, v in d["report"].items() if k in ("wall_s", "peak_rss_gib")}
        for (m, r), d in done.items()
    }
    summary = {
        "machine": f"{os.cpu_count()} CPU cores, {o.workers} runs side by side, 1 thread each",
        "steps": o.steps,
        "flavor": o.flavor,
        "ranks": o.ranks,
        "seeds": list(SEEDS),
        "val_tokens": o.val_steps * tokens_per_step,
        "total_wall_s": round(time.perf_counter() - t0, 1),
        "conversions": conv,
        "runs": [results[r.name] for r in [*dense, *scratch, *converted]],
    }
    (out / "results.json").write_text(json.dumps(summary, indent=1))
    from quality_plot import plot, table  # benchmarks/quality_plot.py

    for png in filter(None, [out / "quality.png", o.png]):
        plot(summary, Path(png))
    print(table(summary))
    print(f"total {summary['total_wall_s']:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
