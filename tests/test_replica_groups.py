"""torchft replica groups (``[fault_tolerance] enable = true``, boost_titan.train.replicas):
groups of gloo ranks, each its own launch, joined by a lighthouse in this process."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_training

DIGEST_ENV = "BOOST_TITAN_PARAM_DIGEST"
STEPS = ("--training.steps", "3", "--validation.no-enable", "--boost.profile_freq", "0")


def _lighthouse(monkeypatch, min_replicas: int):
    """A lighthouse in this process; the groups launched find it through the environment.
    A group is dead to it after 1 s without a heartbeat."""
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000, heartbeat_timeout_ms=1000
    )
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", server.address())
    return server


@pytest.fixture
def lighthouse(monkeypatch):
    server = _lighthouse(monkeypatch, 1)
    yield server.address()
    server.shutdown()


def group_args(i: int, groups: int, min_size: int, *extra: str) -> tuple[str, ...]:
    return (
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size",
        str(groups),
        "--fault_tolerance.replica_id",
        str(i),
        "--fault_tolerance.min_replica_size",
        str(min_size),
        *extra,
    )


def run_groups(
    config: str, groups: int, per_group: int, root: Path, address: str, *extra,
    steps: int = 3, env: dict[int, dict[str, str]] | None = None, expect_failure: bool = False,
):  # fmt: skip
    """``groups`` launches of ``per_group`` ranks each, at once, as replica groups of one
    job; returns their runs (``run_training``'s), group 0 first. ``env[i]``: variables
    for group ``i`` alone."""
    runs: list = [None] * groups
    errors: list = []

    def one(i: int) -> None:
        try:
            runs[i] = run_training(
                config,
                per_group,
                root / f"group{i}",
                *STEPS,
                "--training.steps",
                str(steps),
                *group_args(i, groups, groups, *extra),
                expect_failure=expect_failure,
                timeout=600,
                env=(env or {}).get(i),
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


def test_two_groups_equal_dp2_without_ft_and_the_whole_job_resumes_exactly(tmp_path, lighthouse):
    """Two groups of one rank, no failure: the losses of FSDP dp2 without FT. Group 0
    alone writes the job's sealed steps; both groups SIGKILLed after step 4 (saved) and
    launched again resume from it and end as the uninterrupted run."""
    common = ("--training.steps", "6", "--training.seq_len", "64", *STEPS[2:])
    dp2 = ("--parallelism.data_parallel_shard_degree", "2")
    reference = run_training("debug_cola.toml", 2, tmp_path / "dp2", *common, *dp2)
    want = reference.loss[0]
    assert sorted(want) == list(range(1, 7))
    ckpt = tmp_path / "job_checkpoints"
    saves = ("--checkpoint.enable", "--checkpoint.interval", "2", "--checkpoint.folder", str(ckpt))
    first = run_groups(
        "debug_cola.toml", 2, 1, tmp_path / "first", lighthouse, *common, *saves,
        env={i: {"BOOST_TITAN_INJECT": "sigkill@4"} for i in range(2)}, expect_failure=True,
    )  # fmt: skip
    for i, run in enumerate(first):
        assert sorted(run.loss[0]) == [1, 2, 3, 4], run.output[-3000:]
        for step in run.loss[0]:
            assert run.loss[0][step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), (i, step)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-2", "step-4"]
    again = run_groups("debug_cola.toml", 2, 1, tmp_path / "again", lighthouse, *common, *saves)
    for i, run in enumerate(again):
        assert "Training starts at step 5" in run.output, run.output[-3000:]
        assert sorted(run.loss[0]) == [5, 6]
        for step in (5, 6):
            assert run.loss[0][step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), (i, step)
    assert sorted(p.name for p in ckpt.glob("step-*")) == ["step-2", "step-4", "step-6"]


def test_the_live_group_trains_on_alone_within_the_timeout(tmp_path, lighthouse):
    """min_replica_size 1: group 1 is SIGKILLed after step 2; group 0 finishes every
    step alone, the step after the death bounded by the collectives' timeout (2 s) and
    the lighthouse's heartbeat (1 s), not torchft's 60 s quorum timeout."""
    fast = ("--training.seq_len", "64", "--fault_tolerance.process_group_timeout_ms", "2000")
    common = ("--training.steps", "5", *STEPS[2:], *fast)
    survivor: dict = {}

    def group0() -> None:
        survivor["run"] = run_training(
            "debug_cola.toml", 1, tmp_path / "group0", *common, *group_args(0, 2, 1),
            timeout=300,
        )  # fmt: skip

    t = threading.Thread(target=group0)
    t.start()
    killed = run_training(
        "debug_cola.toml", 1, tmp_path / "group1", *common, *group_args(1, 2, 1),
        env={"BOOST_TITAN_INJECT": "sigkill@2"}, expect_failure=True, timeout=300,
    )  # fmt: skip
    t.join()
    assert "SIGKILL after step 2" in killed.output
    alive = survivor["run"]
    assert sorted(alive.loss[0]) == [1, 2, 3, 4, 5]
    stamps = {int(m[2]): m[1] for m in _STEP_AT.finditer(alive.output)}
    died = _STAMP.search(killed.output[killed.output.index("SIGKILL after step 2") - 200 :])
    gap = _seconds(stamps[3]) - _seconds(died[1])
    assert 0 < gap < 30, gap  # (a wait for the quorum timeout would be >= 60 s)


_STAMP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")
_STEP_AT = re.compile(r"\[titan\] (\S+ \S+) - root - INFO - step:\s+(\d+) ")


def _seconds(stamp: str) -> float:
    from datetime import datetime

    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


_DIGEST = re.compile(
    r"\[fault_tolerance\] group (\d+) step (\d+) params ([0-9a-f]+) optimizer ([0-9a-f]+)"
)


def digests(output: str, rank: int = 0) -> dict[int, tuple[str, str]]:
    """Step -> (parameters' digest, optimizer state's) that ``rank`` logged."""
    mine = "\n".join(line for line in output.splitlines() if line.startswith(f"[rank{rank}]:"))
    return {int(m[2]): (m[3], m[4]) for m in _DIGEST.finditer(mine)}


LAYOUTS = {
    # a group's config and ranks -> the same job without FT: config, ranks, overrides
    "cola": (
        "debug_cola.toml",
        1,
        "debug_cola.toml",
        2,
        "--parallelism.data_parallel_shard_degree",
        "2",
    ),
    "cola_btp_tp2": ("debug_cola_btp_tp2.toml", 2, "debug_cola_btp_tp2_fsdp2.toml", 4),
}


@pytest.mark.parametrize("layout", ["cola_btp_tp2"])
def test_a_killed_group_is_waited_for_then_recovers_from_the_live_one(
    tmp_path, monkeypatch, layout
):
    """min_replica_size 2: group 1 is SIGKILLed after step 3; group 0's steps wait (and
    its log says why) until group 1, relaunched, has recovered from it; from then on
    both groups' parameters are bitwise equal step by step, and the job ends as one.
    (The lighthouse forms quorums of one group; min_replica_size decides the commits.)"""
    config, ranks, ref_config, ref_ranks, *ref_extra = LAYOUTS[layout]
    server = _lighthouse(monkeypatch, 1)
    steps, kill_after = 8, 3
    fast = ("--training.seq_len", "64", "--fault_tolerance.process_group_timeout_ms", "2000")
    common = ("--training.steps", str(steps), "--validation.no-enable", "--boost.profile_freq", "0")
    digest = {DIGEST_ENV: "1"}
    survivor: dict = {}

    def group0() -> None:
        try:
            survivor["run"] = run_training(
                config, ranks, tmp_path / "group0", *common,
                *group_args(0, 2, 2, *fast), env=digest, timeout=300,
            )  # fmt: skip
        except BaseException as e:
            survivor["error"] = e

    t = threading.Thread(target=group0)
    t.start()
    try:
        killed = run_training(
            config, ranks, tmp_path / "group1", *common, *group_args(1, 2, 2, *fast),
            env={**digest, "BOOST_TITAN_INJECT": f"sigkill@{kill_after}"},
            expect_failure=True, timeout=600,
        )  # fmt: skip
        assert f"SIGKILL after step {kill_after}" in killed.output
        rejoined = run_training(
            config, ranks, tmp_path / "group1b", *common, *group_args(1, 2, 2, *fast),
            env=digest, timeout=600,
        )  # fmt: skip
    finally:
        t.join()
        server.shutdown()
    if "error" in survivor:
        raise survivor["error"]
    alive = survivor["run"]
    # the survivor trained every step once, and waited in between, saying why
    assert sorted(alive.loss[0]) == list(range(1, steps + 1))
    assert "step not applied, retried from the same data: 1 live replica group(s) of 2" in (
        alive.output
    )
    m = re.search(r"group 1 recovered from a live group: step (\d+), data position (\d+)",
                  rejoined.output)  # fmt: skip
    assert m, rejoined.output[-3000:]
    recovered = int(m[1])
    assert kill_after < recovered <= steps
    for rank in range(ranks):
        a, b = digests(alive.output, rank), digests(rejoined.output, rank)
        assert sorted(b) == list(range(recovered, steps + 1))
        for step in b:
            assert a[step] == b[step], (rank, step)
        # before the kill, the killed run agreed with the survivor too
        k = digests(killed.output, rank)
        assert sorted(k) == list(range(1, kill_after + 1))
        assert all(a[s] == k[s] for s in k)
    # the same losses from the recovery step on (the job's loss, averaged over groups)
    for step in range(recovered + 1, steps + 1):
        assert rejoined.loss[0][step] == alive.loss[0][step], step
    # and nothing was lost: the waits and the recovery trained exactly what a run without
    # a failure trains (each step once, on its own windows)
    reference = run_training(
        ref_config, ref_ranks, tmp_path / "ref", *common, "--training.seq_len", "64", *ref_extra
    )
    for step in range(1, steps + 1):
        want = reference.loss[0][step]
        assert alive.loss[0][step] == pytest.approx(want, rel=1e-5, abs=1e-5), step


def test_two_groups_of_two_btp_ranks_equal_tp2_fsdp2_without_ft(tmp_path, lighthouse):
    """BTP TP2 inside each group, two groups, against BTP TP2 x FSDP2 on 4 ranks."""
    reference = run_training("debug_cola_btp_tp2_fsdp2.toml", 4, tmp_path / "ref", *STEPS)
    digest = {i: {DIGEST_ENV: "1"} for i in range(2)}
    runs = run_groups("debug_cola_btp_tp2.toml", 2, 2, tmp_path, lighthouse, env=digest)
    want = reference.loss[0]
    for run in runs:
        for step in want:
            assert run.loss[0][step] == pytest.approx(want[step], rel=1e-5, abs=1e-5), step
    # TP rank r of group 0 holds exactly what TP rank r of group 1 holds
    for rank in (0, 1):
        assert sorted(digests(runs[0].output, rank)) == [1, 2, 3]
        assert digests(runs[0].output, rank) == digests(runs[1].output, rank)
    assert digests(runs[0].output, 0) != digests(runs[0].output, 1)  # (shards differ)


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


# ---------------------------------------------------------------- semi-synchronous
SEMI_SYNC_CASES = [
    (["--fault_tolerance.semi_sync_method", "fedavg"],
     "[fault_tolerance] semi_sync_method = 'fedavg' is not a method: 'diloco', 'local_sgd'"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "0"],
     "[fault_tolerance] sync_steps = 0 must be >= 1"),
    (["--fault_tolerance.semi_sync_method", "local_sgd", "--fault_tolerance.sync_steps", "3"],
     "[training] steps = 20 with semi_sync_method = 'local_sgd' must be a multiple of "
     "[fault_tolerance] sync_steps = 3"),
    (["--fault_tolerance.semi_sync_method", "diloco", "--fault_tolerance.sync_steps", "5"], None),
]  # fmt: skip


@pytest.mark.parametrize(
    "extra,refusal", SEMI_SYNC_CASES, ids=["unknown", "sync_steps_0", "steps_not_multiple", "ok"]
)
def test_semi_sync_parse(extra, refusal):
    """What semi-synchronous training accepts and refuses, in one line, at parse."""
    from boost_titan.train.config_check import parse_config
    from boost_titan.train.config_check.common import ConfigError

    argv = ["--job.config_file", str(REPO_ROOT / "train_configs" / "debug_cola.toml"),
            "--fault_tolerance.enable", "--fault_tolerance.group_size", "2", *extra]  # fmt: skip
    if refusal is None:
        config = parse_config(argv)
        assert (config.fault_tolerance.semi_sync_method, config.fault_tolerance.sync_steps) == (
            "diloco", 5,
        )  # fmt: skip
        return
    with pytest.raises(ConfigError) as e:
        parse_config(argv)
    assert refusal in str(e.value) and "\n" not in str(e.value)


H, OUTER_STEPS = 2, 2  # sync every 2 inner steps, 2 syncs (the second uses the momentum)
# small batches: the steps' numbers, not their cost, are what is compared
SMALL = ("--training.local_batch_size", "2", "--training.seq_len", "64")
MIB_LINE = re.compile(
    r"\[rank(\d+)\]:.*? (\w+) sync (\d+) at step (\d+): [\d.]+ MiB per group \((\d+) bytes"
)


def semi_sync_reference(
    config: str, seed_step: Path, method: str, groups: int, dp: int = 1, skipped=frozenset()
):
    """DiLoCo / local SGD written here, in one process: each group's model trains H
    steps on its own batches (data-parallel ranks ``i * dp ...`` of ``groups * dp``,
    concatenated: a group of ``dp`` FSDP ranks) with its own AdamW,
    LR schedule and clipping (a (group, step) in ``skipped``: no optimizer or LR step, as
    the NaN guard's skip), then the groups meet: DiLoCo takes one Nesterov SGD step
    (lr 0.7, momentum 0.9) from the last global parameters along the averaged
    pseudo-gradient (global - local); local SGD averages the parameters. Returns
    (losses[group][step], final parameters, the model's parameter bytes)."""
    import torch
    import torch.distributed.checkpoint as dcp
    import torch.nn.functional as F
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.protocols.train_spec import get_train_spec

    from boost_titan.data.loader import build_dataloader
    from boost_titan.train.config_check import parse_config
    from boost_titan.train.specs import register_all

    register_all()
    steps = H * OUTER_STEPS
    cfg = parse_config(
        ["--job.config_file", str(REPO_ROOT / "train_configs" / config),
         "--training.steps", str(steps), *SMALL]
    )  # fmt: skip
    spec = get_train_spec(cfg.model.name)
    args = copy.deepcopy(spec.model_args[cfg.model.flavor])
    args.update_from_config(cfg)
    tokenizer = spec.build_tokenizer_fn(cfg)
    start = spec.model_cls(args)
    state = start.state_dict()
    dcp.load(state, checkpoint_id=str(seed_step), no_dist=True)
    start.load_state_dict(state)
    o = cfg.optimizer
    kwargs = dict(
        lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
        fused=o.implementation == "fused", foreach=o.implementation == "foreach",
    )  # fmt: skip
    models = [copy.deepcopy(start) for _ in range(groups)]
    optims = [OptimizersContainer([m], torch.optim.AdamW, kwargs) for m in models]
    scheds = [build_lr_schedulers(opt, cfg.lr_scheduler, steps) for opt in optims]
    readers = [
        [iter(build_dataloader(groups * dp, i * dp + r, tokenizer, cfg)) for r in range(dp)]
        for i in range(groups)
    ]
    global_params = [p.detach().clone() for p in start.parameters()]
    momentum = [torch.zeros_like(p) for p in global_params]
    losses = [{} for _ in range(groups)]
    for step in range(1, steps + 1):
        for i, model in enumerate(models):
            batch = [next(reader) for reader in readers[i]]
            inputs = torch.cat([x["input"] for x, _ in batch])
            labels = torch.cat([y for _, y in batch])
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.training.max_norm)
            if (i, step) not in skipped:
                optims[i].step()
                scheds[i].step()
            optims[i].zero_grad()
            losses[i][step] = loss.item()
        if step % H:
            continue
        with torch.no_grad():
            locals_ = [list(m.parameters()) for m in models]
            for k, g in enumerate(global_params):
                if method == "diloco":
                    delta = sum(g - ps[k] for ps in locals_) / groups
                    momentum[k].mul_(0.9).add_(delta)
                    g.sub_(0.7 * (delta + 0.9 * momentum[k]))
                else:
                    g.copy_(sum(ps[k] for ps in locals_) / groups)
                for ps in locals_:
                    ps[k].copy_(g)
    names = [n for n, _ in start.named_parameters()]
    nbytes = sum(p.numel() * p.element_size() for p in start.parameters())
    return losses, dict(zip(names, global_params)), nbytes


@pytest.mark.parametrize(
    "config,method,per_group,model_config,skipped",
    [
        ("debug_cola.toml", "diloco", 1, "debug_cola.toml", {(0, 1)}),
        ("debug_llama2_fsdp2.toml", "local_sgd", 2, "debug_llama2.toml", set()),
    ],
)
def test_semi_sync_equals_written_out(
    config, method, per_group, model_config, skipped, tmp_path, lighthouse, seed_checkpoint
):
    """2 groups (of 1 rank; of 2 FSDP ranks), 2 syncs of H = 2 inner steps, from a seed
    checkpoint: every group's losses and the final parameters (group 0's last
    checkpoint) equal the reference's; each sync logs the model's parameter bytes per
    group (CoLA and its dense twin; FSDP's shards summed over the group). In the DiLoCo
    case group 0 alone skips step 1 (an injected inf gradient, ``nan_policy = "skip"``):
    it still syncs with group 1 at steps 2 and 4 (syncs count the job's steps)."""
    import torch
    import torch.distributed.checkpoint as dcp

    from boost_titan.train.fault import INJECT_ENV

    seed = seed_checkpoint(model_config)
    env = {i: {INJECT_ENV: f"inf_grad@{step}"} for i, step in skipped}
    runs = run_groups(
        config, 2, per_group, tmp_path, lighthouse, "--boost.nan_policy", "skip",
        "--fault_tolerance.semi_sync_method", method,
        "--fault_tolerance.sync_steps", str(H),
        "--checkpoint.enable", "--checkpoint.initial_load_path", str(seed),
        "--checkpoint.interval", "1000", "--checkpoint.last_save_model_only", *SMALL,
        steps=H * OUTER_STEPS, env=env,
    )  # fmt: skip
    for i, step in skipped:
        assert f"step {step}: non-finite loss or gradients; update skipped" in runs[i].output
    losses, final, nbytes = semi_sync_reference(
        model_config, seed, method, 2, per_group, frozenset(skipped)
    )
    for i, run in enumerate(runs):
        assert sorted(run.loss) == list(range(per_group)), run.output[-3000:]
        for got in run.loss.values():
            assert sorted(got) == list(range(1, H * OUTER_STEPS + 1)), run.output[-3000:]
            for step, want in losses[i].items():
                assert got[step] == pytest.approx(want, rel=1e-5, abs=1e-5), (i, step)
        # every rank logs each sync: (rank, method, sync, step, bytes per group)
        syncs = sorted(
            (int(m[1]), m[2], int(m[3]), int(m[4]), int(m[5]))
            for m in MIB_LINE.finditer(run.output)
        )
        outer = range(1, OUTER_STEPS + 1)
        assert syncs == [(r, method, k, k * H, nbytes) for r in range(per_group) for k in outer]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = runs[0].tb_event_files()
    acc = EventAccumulator(events, size_guidance={"scalars": 0})
    acc.Reload()
    tb = [(e.step, e.value) for e in acc.Scalars("ft/outer_sync_mib")]
    assert tb == [(k * H, pytest.approx(nbytes / 2**20)) for k in range(1, OUTER_STEPS + 1)]
    saved = {k: torch.zeros_like(v) for k, v in final.items()}
    last = runs[0].dump_folder / "checkpoint" / f"step-{H * OUTER_STEPS}"
    dcp.load(saved, checkpoint_id=str(last), no_dist=True)
    for name, want in final.items():
        torch.testing.assert_close(saved[name], want, rtol=1e-5, atol=1e-5, msg=name)


def test_gradients_are_averaged_bucket_by_bucket(monkeypatch):
    """The cross-group all-reduce, in buckets of at most BUCKET_BYTES: every gradient
    gets its own averaged values back (a fake Manager halves what it is given, as the
    average of this group's gradient and a zero one would), each dtype apart."""
    import torch

    from boost_titan.train import replicas

    calls = []

    class Work:
        def wait(self):
            return None

    class Manager:
        def allreduce(self, flat, reduce_op):
            calls.append((flat.dtype, flat.numel()))
            flat.mul_(0.5)
            return Work()

    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {n: torch.nn.Linear(k, k, dtype=dt) for n, k, dt in
         [("a", 4, torch.float32), ("b", 8, torch.float32), ("c", 3, torch.bfloat16)]}
    )  # fmt: skip
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    want = {n: p.grad.clone() * 0.5 for n, p in model.named_parameters()}
    groups = replicas.ReplicaGroups.__new__(replicas.ReplicaGroups)
    groups.manager = Manager()
    monkeypatch.setattr(replicas, "BUCKET_BYTES", 8 * 8 * 4)  # b's weight alone fills one
    groups.average_gradients([model])
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, want[n]), n
    assert calls == [(torch.float32, 20), (torch.float32, 64), (torch.float32, 8),
                     (torch.bfloat16, 12)]  # fmt: skip
