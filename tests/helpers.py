"""Shared helpers for end-to-end tests: run run_train.sh and parse what it logs."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
LOG_ROOT: str | None = None  # run_main's log folders (conftest: pytest's temporary folder)

_STEP = re.compile(
    r"\[rank(\d+)\]:.*?step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)\s+grad_norm:\s*([-\d.naninf]+)"
    r"\s+memory:\s*([\d.]+)GiB.*?tps:\s*([\d,]+)\s+tflops:\s*([\d.]+)\s+mfu:\s*([\d.]+)%"
)
_VAL = re.compile(r"\[rank(\d+)\]:.*?validate step:\s*(\d+)\s+loss:\s*([\d.]+)")


@dataclass
class TrainRun:
    output: str
    dump_folder: Path
    # rank -> step -> value
    loss: dict[int, dict[int, float]] = field(default_factory=dict)
    grad_norm: dict[int, dict[int, float]] = field(default_factory=dict)
    memory_gib: dict[int, dict[int, float]] = field(default_factory=dict)
    tps: dict[int, dict[int, float]] = field(default_factory=dict)
    mfu: dict[int, dict[int, float]] = field(default_factory=dict)
    val_loss: dict[int, dict[int, float]] = field(default_factory=dict)

    def losses(self, rank: int | None = None) -> list[float]:
        """Per-step losses of ``rank`` (default: the first rank that logged a loss)."""
        rank = min(self.loss) if rank is None else rank
        return [self.loss[rank][s] for s in sorted(self.loss[rank])]

    def tb_event_files(self) -> list[str]:
        return glob.glob(
            str(self.dump_folder / "tb" / "**" / "events.out.tfevents.*"), recursive=True
        )


def run_training(
    config: str,
    ngpu: int,
    dump_folder: Path,
    *overrides: str,
    timeout: int = 900,
    expect_failure: bool = False,
    launcher: str = "fork",
    env: dict[str, str] | None = None,
) -> TrainRun:
    """Train ``config`` (a file of train_configs/) on ``ngpu`` gloo ranks with these
    CLI overrides. ``launcher``: "fork" (``tests/launcher.py``: the trainer's ranks
    forked from a server that imported it once) or "torchrun" (the README's
    ``run_train.sh``, for tests of the launcher itself and of the README's runs).
    ``env``: variables for this run's ranks only, on top of this process's."""
    env = {**os.environ, **(env or {})}
    env.update(LOG_RANK=",".join(str(r) for r in range(ngpu)), PYTHON=PYTHON)
    config_file = str(REPO_ROOT / "train_configs" / config)
    args = [
        "--job.dump_folder",
        str(dump_folder),
        "--metrics.disable_color_printing",
        *overrides,
    ]
    if launcher == "torchrun":
        env.update(NGPU=str(ngpu), CONFIG_FILE=config_file)
        proc = subprocess.run(
            [str(REPO_ROOT / "run_train.sh"), *args],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        rc, out = proc.returncode, proc.stdout + proc.stderr
    elif launcher == "fork":
        from launcher import launch

        logs = Path(dump_folder).parent / f".{Path(dump_folder).name}.logs"
        argv = ["--job.config_file", config_file, *args]
        done = launch(
            "boost_titan.train.trainer", argv, ngpu, env, str(REPO_ROOT), str(logs), timeout
        )
        rc, out = done.returncode, done.tee()
    else:
        raise ValueError(f"launcher {launcher!r}: use 'fork' or 'torchrun'")
    if expect_failure:
        assert rc != 0, f"run was expected to fail:\n{out[-4000:]}"
    elif rc != 0:
        raise AssertionError(f"training run failed (rc {rc}):\n{out[-6000:]}")
    run = TrainRun(output=out, dump_folder=Path(dump_folder))
    for m in _STEP.finditer(out):
        rank, step = int(m[1]), int(m[2])
        run.loss.setdefault(rank, {})[step] = float(m[3])
        run.grad_norm.setdefault(rank, {})[step] = float(m[4])
        run.memory_gib.setdefault(rank, {})[step] = float(m[5])
        run.tps.setdefault(rank, {})[step] = float(m[6].replace(",", ""))
        run.mfu.setdefault(rank, {})[step] = float(m[8])
    for m in _VAL.finditer(out):
        run.val_loss.setdefault(int(m[1]), {})[int(m[2])] = float(m[3])
    return run


def run_main(
    entry: str,
    *argv: str,
    log_dir: Path | None = None,
    nproc: int = 1,
    timeout: int = 900,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess:
    """``python -m entry argv`` (``nproc`` > 1: ``torchrun --nproc-per-node nproc -m
    entry argv``), forked from the launcher's server, with ``env`` added to this
    process's environment: stdout is rank 0's, stderr every rank's. The processes'
    output files go to ``log_dir`` (default: a new folder under the session's
    ``LOG_ROOT``, which conftest sets to pytest's temporary folder)."""
    import tempfile

    from launcher import launch

    if log_dir is None:
        log_dir = Path(tempfile.mkdtemp(prefix=f"{entry}_", dir=LOG_ROOT))

    env = {**os.environ, **(env or {})}
    env.pop("WORLD_SIZE", None)
    done = launch(
        entry, list(argv), nproc, env, str(REPO_ROOT), str(log_dir), timeout, distributed=nproc > 1
    )
    return subprocess.CompletedProcess(
        [entry, *argv], done.returncode, done.stdout[0], "".join(done.stderr)
    )


def assert_safe_metadata(step_dir: str | os.PathLike) -> None:
    """The step folder's DCP ``.metadata`` reads through ``boost_titan.checkpoint.safe_metadata``'s
    allowlist to exactly what plain ``pickle`` reads, and its pickled items (train
    state, LR schedulers, optimizer settings, the data loader's state) load through the
    installed weights-only item reader and the data loader's no-global reader: the
    allowlists cover every global this layout's checkpoints are made of (plain pickle
    only on our own checkpoints)."""
    import pickle
    import warnings

    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from boost_titan.checkpoint import safe_metadata

    data = (Path(step_dir) / ".metadata").read_bytes()
    meta = safe_metadata.loads(data, str(step_dir))
    assert meta == pickle.loads(data), step_dir
    assert safe_metadata.installed()
    keys = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    if keys:
        with warnings.catch_warnings():  # one process, no process group: the point here
            warnings.filterwarnings("ignore", "torch.distributed is unavailable")
            items = _load_state_dict_from_keys(keys, checkpoint_id=str(step_dir))
        for key, blob in items.get("dataloader", {}).items():
            if key != "world_size":
                assert safe_metadata.dataloader_state(blob, key) == pickle.loads(blob), key
