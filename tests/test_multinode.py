"""Two "nodes" on this machine: two torchrun agents (``--nnodes 2``), a c10d rendezvous on
127.0.0.1 at a free port, gloo, each agent started the way a user starts one per node,
against single-node runs of the same layout (ranks forked, ``tests/launcher.py``):

* BTP TP2 with one rank per node (``NNODES=2 NGPU=1 ./run_train.sh`` on each "node"):
  the tensor-parallel collectives cross the nodes; the losses equal one node's;
* a node lost at a known step (``BOOST_TITAN_INJECT=nodekill@3:rank=1``: rank 1
  SIGKILLs its agent and itself after step 3): the other node's rank fails on the dead
  peer and its agent exits at once (no hang; MAX_RESTARTS=0);
* the relaunch through ``recipes/slurm_train.sh`` under a stub SLURM (``srun`` starts
  one copy of its command per node with the task's SLURM variables, ``scontrol show
  hostnames`` names 127.0.0.1): the script's pre-check, head-node and port handling
  start both agents, and they resume from the last checkpoint (step 2) with the
  uninterrupted single-node run's losses (steps 3-4);
* HSDP 2 replicas x FSDP 2 with two ranks per node: torchtitan's mesh puts the replica
  dimension across the nodes (ranks 0-1: replica 0 on node 0, ranks 2-3: replica 1 on
  node 1); the losses equal one node's.

All in fp32 (the debug configs' setting) with one thread per rank, so the losses are
bit-identical to the single-node runs'."""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_training

CONFIG = "debug_cola_btp_tp2.toml"
HSDP = "debug_svd_hsdp.toml"
STEPS = 4  # checkpoints after steps 2 and 4
BASE = (
    "--validation.no-enable",
    "--metrics.disable_color_printing",
    "--checkpoint.enable",
    "--checkpoint.interval",
    "2",
    "--training.steps",
    str(STEPS),
)
NODE_TIMEOUT = 240  # s; a hang fails the test instead of stalling the suite

pytestmark = pytest.mark.slow

_STEP = re.compile(r"\[rank\d+\]:.*?step:\s*(\d+)\s+loss:\s*([-\d.naninf]+)")


def _losses(output: str) -> dict[int, float]:
    """step -> loss, from one node's console (its local rank 0)."""
    return {int(m[1]): float(m[2]) for m in _STEP.finditer(output)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def one_thread():
    """One thread per rank everywhere (the forked single-node runs would take cores /
    ranks), so that no matmul sums in another order on one side."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


def _run_nodes(commands: list[list[str]], envs: list[dict[str, str]], folder: Path):
    """Start one command per node (each in its own process group, output to a file), wait
    for all; returns [(returncode, output)]. A node still running after NODE_TIMEOUT is
    killed with its processes and the test fails."""
    folder.mkdir(parents=True, exist_ok=True)
    procs = []
    for node, (cmd, env) in enumerate(zip(commands, envs)):
        out = open(folder / f"node{node}.log", "w")
        procs.append(
            subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env={**os.environ, **env},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        out.close()
    hung = []
    for node, p in enumerate(procs):
        try:
            p.wait(timeout=NODE_TIMEOUT)
        except subprocess.TimeoutExpired:
            hung.append(node)
            os.killpg(p.pid, signal.SIGTERM)  # torchrun stops its ranks on SIGTERM
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    results = [(p.returncode, (folder / f"node{n}.log").read_text()) for n, p in enumerate(procs)]
    assert not hung, f"nodes {hung} still ran after {NODE_TIMEOUT} s:\n" + "\n".join(
        out[-3000:] for _, out in results
    )
    return results


def _run_train_nodes(config: str, ngpu: int, folder: Path, *args: str, **env: str):
    """``NNODES=2 RDZV_ENDPOINT=127.0.0.1:PORT NGPU=ngpu ./run_train.sh`` on two nodes."""
    common = dict(
        NNODES="2",
        NGPU=str(ngpu),
        RDZV_ENDPOINT=f"127.0.0.1:{_free_port()}",
        CONFIG_FILE=str(REPO_ROOT / "train_configs" / config),
        PYTHON=sys.executable,
        LOG_RANK="0",
        **env,
    )
    cmd = ["./run_train.sh", "--job.dump_folder", str(folder / "dump"), *args]
    # every node checks the config before its agent starts; one check is enough here
    # (and saves an interpreter that imports torchtitan)
    return _run_nodes([cmd, cmd], [common, {**common, "BOOST_TITAN_PRECHECK": "0"}], folder)


@pytest.fixture(scope="module")
def reference(corpus_dir, one_thread, tmp_path_factory):
    """One node, two forked ranks: BTP TP2, uninterrupted."""
    run = run_training(CONFIG, 2, tmp_path_factory.mktemp("mn_ref") / "dump", *BASE)
    assert sorted(run.loss[0]) == list(range(1, STEPS + 1))
    return run.loss[0]


@pytest.fixture(scope="module")
def node_lost(corpus_dir, one_thread, tmp_path_factory):
    """Two nodes, one rank each; rank 1's node is lost after step 3."""
    folder = tmp_path_factory.mktemp("mn_lost")
    results = _run_train_nodes(
        CONFIG, 1, folder, *BASE, BOOST_TITAN_INJECT="nodekill@3:rank=1", MAX_RESTARTS="0"
    )
    return folder, results


def _by_role(results):
    """(survivor, lost): which command became which node is the rendezvous' choice; the
    lost node's run_train.sh reports its agent's SIGKILL."""
    lost = [r for r in results if r[0] == 128 + signal.SIGKILL]
    assert len(lost) == 1, [(rc, out[-2000:]) for rc, out in results]
    [survivor] = [r for r in results if r is not lost[0]]
    return survivor, lost[0]


def test_btp_tp2_across_two_nodes_trains_as_one_node(reference, node_lost):
    _, results = node_lost
    (_, node0), (_, node1) = _by_role(results)
    for out in (node0, node1):
        assert (
            "Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2"
            in out
        )
    assert _losses(node0) == {s: reference[s] for s in (1, 2, 3)}
    # the lost node's console: its rank died right after step 3, its last line may be lost
    assert _losses(node1) == {s: reference[s] for s in _losses(node1)}
    assert {1, 2} <= set(_losses(node1))


def test_lost_node_ends_the_other_node(node_lost):
    folder, results = node_lost
    (rc0, node0), _ = _by_role(results)
    assert rc0 == 1, node0[-3000:]  # returned, within NODE_TIMEOUT: no hang
    # its rank failed on the dead peer (gloo) or the rendezvous store that node hosted
    assert "Connection reset by peer" in node0 or "Connection closed" in node0, node0[-3000:]
    assert 4 not in _losses(node0)
    checkpoints = folder / "dump" / "checkpoint"
    assert (checkpoints / "step-2" / ".metadata").is_file()
    assert not (checkpoints / "step-4").exists()


def _stub_slurm(folder: Path) -> tuple[Path, Path]:
    """``srun`` and ``scontrol`` stubs in ``folder/bin``: srun runs its command once per
    node (SLURM_NNODES), as under sbatch with --ntasks-per-node=1, each with the task's
    SLURM variables, output lines labelled ``NODE: `` (as ``srun --label``)."""
    bin_dir = folder / "bin"
    bin_dir.mkdir()
    calls = folder / "calls.log"
    (bin_dir / "srun").write_text(
        f"""#!/usr/bin/env bash
echo "srun $*" >> {calls}
pids=()
for (( node = 0; node < SLURM_NNODES; node++ )); do
  ( SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 SLURM_NTASKS=$SLURM_NNODES \\
      SLURMD_NODENAME=node$node "$@" 2>&1 | sed -u "s/^/$node: /"; exit "${{PIPESTATUS[0]}}" ) &
  pids+=($!)
done
rc=0
for pid in "${{pids[@]}}"; do wait "$pid" || rc=$?; done
exit $rc
"""
    )
    (bin_dir / "scontrol").write_text(
        f"""#!/usr/bin/env bash
echo "scontrol $*" >> {calls}
[[ "$1 $2" == "show hostnames" ]] || exit 1
echo 127.0.0.1
sleep 0.2  # a long node list: `scontrol ... | head -n 1` under pipefail died of SIGPIPE
echo 127.0.0.1
"""
    )
    (bin_dir / "python").write_text(
        f'#!/usr/bin/env bash\necho "python $*" >> {calls}\nexec {sys.executable} "$@"\n'
    )
    for tool in bin_dir.iterdir():
        tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    return bin_dir, calls


def test_slurm_relaunch_resumes_across_nodes(reference, node_lost):
    """The lost run relaunched through recipes/slurm_train.sh: both agents rendezvous
    at the head node, resume from step 2 (the last complete checkpoint) and train steps
    3-4 with the uninterrupted run's losses."""
    folder, _ = node_lost
    bin_dir, calls = _stub_slurm(folder)
    port = _free_port()
    [(rc, out)] = _run_nodes(
        [
            [
                "bash",
                "recipes/slurm_train.sh",
                f"train_configs/{CONFIG}",
                "--job.dump_folder",
                str(folder / "dump"),
                *BASE,
            ]
        ],
        [
            dict(
                PATH=f"{bin_dir}:{os.environ['PATH']}",
                PYTHON=str(bin_dir / "python"),
                GPUS_PER_NODE="1",
                RDZV_PORT=str(port),
                SLURM_JOB_NODELIST="node[0-1]",
                SLURM_NNODES="2",
                SLURM_JOB_ID="4242",
            )
        ],
        folder / "slurm",
    )
    assert rc == 0, out[-4000:]
    per_node = {n: "\n".join(re.findall(rf"^{n}: (.*)$", out, re.M)) for n in (0, 1)}
    for n, text in per_node.items():
        assert re.search(r"Loading the checkpoint from \S+/step-2\.", text), (n, text[-2000:])
        assert "Training starts at step 3" in text
        assert _losses(text) == {s: reference[s] for s in range(3, STEPS + 1)}, n
    lines = calls.read_text().splitlines()
    # the config checked once, for GPUS_PER_NODE x SLURM_NNODES ranks, then one srun
    # whose agent per node meets at the head node
    assert lines[0] == "scontrol show hostnames node[0-1]"
    assert lines[1].startswith("python -m boost_titan.train.launch_check 2 --job.config_file ")
    assert [x for x in lines if x.startswith("srun")] == [
        x
        for x in lines[2:3]
        if f"--rdzv_id 4242 --rdzv_backend c10d --rdzv_endpoint 127.0.0.1:{port}" in x
    ]
    agents = [x for x in lines if x.startswith("python -m torch.distributed.run --nnodes 2 ")]
    assert len(agents) == 2 and "--nproc_per_node 1" in agents[0]


def test_hsdp_replicas_across_two_nodes_train_as_one_node(corpus_dir, one_thread, tmp_path):
    args = ("--validation.no-enable", "--metrics.disable_color_printing", "--training.steps", "2")
    single = run_training(HSDP, 4, tmp_path / "single", *args)
    [(rc0, node0), (rc1, node1)] = _run_train_nodes(HSDP, 2, tmp_path / "two", *args)
    assert rc0 == rc1 == 0, (node0[-3000:], node1[-3000:])
    for out in (node0, node1):
        assert "parallelism: pp=1, dp_replicate=2, dp_shard=2, cp=1, tp=1" in out
    expected = {s: single.loss[0][s] for s in (1, 2)}
    assert sorted(single.loss[0]) == [1, 2]
    # node 0's local rank 0 is rank 0 (replica 0), node 1's is rank 2 (replica 1)
    assert _losses(node0) == expected
    assert _losses(node1) == expected
