"""torchft replica groups (``[fault_tolerance] enable = true``, boost_titan.train.replicas):
groups of gloo ranks, each its own launch, joined by a lighthouse in this process."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from helpers import run_training

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
                *group_args(i, groups, groups, *extra),
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


_DIGEST = re.compile(
    r"\[fault_tolerance\] group (\d+) step (\d+) params ([0-9a-f]+) optimizer ([0-9a-f]+)"
)


def digests(output: str) -> dict[int, str]:
    return {int(m[2]): (m[3], m[4]) for m in _DIGEST.finditer(output)}


def test_a_killed_group_is_waited_for_then_recovers_from_the_live_one(tmp_path, monkeypatch):
    """min_replica_size 2: group 1 is SIGKILLed after step 3; group 0's steps wait (and
    its log says why) until group 1, relaunched, has recovered from it; from then on
    both groups' parameters are bitwise equal step by step, and the job ends as one.
    (The lighthouse forms quorums of one group; min_replica_size decides the commits.)"""
    server = _lighthouse(monkeypatch, 1)
    steps, kill_after = 8, 3
    fast = ("--training.seq_len", "64", "--fault_tolerance.process_group_timeout_ms", "2000")
    common = ("--training.steps", str(steps), "--validation.no-enable", "--boost.profile_freq", "0")
    digest = {"BOOST_TITAN_PARAM_DIGEST": "1"}
    survivor: dict = {}

    def group0() -> None:
        try:
            survivor["run"] = run_training(
                "debug_cola.toml", 1, tmp_path / "group0", *common,
                *group_args(0, 2, 2, *fast), env=digest, timeout=300,
            )  # fmt: skip
        except BaseException as e:
            survivor["error"] = e

    t = threading.Thread(target=group0)
    t.start()
    try:
        killed = run_training(
            "debug_cola.toml", 1, tmp_path / "group1", *common, *group_args(1, 2, 2, *fast),
            env={**digest, "BOOST_TITAN_INJECT": f"sigkill@{kill_after}"},
            expect_failure=True, timeout=600,
        )  # fmt: skip
        assert f"SIGKILL after step {kill_after}" in killed.output
        rejoined = run_training(
            "debug_cola.toml", 1, tmp_path / "group1b", *common, *group_args(1, 2, 2, *fast),
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
    a, b = digests(alive.output), digests(rejoined.output)
    assert sorted(b) == list(range(recovered, steps + 1))
    for step in b:
        assert a[step] == b[step], step
    # before the kill, the killed run agreed with the survivor too
    k = digests(killed.output)
    assert sorted(k) == list(range(1, kill_after + 1))
    assert all(a[s] == k[s] for s in k)
    # the same losses from the recovery step on (the job's loss, averaged over groups)
    for step in range(recovered + 1, steps + 1):
        assert rejoined.loss[0][step] == alive.loss[0][step], step
    # and nothing was lost: the waits and the recovery trained exactly what a run without
    # a failure trains (each step once, on its own windows)
    reference = run_training(
        "debug_cola.toml", 2, tmp_path / "dp2", *common, "--training.seq_len", "64",
        "--parallelism.data_parallel_shard_degree", "2",
    )  # fmt: skip
    for step in range(1, steps + 1):
        want = reference.loss[0][step]
        assert alive.loss[0][step] == pytest.approx(want, rel=1e-5, abs=1e-5), step
