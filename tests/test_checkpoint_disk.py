"""A checkpoint save that fails on the disk (boost_titan.checkpoint.save) and the
start-time space check (boost_titan.checkpoint.space).

* injection, BTP TP2 from the shared seed, saves at steps 2 and 4,
  ``BOOST_TITAN_INJECT=enospc@4:rank=1``: one line with ENOSPC, the file and rank, the
  bytes needed (checked against the size of the step-2 folder the same run wrote) and
  free, the previous checkpoint (step-2, which still exports); no step-4 folder left;
  a non-zero exit; no trace of torch's ``enforce fail``;
* a real 40 MiB tmpfs (where this machine lets the test mount one; skipped where it
  does not, the injection covering the logic): the README's default run as a user
  would start it there, saving at step 2: the start-time warning (one checkpoint is
  ~64 MiB), then the real ENOSPC line, the free bytes exactly what ``statvfs`` says;
* in-process: the guarded file turns torch's ``unexpected pos`` back into the OS
  error, the errno inferred from free space where it is lost, the other errnos named,
  the planned saves, and torchtitan's pipeline-loss warning gone."""

from __future__ import annotations

import errno
import io
import os
import re
import subprocess

import pytest
import torch
from helpers import REPO_ROOT, run_main, run_training

from boost_titan.checkpoint import save as checkpoint_save
from boost_titan.checkpoint import space as checkpoint_space
from boost_titan.train import fault

CONFIG = "debug_cola_btp_tp2.toml"
NUM = r"([\d,]+) bytes"
ERROR_LINE = re.compile(
    r"\[rank0\]:.*ERROR - checkpoint save of step (\d+) failed: (E[A-Z]+) \(([^)]*)\) "
    r"(?:writing (.+?)|on ranks? [\d, ]+); the partial folder (\S+) was removed\. "
    r"The checkpoint "
    rf"needs {NUM} \([\d.]+ MiB\); (\S+) has {NUM} \([\d.]+ [MG]iB\) free now \(os\.statvfs\)\. "
    r"(.*)\. To go on: free space on that filesystem"
)
ESTIMATE = re.compile(rf"\[rank0\]:.*checkpoint space: one checkpoint takes ~{NUM}")

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
]


def _n(s: str) -> int:
    return int(s.replace(",", ""))


def _folder_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


@pytest.mark.slow
def test_injected_enospc_is_one_line_and_keeps_the_previous_checkpoint(
    seed_checkpoint, tmp_path, monkeypatch
):
    monkeypatch.setenv(fault.INJECT_ENV, "enospc@4:rank=1")
    run = run_training(
        CONFIG,
        2,
        tmp_path / "inj",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed_checkpoint("debug_cola.toml")),
        "--checkpoint.interval",
        "2",
        "--training.steps",
        "4",
        "--validation.no-enable",
        expect_failure=True,
    )
    out = run.output
    folder = tmp_path / "inj" / "checkpoint"
    # rank 0's log lists the injection that fires on rank 1; rank 1 says when it fires
    assert re.search(
        r"\[rank0\]:.*faults will be injected: the save of step 4 fails with ENOSPC on rank 1",
        out,
    )
    assert not re.search(r"\[rank1\]:.*faults will be injected", out)
    assert re.search(rf"\[rank1\]:.*\[inject\] rank 1: ENOSPC while writing {folder}/step-4/", out)

    m = ERROR_LINE.search(out)
    assert m, out[-4000:]
    step, name, strerror, files, partial, needed, fs, free, previous = m.groups()
    assert (step, name, files) == ("4", "ENOSPC", "__1_0.distcp (rank 1)")
    assert strerror == "No space left on device [injected: BOOST_TITAN_INJECT]"
    assert partial == str(folder / "step-4") and fs == str(folder)
    assert previous == (
        f"Previous checkpoint: {folder}/step-2 (intact: a failed save touches no other step); "
        "rerun the same command to resume from step 2"
    )
    # the failed step's checkpoint holds what step 2's does: its size is the reference
    on_disk = _folder_bytes(folder / "step-2")
    assert abs(_n(needed) - on_disk) < 0.01 * on_disk, (needed, on_disk)
    estimate = _n(ESTIMATE.search(out).group(1))  # at start, optimizer state predicted
    assert abs(estimate - on_disk) < 0.01 * on_disk, (estimate, on_disk)
    st = os.statvfs(folder)
    assert 0 < _n(free) <= st.f_blocks * st.f_frsize

    # the partial step-4 is gone (beside step-2: the run's initial_load_path record and
    # its run id)
    assert sorted(os.listdir(folder)) == ["initial_load.json", "run.json", "step-2"]
    assert "enforce fail" not in out and "unexpected pos" not in out
    assert "Traceback" not in out and "CheckpointException" not in out
    assert sorted(run.loss[0]) == [1, 2, 3, 4]  # it stopped at step 4's save

    # step-2 is whole: it loads (the consolidated export reads every tensor)
    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        "export",
        "--from",
        str(folder / "step-2"),
        "--to",
        str(tmp_path / "step2.safetensors"),
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / CONFIG),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "step2.safetensors").stat().st_size > 0.25 * on_disk  # weights: ~1/3


@pytest.fixture
def tmpfs_40m(tmp_path):
    mnt = tmp_path / "fs40m"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        pytest.skip(
            f"cannot mount a 40 MiB tmpfs here ({(proc.stderr or proc.stdout).strip()}); "
            "the injected ENOSPC test covers the same path"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.slow
def test_real_full_disk_warns_at_start_and_fails_on_one_line(corpus_dir, tmpfs_40m):
    # the dump folder is the mount point itself: the test launcher's logs go beside it
    run = run_training(
        CONFIG,
        2,
        tmpfs_40m,
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--training.steps",
        "4",
        "--validation.no-enable",
        expect_failure=True,
    )
    out = run.output
    folder = tmpfs_40m / "checkpoint"
    warn = re.search(
        rf"\[rank0\]:.*WARNING - checkpoint space: one checkpoint takes ~{NUM} .*-> ~{NUM} "
        rf"\([\d.]+ MiB\) needed; {folder}'s filesystem has {NUM} \([\d.]+ MiB\) free: NOT "
        "ENOUGH: a save will fail with ENOSPC",
        out,
    )
    assert warn, out[-4000:]
    one, needed_all, free_at_start = (_n(g) for g in warn.groups())
    assert one > 40 * 2**20 and needed_all == 2 * one  # saves at steps 2 and 4, both kept
    assert 39 * 2**20 < free_at_start <= 40 * 2**20

    m = ERROR_LINE.search(out)
    assert m, out[-4000:]
    step, name, strerror, files, partial, needed, _fs, free, previous = m.groups()
    assert (step, name, strerror) == ("2", "ENOSPC", "No space left on device")  # the real one
    # each rank that hit the full disk: its file, or (a race: an OSError without a
    # file name) "an unnamed file on rank R"; at least one file named
    # (None: no rank's OSError named a file, the line says "on rank(s) R")
    parts = (files or "").split(", ")
    named = [p for p in parts if re.fullmatch(r"__(\d)_0\.distcp \(rank \1\)", p)]
    unnamed = [p for p in parts if re.fullmatch(r"an unnamed file on ranks? [01](, 1)?", p)]
    assert files is None or (named and len(named) + len(unnamed) == len(parts)), files
    assert partial == str(folder / "step-2")
    assert abs(_n(needed) - one) < 0.01 * one
    st = os.statvfs(tmpfs_40m)
    # after the line, only the TensorBoard files' last flush (at close) wrote there
    assert 0 <= _n(free) - st.f_bavail * st.f_frsize < 2**20, (free, st.f_bavail * st.f_frsize)
    assert previous.startswith("No previous checkpoint in this folder")
    assert os.listdir(folder) == ["run.json"]  # (the run's id, written before its first save)
    assert "enforce fail" not in out and "Traceback" not in out
    assert sorted(run.loss[0]) == [1, 2]


# ---------------------------------------------------------------- in-process


class _FullDisk(io.RawIOBase):
    """A file on a disk that takes ``room`` bytes, then raises ENOSPC."""

    def __init__(self, room: int):
        self.room, self.data = room, bytearray()

    def writable(self) -> bool:
        return True

    def write(self, b) -> int:
        b = bytes(b)
        if len(self.data) + len(b) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.data += b
        return len(b)


def test_guarded_file_names_the_error_torch_save_hides(tmp_path):
    t = torch.arange(100_000, dtype=torch.float32)
    # the problem: torch.save into a file whose write fails reports a zip position
    with pytest.raises(RuntimeError, match="unexpected pos|PytorchStreamWriter failed"):
        torch.save(t, _FullDisk(4096))

    from torch.distributed.checkpoint.filesystem import FileSystem

    step7 = tmp_path / "step-7"
    step7.mkdir()
    checkpoint_save.install_guarded_files(rank=0, enospc_steps={7})
    try:
        with pytest.raises(OSError) as caught:
            with FileSystem().create_stream(step7 / "__0_0.distcp", "wb") as f:
                torch.save(t, f)
        assert caught.value.errno == errno.ENOSPC
        assert caught.value.filename == str(step7 / "__0_0.distcp")
        assert isinstance(caught.value.__cause__, RuntimeError)  # torch's message, kept below
        assert (step7 / "__0_0.distcp").stat().st_size == checkpoint_save.INJECTED_BUDGET
        # a file that fits the injected budget fails when closed; other steps are untouched
        with pytest.raises(OSError, match="No space left on device"):
            with FileSystem().create_stream(step7 / ".metadata.tmp", "wb") as f:
                f.write(b"x")
                f.close()
        (tmp_path / "step-8").mkdir()
        with FileSystem().create_stream(tmp_path / "step-8" / "__0_0.distcp", "wb") as f:
            torch.save(t, f)
        assert torch.equal(torch.load(tmp_path / "step-8" / "__0_0.distcp"), t)
    finally:
        checkpoint_save.install_guarded_files(rank=0, enospc_steps=set())


def test_errno_named_or_inferred_and_other_errors_left_alone():
    from torch.distributed.checkpoint.api import CheckpointException

    def exc(**per_rank):
        return CheckpointException("write", {int(r[1:]): (e, None) for r, e in per_rank.items()})

    denied = exc(r1=PermissionError(errno.EACCES, "Permission denied", "/ck/step-3/__1_0.distcp"))
    errors, agreed = checkpoint_save.disk_errors(denied)
    assert agreed and list(errors) == [1]
    assert checkpoint_save.describe(errors, 10**9, 10**6) == (
        "EACCES",
        "EACCES (Permission denied) writing __1_0.distcp (rank 1)",
    )
    quota = OSError(errno.EDQUOT, "Disk quota exceeded", "/ck/step-3/__0_0.distcp")
    assert checkpoint_save.describe({0: quota}, 0, 1)[0] == "EDQUOT"
    # a rank whose OSError names no file (seen on a real full tmpfs: 'None (rank 1)')
    full = OSError(errno.ENOSPC, "No space left on device", "/ck/step-2/__0_0.distcp")
    bare = OSError(errno.ENOSPC, "No space left on device")
    assert checkpoint_save.describe({0: full, 1: bare}, 0, 1)[1] == (
        "ENOSPC (No space left on device) writing __0_0.distcp (rank 0), an unnamed file on rank 1"
    )
    assert checkpoint_save.describe({1: bare}, 0, 1)[1] == (
        "ENOSPC (No space left on device) on rank 1"
    )

    lost = exc(
        r0=RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    )
    errors, _ = checkpoint_save.disk_errors(lost)
    name, what = checkpoint_save.describe(errors, free_after_failure=5, still_to_write=1000)
    assert name == "ENOSPC" and "inferred from 5 bytes (0.0 MiB) free" in what
    name, what = checkpoint_save.describe(errors, free_after_failure=10**9, still_to_write=1000)
    assert name == "an unnamed I/O error" and "not a full disk" in what

    assert checkpoint_save.disk_errors(exc(r0=ValueError("bad plan"))) is None
    assert checkpoint_save.disk_errors(ValueError("no")) is None


def test_planned_saves_and_injection_spec():
    assert checkpoint_space.planned_saves(0, 4, 2, False) == [2, 4]
    assert checkpoint_space.planned_saves(0, 5, 2, True) == [1, 2, 4, 5]
    assert checkpoint_space.planned_saves(4, 8, 2, True) == [6, 8]  # resumed after step 4
    assert checkpoint_space.planned_saves(8, 8, 2, False) == []
    (i,) = fault.parse_injections("enospc@4:rank=1")
    assert fault.describe_injection(i) == "the save of step 4 fails with ENOSPC on rank 1"


def test_pipeline_loss_warning_is_gone(monkeypatch, caplog):
    """torchtitan warns that the PP loss is invisible unless LOG_RANK names the last
    stage; boost_titan logs the last stage's loss on every rank, so it is dropped."""
    from types import SimpleNamespace

    import torchtitan.train
    from torchtitan.components import metrics
    from torchtitan.tools.utils import NoColor

    import boost_titan.train.trainer

    boost_titan.train.trainer.install()  # what the trainer's main() runs first
    monkeypatch.setenv("LOG_RANK", "0")
    dims = SimpleNamespace(world_size=2, pp=2)
    config = SimpleNamespace(parallelism=SimpleNamespace(pipeline_parallel_schedule="1F1B"))
    with caplog.at_level("WARNING"):
        metrics.ensure_pp_loss_visible(dims, config, NoColor())  # torchtitan's own
    assert "Pipeline Parallel loss is not visible" in caplog.text
    caplog.clear()
    assert torchtitan.train.ensure_pp_loss_visible is boost_titan.train.trainer._pp_loss_is_visible
    with caplog.at_level("WARNING"):
        torchtitan.train.ensure_pp_loss_visible(dims, config, NoColor())
    assert caplog.text == ""


def _gather_worker(rank: int, init: str, out: str) -> None:
    """Two pipeline stages of two ranks each, two data-parallel ranks per stage."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=4)
    stage, dp = divmod(rank, 2)
    items = {
        f"layers.{stage}.w": checkpoint_space.Item(100 * (stage + 1), 2, 4),
        f"optimizer.state.layers.{stage}.w.exp_avg": checkpoint_space.Item(100, 2, 4),
        "lr_scheduler.last_epoch": checkpoint_space.Item(12, 1),
        f"dataloader.dp_rank_{dp}": checkpoint_space.Item(50 + dp, 1),
    }
    sources = []
    broadcast = dist.broadcast_object_list

    def counted(objects, src=None, **kwargs):
        sources.append(src)
        return broadcast(objects, src=src, **kwargs)

    dist.broadcast_object_list = counted
    merged = checkpoint_space.global_items(items)
    with open(f"{out}.{rank}", "w") as f:
        json.dump(
            {"merged": {k: list(v.__dict__.values()) for k, v in merged.items()}, "from": sources},
            f,
        )
    dist.destroy_process_group()


def test_the_space_estimate_sends_each_distinct_table_once(tmp_path):
    """Every rank ends with every rank's items (the merged table the estimate sums), but
    only one rank of each pipeline stage sends its table (ranks of a stage hold the
    same one); the per-data-parallel-rank keys come from every rank."""
    import json

    from launcher import spawn

    spawn(_gather_worker, (str(tmp_path / "init"), str(tmp_path / "out")), 4)
    results = [json.loads((tmp_path / f"out.{r}").read_text()) for r in range(4)]
    want = {
        "layers.0.w": [100, 2, 4],
        "layers.1.w": [200, 2, 4],
        "optimizer.state.layers.0.w.exp_avg": [100, 2, 4],
        "optimizer.state.layers.1.w.exp_avg": [100, 2, 4],
        "lr_scheduler.last_epoch": [12, 1, 0],
        "dataloader.dp_rank_0": [50, 1, 0],
        "dataloader.dp_rank_1": [51, 1, 0],
    }
    for r in results:
        assert r == {"merged": want, "from": [0, 2]}
