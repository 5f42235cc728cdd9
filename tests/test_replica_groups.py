"""torchft replica groups (``[fault_tolerance] enable = true``, boost_titan.train.replicas):
groups of gloo ranks, each its own launch, joined by a lighthouse in this process."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from helpers import run_training

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
