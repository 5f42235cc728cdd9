"""One run per checkpoint folder, and every step bound to the run that saved it (issue
#48, "operators make mistakes"): two runs started on one dump folder corrupted each
other; a step copied in from another run's folder resumed as if it were the folder's.

In-process cases: the folder lock (``boost_titan.checkpoint.lock``) between processes,
freed when its holder dies by SIGKILL even while a child it forked lives on; run ids
(``boost_titan.checkpoint.run_id``) recorded in each step's manifest and compared when
a resume chooses its step (``integrity.resume``). One end-to-end case (one rank, 2
steps): a run refused on a held folder touches nothing; once the holder is gone the
same command resumes another run's step only with ``allow_foreign_steps``."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import PYTHON, REPO_ROOT, run_training
from torch.distributed.checkpoint import FileSystemWriter

from boost_titan.checkpoint import integrity, run_id
from boost_titan.checkpoint import lock as folder_lock
from boost_titan.checkpoint.integrity import resume

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

# a process that holds the lock like a run's rank 0, forks a child that outlives it
# (a data loader worker), says so, and waits to be killed; the child says it runs (its
# fork handler has closed its copy of the lock by then: before it has, a SIGKILL of the
# holder leaves the lock held, which a loaded machine showed)
_HOLDER = """
import os, sys, time
from boost_titan.checkpoint import lock
lock.acquire(sys.argv[1])
child = os.fork()
if child == 0:
    os.write(1, b"child runs\\n")  # one write each: the two lines never interleave
    time.sleep(120)
    os._exit(0)
os.write(1, f"{child}\\n".encode())
time.sleep(120)
"""


def _hold(folder: Path) -> tuple[subprocess.Popen, int]:
    """A holder process of ``folder``'s lock and the pid of the child it forked."""
    proc = subprocess.Popen(
        [PYTHON, "-c", _HOLDER, str(folder)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    lines = sorted(proc.stdout.readline().strip() for _ in range(2))  # (either first)
    assert lines[1] == "child runs", lines
    return proc, int(lines[0])


def _kill(proc: subprocess.Popen, child: int | None = None) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    if child is not None:
        os.kill(child, signal.SIGKILL)


def test_a_second_holder_is_refused_until_the_first_dies(tmp_path):
    folder = str(tmp_path / "dump" / "checkpoint")
    proc, child = _hold(Path(folder))
    try:
        with pytest.raises(folder_lock.FolderRefused) as info:
            folder_lock.acquire(folder)
        line = str(info.value)
        assert "\n" not in line and info.value.code == 1
        assert line.startswith(
            f"checkpoint folder {folder} is in use by another run (host {socket.gethostname()}, "
            f"pid {proc.pid}, started {time.strftime('%Y-%m-%d')} "
        ), line
        assert line.endswith(
            f"lock file {folder}.lock): two runs on one folder set aside, load and delete each "
            "other's steps. Wait until that run ends, or give this one another --job.dump_folder"
        ), line
        assert not os.path.exists(folder)  # the folder itself is not made
        # SIGKILL: the kernel frees the lock, though the child it forked still runs
        _kill(proc)
        os.kill(child, 0)
        held = folder_lock.acquire(folder)
        record = json.loads(Path(held.path).read_text())
        assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
        # one process, a second descriptor: refused too (two managers of one folder)
        with pytest.raises(folder_lock.FolderRefused, match=f"pid {os.getpid()},"):
            folder_lock.acquire(folder)
        held.release()
        folder_lock.acquire(folder).release()
    finally:
        if proc.poll() is None:
            _kill(proc)
        try:
            os.kill(child, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.parametrize(
    "make, what",
    [
        (lambda lock, user: lock.mkdir(), "cannot be made or opened (Is a directory)"),
        (lambda lock, user: os.symlink(user, lock), "is a symbolic link"),
        (lambda lock, user: os.symlink(user.parent / "absent", lock), "is a symbolic link"),
        (lambda lock, user: os.mkfifo(lock), "is a FIFO"),
        (lambda lock, user: os.link(user, lock), "is a file with 2 names (hard links)"),
    ],
    ids=["directory", "symlink", "dangling-symlink", "fifo", "hard-link"],
)
def test_a_lock_file_that_cannot_be_taken_refuses_the_run(tmp_path, make, what):
    """Issue 56, items 5 and 6: a lock file that is a directory let the run go on with a
    warning (two runs then set each other's steps aside), and one that is a symbolic
    link (or a hard link) to a user's file overwrote that file with the lock record.
    Now the run stops on one line naming the lock file and what is wrong with it, before
    the folder is made, and the user's file is untouched (a FIFO does not hang)."""
    from boost_titan.checkpoint.manager import BoostCheckpointManager

    folder = tmp_path / "dump" / "checkpoint"
    folder.parent.mkdir()
    user = tmp_path / "notes.txt"
    user.write_bytes(b"the user's own words\n")
    lock = Path(f"{folder}.lock")
    make(lock, user)
    line = (
        f"checkpoint lock file {lock} {what}: a run holds its checkpoint folder only through "
        "that file, and does not start without it. Make it a plain file this user may write "
        "(or remove it), or give this run another --job.dump_folder"
    )
    with pytest.raises(folder_lock.FolderRefused) as info:
        folder_lock.acquire(str(folder))
    assert str(info.value) == line and info.value.code == 1
    # through the run's manager (rank 0's _hold_folder): refused, not a warning
    manager = BoostCheckpointManager.__new__(BoostCheckpointManager)
    manager.folder = str(folder)
    with pytest.raises(folder_lock.FolderRefused) as info:
        manager._hold_folder()
    assert str(info.value) == line
    assert manager._lock is None
    assert not folder.exists() and not (tmp_path / "absent").exists()
    assert user.read_bytes() == b"the user's own words\n"


def _save(path: Path, step: int) -> Path:
    state = {"w": torch.full((4, 4), float(step)), "train_state": {"step": step}}
    dcp.save(state, storage_writer=FileSystemWriter(path), no_dist=True)
    return path


def _manifest_run(step_dir: Path):
    return json.loads((step_dir / integrity.MANIFEST).read_bytes().split(b"\n")[1]).get("run_id")


def test_a_resume_sets_another_runs_step_aside(tmp_path):
    """A step records its checkpoint folder's run (``run.json``); the resume's choice
    (rank 0's ``_choose``) sets a newer step of another run aside on one line, resumes
    a step from before run ids with a warning, and with allow_foreign_steps resumes
    the other run's step with a warning instead."""
    ours, theirs = tmp_path / "ours" / "checkpoint", tmp_path / "theirs" / "checkpoint"
    mine, other = run_id.new(), run_id.new()
    run_id.write(str(ours), mine)
    run_id.write(str(theirs), other)
    assert run_id.read(str(ours)) == mine
    _save(ours / "step-2", 2)
    _save(tmp_path / "old" / "step-4", 4)  # no run.json: saved "before run ids"
    os.rename(tmp_path / "old" / "step-4", ours / "step-4")
    _save(theirs / "step-6", 6)
    os.rename(theirs / "step-6", ours / "step-6")  # copied in from another run's folder
    assert [_manifest_run(ours / f"step-{n}") for n in (2, 4, 6)] == [mine, None, other]
    assert all(integrity.verify(ours / f"step-{n}") == [] for n in (2, 4, 6))

    outcome = resume._choose(str(ours), None, mine, allow=True)
    assert outcome[:3] == ("ok", True, 6) and outcome[3] == []
    assert outcome[5] == (
        f"checkpoint {ours / 'step-6'} belongs to another run: it was saved by run {other}, "
        f"this checkpoint folder is run {mine} ({ours / 'run.json'}); resumed all the same: "
        "[checkpoint] allow_foreign_steps = true"
    )
    outcome = resume._choose(str(ours), None, mine)
    assert outcome[:3] == ("ok", True, 4)
    [(line, moved)] = outcome[3]
    assert line == (
        f"checkpoint {ours / 'step-6'} belongs to another run: it was saved by run {other}, "
        f"this checkpoint folder is run {mine} ({ours / 'run.json'}) (a step copied in from "
        "another run's folder?); not loaded. Set [checkpoint] allow_foreign_steps = true to "
        "resume it anyway, or start from it on purpose with [checkpoint] initial_load_path "
        "and a new --job.dump_folder"
    )
    assert moved == str(ours / "step_6.corrupt") and (ours / "step_6.corrupt").is_dir()
    # [checkpoint] load_step naming it: refused on the same line, nothing set aside
    os.rename(ours / "step_6.corrupt", ours / "step-6")
    assert resume._named_whose(str(ours / "step-6"), str(ours), mine, False) == line
    assert resume._named_whose(str(ours / "step-6"), str(ours), mine, True) is None
    assert resume._named_whose(str(ours / "step-2"), str(ours), mine, False) is None
    os.rename(ours / "step-6", ours / "step_6.corrupt")
    assert outcome[5] == (
        f"checkpoint {ours / 'step-4'} records no run id (saved before boost_titan recorded "
        "them): resumed as this checkpoint folder's own"
    )
    os.rename(ours / "step-4", tmp_path / "step-4")
    assert resume._choose(str(ours), None, mine)[2:4] == (2, [])  # ours: no remark
    assert resume._choose(str(ours), None, mine)[5] is None
    (ours / "run.json").write_text('{"run_id": "../x"}')
    with pytest.raises(run_id.BadRunFile) as info:
        run_id.read(str(ours))
    assert str(info.value) == (
        f'{ours / "run.json"} is not the run record a run writes ({{"run_id": ...}}, 18 bytes read)'
    )


# ---------------------------------------------------------------- end to end (one rank)


@pytest.mark.slow
def test_a_held_folder_refuses_a_run_and_frees_when_its_holder_dies(seed_checkpoint, tmp_path):
    """A run on a folder another process holds stops at start-up on one line naming
    the holder, exit 1, on both ranks, with nothing in the folder renamed, set aside or
    written. With the holder SIGKILLed the same command runs: the seed step copied into
    this run's folder (its run.json: an earlier start of this run) is another run's (the
    seed checkpoint's run stamped it), so it resumes only with allow_foreign_steps, and
    the step this run saves records the folder's run id."""
    seed = seed_checkpoint("debug_cola.toml")
    dump = tmp_path / "run"
    folder = dump / "checkpoint"
    ours = run_id.new()
    run_id.write(str(folder), ours)
    shutil.copytree(seed, folder / "step-0")
    before = {p.name: p.read_bytes() for p in (folder / "step-0").iterdir()}
    seed_run = _manifest_run(folder / "step-0")
    assert seed_run is not None and seed_run == run_id.read(str(seed.parent))
    args = ("--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "2")
    proc, child = _hold(folder)
    try:
        # two ranks: rank 1 learns of the refusal from rank 0 and stops with it (no hang)
        refused = run_training(
            "debug_cola.toml", 2, dump, *args, "--parallelism.data_parallel_shard_degree", "-1",
            expect_failure=True, timeout=300,
        )  # fmt: skip
    finally:
        _kill(proc, child)
    lines = [ln for ln in refused.output.splitlines() if "is in use by another run" in ln]
    assert [ln.split("]:")[0] for ln in lines] == ["[rank0", "[rank1"], refused.output[-3000:]
    for line in lines:
        assert f"ERROR - checkpoint folder {folder} is in use" in line
        assert f"pid {proc.pid}," in line
    assert "Traceback" not in refused.output and not refused.loss
    assert sorted(p.name for p in folder.iterdir()) == ["run.json", "step-0"]  # no set-aside
    assert {p.name: p.read_bytes() for p in (folder / "step-0").iterdir()} == before

    run = run_training("debug_cola.toml", 1, dump, *args, "--checkpoint.allow_foreign_steps")
    assert (
        f"WARNING - checkpoint {folder / 'step-0'} belongs to another run: it was saved by "
        f"run {seed_run}, this checkpoint folder is run {ours} ({folder / 'run.json'}); "
        "resumed all the same: [checkpoint] allow_foreign_steps = true"
    ) in run.output, run.output[-3000:]
    assert sorted(run.loss[0]) == [1, 2]
    assert run_id.read(str(folder)) == ours and _manifest_run(folder / "step-2") == ours
    assert integrity.verify(folder / "step-2") == []
