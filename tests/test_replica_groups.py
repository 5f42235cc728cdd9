"""torchft replica groups (``[fault_tolerance] enable = true``, boost_titan.train.replicas):
groups of gloo ranks, each its own launch, joined by a lighthouse in this process."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_training

STEPS = ("--training.steps", "3", "--validation.no-enable", "--boost.profile_freq", "0")


@pytest.fixture
def lighthouse(monkeypatch):
    """A lighthouse in this process; the groups launched find it through the environment."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address())
    yield server.address()
    server.shutdown()


def run_groups(config: str, groups: int, per_group: int, root: Path, address: str, *extra):
    """``groups`` launches of ``per_group`` ranks each, at once, as replica groups of one
    job; returns their runs (``run_training``'s), group 0 first."""
    runs: list = [None] * groups
    errors: list = []

    def one(i: int) -> None:
        try:
            runs[i] = run_training(
                config,
                per_group,
                root / f"group{i}",
                *STEPS,
                "--fault_tolerance.enable",
                "--fault_tolerance.group_size",
                str(groups),
                "--fault_tolerance.replica_id",
                str(i),
                "--fault_tolerance.min_replica_size",
                str(groups),
                *extra,
                timeout=600,
            )
        except BaseException as e:  # (re-raised in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(groups)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return runs


def test_two_groups_of_one_rank_equal_dp2_without_ft(tmp_path, lighthouse):
    dp2 = ("--parallelism.data_parallel_shard_degree", "2")
    reference = run_training("debug_cola.toml", 2, tmp_path / "dp2", *STEPS, *dp2)
    runs = run_groups("debug_cola.toml", 2, 1, tmp_path, lighthouse)
    want = reference.loss[0]
    assert sorted(want) == [1, 2, 3]
    for i, run in enumerate(runs):
        got = run.loss[0]
        assert got.keys() == want.keys(), run.output[-3000:]
        for step in want:
            assert got[step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), (i, step)


# ----------------------------------------------------------------------------- launching
REPLICAS = [sys.executable, "-m", "boost_titan.cli", "replicas"]
_LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)")


def _replicas(*argv: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*REPLICAS, *argv], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_replicas_command_trains_two_groups_in_step(tmp_path):
    """``boost-titan replicas``: its lighthouse, 2 groups of 1 rank (each run_train.sh),
    one log per group; every group logs the job's loss (averaged over the groups), so
    both logs show the same losses, step for step."""
    dump = tmp_path / "job"
    proc = _replicas(
        "--groups", "2", "--min-replicas", "2", "--",
        "--job.config_file", "train_configs/debug_cola.toml", "--job.dump_folder", str(dump),
        "--training.steps", "2", "--validation.no-enable", "--boost.profile_freq", "0",
        "--metrics.no-enable-tensorboard", "--metrics.disable_color_printing",
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    logs = [(dump / f"replica_{i}.log").read_text() for i in range(2)]
    losses = [{int(s): float(v) for s, v in _LOSS.findall(log)} for log in logs]
    assert sorted(losses[0]) == [1, 2], logs[0][-3000:]
    assert losses[1] == losses[0], (losses, logs[1][-3000:])
    for i, log in enumerate(logs):
        assert f"--fault_tolerance.replica_id {i} " in log.splitlines()[0]
        # the console has each group's lines, prefixed
        assert f"[replica {i}] [rank0]:" in proc.stdout and "step:  2" in log
    assert "[replica 0]" not in logs[1]


def test_replicas_command_refuses_a_bad_config_before_any_group(tmp_path):
    """The config check of run_train.sh's pre-check, once, before a group starts: one
    line, exit 2, no group's log."""
    dump = tmp_path / "job"
    proc = _replicas(
        "--groups", "2", "--",
        "--job.config_file", "train_configs/debug_cola.toml", "--job.dump_folder", str(dump),
        "--training.dataset", "c4_test",
    )  # fmt: skip
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.splitlines() == [
        "boost-titan replicas: error: [training] dataset = 'c4_test' with [fault_tolerance]: "
        "replica groups need boost_titan's global data order (a recovered group continues "
        "at the live groups' position), which torchtitan's datasets do not have; use a "
        "tokenized corpus, your own text (local_text) or the embedded corpus "
        "(docs/training.md#data)"
    ]
    assert not dump.exists()


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--groups", "0"], "--groups 0 must be >= 1 (the number of replica groups)"),
        (["--groups", "2", "--min-replicas", "3"], "--min-replicas 3 must be in 1..2 (--groups 2)"),
        (["--groups", "2", "--min-replicas", "0"], "--min-replicas 0 must be in 1..2 (--groups 2)"),
        (["--groups", "1", "--nproc-per-group", "0"], "--nproc-per-group 0 must be >= 1"),
        (["--groups", "2", "--", "--fault_tolerance.replica_id", "1"],
         "--fault_tolerance.replica_id after -- is this command's to set: (one per group) "
         "(other [fault_tolerance] keys may be given)"),
        (["--groups", "2", "--", "--job.config_file", "a.toml", "--job.config_file=b.toml"],
         "two configs given (a.toml, b.toml); give one --job.config_file"),
    ],
)  # fmt: skip
def test_replicas_command_refuses_bad_options_in_one_line(argv, line, capsys, monkeypatch):
    """Before the lighthouse or any import of torch: argparse-level, in this process."""
    from boost_titan.train import replica_launch

    monkeypatch.delenv("CONFIG_FILE", raising=False)
    with pytest.raises(SystemExit) as e:
        replica_launch.main(argv)
    out = capsys.readouterr()
    assert (e.value.code, out.out) == (2, "")
    assert out.err.splitlines() == [f"boost-titan replicas: error: {line}"]


def test_slurm_recipe_starts_a_lighthouse_and_one_group_per_two_nodes(tmp_path):
    """recipes/slurm_replicas.sh on a fake 4-node allocation (scontrol and srun stand-ins;
    the lighthouse and the config check are real): the lighthouse on the first node, the
    config checked once for a group of 2 nodes, one srun per group on its own nodes and
    rendezvous, TORCHFT_LIGHTHOUSE exported; a group that fails is reported with its log,
    and the lighthouse is gone when the script ends."""
    import os
    import socket

    calls, bin_dir = tmp_path / "calls.log", tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "scontrol": "printf 'localhost\\nnode1\\nnode2\\nnode3\\n'",
        # group 1's srun fails
        "srun": f'echo "srun TORCHFT_LIGHTHOUSE=$TORCHFT_LIGHTHOUSE $*" >> {calls}\n'
        'case "$*" in *"replica_id 1 "*) exit 3;; esac',
        "python": f'echo "python $*" >> {calls}\nexec {sys.executable} "$@"',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("CONFIG_FILE", "TORCHFT_LIGHTHOUSE")}
    env.update(
        PATH=f"{bin_dir}:{env['PATH']}",
        PYTHON=str(bin_dir / "python"),
        LIGHTHOUSE=str(Path(sys.executable).parent / "torchft_lighthouse"),
        LIGHTHOUSE_PORT=str(port),
        GPUS_PER_NODE="1",
        NODES_PER_GROUP="2",
        MIN_REPLICAS="2",
        LOG_DIR=str(tmp_path / "logs"),
        SLURM_JOB_NODELIST="node[0-3]",
        SLURM_JOB_ID="4242",
        HF_DATASETS_OFFLINE="1",
    )
    config = "train_configs/debug_cola_btp_tp2.toml"  # TP2: a group's 2 nodes x 1 GPU
    proc = subprocess.run(
        ["bash", "recipes/slurm_replicas.sh", config, "--training.steps", "2"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    ft = "--fault_tolerance.enable --fault_tolerance.group_size 2 --fault_tolerance.replica_id"
    lighthouse = f"http://localhost:{port}"

    def group(i: int, nodes: str, head: str) -> str:
        return (
            f"srun TORCHFT_LIGHTHOUSE={lighthouse} --nodes 2 --ntasks 2 --ntasks-per-node 1 "
            f"--nodelist {nodes} --exact --output {tmp_path}/logs/replica_{i}.log "
            f"{bin_dir}/python -m torch.distributed.run --nnodes 2 --nproc_per_node 1 "
            f"--rdzv_id 4242_replica_{i} --rdzv_backend c10d --rdzv_endpoint {head}:29500 "
            "--max-restarts 3 --shutdown-timeout 240 --local-ranks-filter 0 --role rank "
            f"--tee 3 -m boost_titan.train --job.config_file {config} --training.steps 2 "
            f"{ft} {i} --fault_tolerance.min_replica_size 2"
        )

    assert sorted(calls.read_text().splitlines()) == [
        f"python -m boost_titan.train.launch_check 2 --job.config_file {config} "
        f"--training.steps 2 {ft} 0 --fault_tolerance.min_replica_size 2",
        group(0, "localhost,node1", "localhost"),
        group(1, "node2,node3", "node2"),
    ]
    assert proc.stderr.splitlines()[-1] == (
        f"slurm_replicas.sh: replica group 1 exited with status 3 "
        f"(log: {tmp_path}/logs/replica_1.log)"
    )
    with pytest.raises(OSError):  # the EXIT trap stopped the lighthouse
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_replicas_command_gives_each_group_its_own_gpus(monkeypatch, capsys):
    """With GPUs, group i gets the i-th K of the visible ones (run_train.sh alone would
    put every group on GPUs 0..K-1); more than visible is one line. (A CPU machine: the
    GPU count is what this test says it is.)"""
    import torch

    from boost_titan.train import replica_launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5,6,7")
    assert replica_launch.gpu_sets(2, 2) == ["3,5", "6,7"]
    assert replica_launch.gpu_sets(3, 1) == ["3", "5", "6"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert replica_launch.gpu_sets(4, 1) == ["0", "1", "2", "3"]
    with pytest.raises(SystemExit) as e:
        replica_launch.gpu_sets(3, 2)
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "boost-titan replicas: error: --groups 3 x --nproc-per-group 2 need 6 GPUs (one "
        "rank per GPU), 4 visible (0,1,2,3)"
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert replica_launch.gpu_sets(2, 2) is None
