"""A bad config costs nothing on a cluster: ``run_train.sh`` and ``recipes/slurm_train.sh``
check it once, in one process (``boost_titan.train.launch_check``, WORLD_SIZE = ranks per node
x nodes), before torchrun or srun starts; the error is one line (several nodes: a second
one saying how WORLD_SIZE was counted) and the exit status 2.
A config error found inside a rank is the same line, without a traceback.

Before this, ``NGPU=2 ./run_train.sh --parallelism.tensor_parallel_degree 3`` printed 57
lines: a traceback per rank and torchrun's ChildFailedError report. A good config
through the pre-check: every test that launches run_train.sh (test_train_e2e,
test_fault_tolerance, test_multinode)."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_main

TP2 = "train_configs/debug_cola_btp_tp2.toml"
# the pre-check's line (boost-titan check-config, as run_train.sh runs it); the ranks'
# line names what torchrun runs instead
TP3_ERROR = (
    "boost-titan check-config: error: [parallelism] degrees multiply to {n} "
    "(data_parallel_replicate_degree 1 x data_parallel_shard_degree 1 x "
    "context_parallel_degree 1 x tensor_parallel_degree {n} x "
    "pipeline_parallel_degree 1) but WORLD_SIZE = {ws} processes were launched; launch "
    "NGPU={n} or set data_parallel_shard_degree = -1 (the rest)"
)


def _recording_python(tmp_path: Path) -> tuple[Path, Path]:
    """A PYTHON for the launch scripts that records each command line, then runs it."""
    log = tmp_path / "python_calls.log"
    wrapper = tmp_path / "python"
    wrapper.write_text(f'#!/usr/bin/env bash\necho "$*" >> {log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    return wrapper, log


def _run(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE", "NNODES")}
    return subprocess.run(
        cmd, cwd=REPO_ROOT, env={**base, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "env, args, ws, n, extra",
    [
        ({"NGPU": "2"}, ["--parallelism.tensor_parallel_degree", "3"], 2, 3, []),
        # two nodes: WORLD_SIZE is NGPU x NNODES (no rendezvous is attempted)
        (
            {"NGPU": "2", "NNODES": "2", "RDZV_ENDPOINT": "127.0.0.1:29400"},
            ["--parallelism.tensor_parallel_degree", "2"],
            4,
            2,
            ["run_train.sh: WORLD_SIZE 4 = NGPU 2 per node x NNODES 2"],
        ),
    ],
)
def test_run_train_bad_config_is_one_line_before_torchrun(tmp_path, env, args, ws, n, extra):
    python, calls = _recording_python(tmp_path)
    proc = _run(["./run_train.sh", *args], CONFIG_FILE=TP2, PYTHON=str(python), **env)
    out = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, out
    assert out == [TP3_ERROR.format(n=n, ws=ws), *extra]
    # one interpreter ran, the pre-check, with the ranks' arguments; torchrun never started
    assert calls.read_text().splitlines() == [
        f"-m boost_titan.train.launch_check {ws} --job.config_file {TP2} {' '.join(args)}"
    ]


def test_run_train_needs_an_endpoint_for_several_nodes():
    proc = _run(["./run_train.sh"], NGPU="1", NNODES="2", PYTHON="/nonexistent/python")
    assert proc.returncode == 2
    assert "NNODES=2 needs RDZV_ENDPOINT=HOST:PORT" in proc.stderr


def test_slurm_bad_config_is_one_line_before_srun(tmp_path):
    """recipes/slurm_train.sh checks once for GPUS_PER_NODE x SLURM_NNODES ranks, on the
    batch node, before srun starts a process on any node."""
    python, calls = _recording_python(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool, body in (("srun", 'echo "srun $*" >> {log}'), ("scontrol", "echo 127.0.0.1")):
        path = bin_dir / tool
        path.write_text("#!/usr/bin/env bash\n" + body.format(log=calls) + "\n")
        path.chmod(0o755)
    proc = _run(
        ["bash", "recipes/slurm_train.sh", TP2, "--parallelism.tensor_parallel_degree", "3"],
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        PYTHON=str(python),
        GPUS_PER_NODE="1",
        SLURM_NNODES="2",
        SLURM_JOB_NODELIST="node[0-1]",
        SLURM_JOB_ID="4242",
    )
    out = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 2, out
    assert out == [
        TP3_ERROR.format(n=3, ws=2),
        "slurm_train.sh: WORLD_SIZE 2 = GPUS_PER_NODE 1 x SLURM_NNODES 2",
    ]
    assert calls.read_text().splitlines() == [
        f"-m boost_titan.train.launch_check 2 --job.config_file {TP2} "
        "--parallelism.tensor_parallel_degree 3"
    ]


def test_rank_side_config_error_has_no_traceback():
    """What the ranks print when the pre-check is skipped (BOOST_TITAN_PRECHECK=0, or
    torchrun launched by hand): each rank one line, exit status 2."""
    proc = run_main(
        "boost_titan.train.trainer",
        "--job.config_file",
        str(REPO_ROOT / TP2),
        "--parallelism.tensor_parallel_degree",
        "3",
        nproc=2,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    rank_line = TP3_ERROR.format(n=3, ws=2).replace("boost-titan check-config", "boost_titan.train")
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert lines == [rank_line] * 2  # one per rank
