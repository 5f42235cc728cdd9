"""Issue #48: what one rank does at start-up does not grow with the world size.

``benchmarks/startup_scale.py`` runs a rank's start-up phases (config check, device
mesh, model build + TP/FSDP2, local shards + optimizers, data loader and its first
batch, checkpoint folder) in a fresh process per world size, on the dry run's fake
process group. Here the debug CoLA model (BTP TP2 x FSDP) at 8 and 64 ranks: every
phase of ours makes the same file system calls and creates no process group, and the
rank joins the same process groups, at both sizes. Counts, not seconds: a phase that
starts doing something per rank (a listing per rank's file, a group per rank, a
gather) fails here deterministically.

Not asserted: the device mesh *creates* more groups at 64 ranks (torch's DeviceMesh,
on a backend without a bound device, calls ``new_group`` for every subgroup of every
mesh dimension, member or not), and a resume's load of a step opens every rank's file
(``integrity.open_step``; docs/checkpoints.md): both known, both measured by the
benchmark."""

from __future__ import annotations

import sys

from helpers import REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import startup_scale  # noqa: E402

CONFIG = "train_configs/debug_cola_btp_tp2_fsdp2.toml"
OURS = ("config", "model", "shards", "data", "folder")


def _rank0(world: int, dump) -> dict:
    return startup_scale.child_line(["--config", CONFIG, "--child", str(world), "--",
                                     "--parallelism.data_parallel_shard_degree", "-1",
                                     "--job.dump_folder", str(dump)])  # fmt: skip


def test_start_up_counts_do_not_grow_with_the_world(tmp_path):
    small, large = _rank0(8, tmp_path / "w8"), _rank0(64, tmp_path / "w64")
    for phase in OURS:
        assert small[phase]["fs"] == large[phase]["fs"], phase
        assert small[phase]["made"] == large[phase]["made"] == 0, phase
        assert small[phase]["joined"] == large[phase]["joined"] == 0, phase
    assert small["mesh"]["fs"] == large["mesh"]["fs"]
    assert small["mesh"]["joined"] == large["mesh"]["joined"] > 0  # the rank's groups
    assert ".metadata" not in small  # (no step in a new dump folder: nothing loaded)
