"""The trainer end to end on one device (``trainer``): ``NGPU=1 ./run_train.sh`` on the
one-process CoLA debug config, compiled, with the step profiler, for a few steps; one
injected NaN loss exercises the step guard (``[boost] nan_policy = "skip"``: that
update is skipped and the run goes on). Checked from the log: a metrics line (loss,
memory, tokens/s, MFU) for every step, the guard's skip, a profiled-step line for
every profiled step, the compile line, exit status 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from boost_titan.perf.gpu_check.common import Sizes

CONFIG = "train_configs/debug_cola.toml"
GUARD_STEP = 3  # BOOST_TITAN_INJECT=nan_loss@3: the step guard must skip this update
REPO = Path(__file__).resolve().parents[3]  # the checkout: train_configs/ and run_train.sh
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_STEP = re.compile(
    r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)\s+grad_norm:\s*([-\d.naninf]+)"
    r"\s+memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)\s+tflops:\s*([\d.]+)\s+mfu:\s*([\d.]+)%"
)
_PROFILE = re.compile(r"profile step (\d+): (\d+) ms = forward (\d+) .*?\+ backward (\d+)")
_SKIP = re.compile(rf"step {GUARD_STEP}: non-finite loss or gradients; update skipped")


def profiled_steps(steps: int, freq: int) -> list[int]:
    """The steps the step profiler samples (``step_profile.StepProfiler.wants``)."""
    return [s for s in range(2, steps + 1) if s == 2 or s % freq == 0]


def trainer(sizes: Sizes, backend: str, out: Path, timeout: float = 1200) -> dict:
    from boost_titan.data.corpus.manifest import default_corpus_dir

    corpus = default_corpus_dir()
    if not (corpus / "manifest.json").exists():
        raise RuntimeError(
            f"the embedded corpus is missing ({corpus}): build it first with `make data` "
            "(boost-titan data build)"
        )
    dump = (out / "trainer").absolute()
    argv = [
        "./run_train.sh",
        "--compile.enable",
        "--compile.backend",
        backend,
        "--training.steps",
        str(sizes.trainer_steps),
        "--boost.profile_freq",
        str(sizes.trainer_profile_freq),
        "--boost.nan_policy",
        "skip",
        "--validation.no-enable",
        "--job.dump_folder",
        str(dump),
    ]
    env = {
        **os.environ,
        "NGPU": "1",
        "CONFIG_FILE": CONFIG,
        "PYTHON": sys.executable,
        "BOOST_TITAN_INJECT": f"nan_loss@{GUARD_STEP}",
        "BOOST_TITAN_DATA": str(corpus),
    }
    t0 = time.perf_counter()
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    seconds = time.perf_counter() - t0
    log = _ANSI.sub("", proc.stdout + proc.stderr)
    out.mkdir(parents=True, exist_ok=True)
    (out / "trainer.log").write_text(log)
    return {
        "command": f"NGPU=1 CONFIG_FILE={CONFIG} BOOST_TITAN_INJECT=nan_loss@{GUARD_STEP} "
        + " ".join(argv),
        "log": str(out / "trainer.log"),
        "seconds": seconds,
        **check_log(log, proc.returncode, sizes),
    }


def check_log(log: str, returncode: int, sizes: Sizes) -> dict:
    """What the trainer's log must show; ``problems`` lists what it does not."""
    steps = {int(m[1]): m for m in _STEP.finditer(log)}
    profiles = {int(m[1]): int(m[2]) for m in _PROFILE.finditer(log)}
    want_steps = list(range(1, sizes.trainer_steps + 1))
    want_profiles = profiled_steps(sizes.trainer_steps, sizes.trainer_profile_freq)
    problems = []
    if returncode != 0:
        problems.append(f"run_train.sh exited {returncode}: {log[-1500:]}")
    if sorted(steps) != want_steps:
        problems.append(f"metrics lines for steps {sorted(steps)}, expected {want_steps}")
    finite = [s for s, m in steps.items() if s != GUARD_STEP]
    if any(float(steps[s][4]) <= 0 for s in steps):
        problems.append("a metrics line reports memory 0 GiB")
    if any(float(steps[s][5].replace(",", "")) <= 0 for s in finite):
        problems.append("a metrics line reports 0 tokens/s")
    if any(not float(steps[s][2]) < 20 for s in finite):  # the debug model starts at ~9.5
        problems.append(f"non-finite or exploding losses: {[steps[s][2] for s in finite]}")
    if GUARD_STEP in steps and steps[GUARD_STEP][2] != "nan":
        problems.append(f"step {GUARD_STEP}'s injected NaN loss was not logged as nan")
    if not _SKIP.search(log):
        problems.append(f"no step-guard skip logged for the NaN loss at step {GUARD_STEP}")
    if sorted(profiles) != want_profiles:
        problems.append(f"profiled steps {sorted(profiles)}, expected {want_profiles}")
    if "Compiling each TransformerBlock with torch.compile" not in log:
        problems.append("the blocks were not compiled")
    return {
        "returncode": returncode,
        "losses": {s: float(m[2]) for s, m in sorted(steps.items())},
        "memory_gib": {s: float(m[4]) for s, m in sorted(steps.items())},
        "tokens_per_s": {s: float(m[5].replace(",", "")) for s, m in sorted(steps.items())},
        "mfu_pct": {s: float(m[7]) for s, m in sorted(steps.items())},
        "profiled_step_ms": profiles,
        "guard_skipped_step": GUARD_STEP if _SKIP.search(log) else None,
        "problems": problems,
        "ok": not problems,
    }
