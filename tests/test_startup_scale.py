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
mesh dimension, member or not): known, measured by the benchmark. A resume's load of
a step (``integrity.open_step``, then the rank's own files) is counted at 8 and 64
ranks in test_checkpoint_scale.py."""

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


def _collectives(monkeypatch, world: int, differs: bool) -> list[str]:
    """The collectives ``loader.agree`` calls on one rank of a gloo world of ``world``
    ranks, stood in for (rank 0's view is this rank's; ``differs``: another rank's
    is not)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    from boost_titan.data import loader

    calls: list[str] = []

    def all_reduce(t, op=None):
        calls.append("all_reduce")
        t.fill_(int(differs))

    def all_gather_object(out, obj):
        calls.append(f"all_gather_object x{len(out)}")
        out[:] = [obj] * len(out)

    for name, fn in {
        "is_initialized": lambda: True,
        "get_world_size": lambda *a: world,
        "get_backend": lambda *a: "gloo",
        "broadcast_object_list": lambda box, src: calls.append("broadcast_object_list"),
        "all_reduce": all_reduce,
        "all_gather_object": all_gather_object,
    }.items():
        monkeypatch.setattr(dist, name, fn)
    monkeypatch.setattr(distributed_c10d, "_get_object_coll_device", lambda *a: "cpu")
    loader.agree({"seq_len": 16, "corpora": []}, "corpus")
    return calls


def test_data_agreement_receives_one_view_at_any_world(monkeypatch):
    """Every rank's data view is compared with rank 0's before step 1: a rank receives
    rank 0's view and one flag, not every rank's view (which grew with the world)."""
    for world in (8, 1024):
        assert _collectives(monkeypatch, world, False) == ["broadcast_object_list", "all_reduce"]
    # a rank differs: then (only) every view is gathered, for the line that names it
    assert _collectives(monkeypatch, 1024, True)[-1] == "all_gather_object x1024"
