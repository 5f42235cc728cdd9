"""Issue #48, what a sealed step costs as it grows: each rank encodes its own files'
sections of the manifest (the coordinator joins bytes), a rank reads and checks the
manifest's root and only the sections of the files it reads, and checks each file it
reads once (an lstat; realpath only for a link or a nested name): what it parses and
the file system calls it makes are the same at 8 and 64 ranks; a damaged section is
noticed by the rank that reads its file, no other; the garbage collector is paused while
a step is parsed and back on after, nothing parsed is kept once a load ends; and the
benchmark that measures it runs (small)."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from helpers import REPO_ROOT
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from boost_titan.checkpoint import integrity
from boost_titan.checkpoint.integrity import dcp_hooks, manifest, step, step_files

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(64, 300, generator=g) for i in range(6)}


def _save(path: Path, **writer) -> Path:
    dcp.save(_state(), storage_writer=FileSystemWriter(path, **writer), no_dist=True)
    return path


class _Counted:
    """Counts calls to os.lstat, os.stat and os.path.realpath (restored on exit)."""

    def __enter__(self) -> dict:
        self.count = {"lstat": 0, "stat": 0, "realpath": 0}
        self.saved = [(os, "lstat"), (os, "stat"), (os.path, "realpath")]
        self.real = [getattr(owner, name) for owner, name in self.saved]
        for (owner, name), real in zip(self.saved, self.real):
            setattr(owner, name, self._counting(name, real))
        return self.count

    def _counting(self, name, real):
        def counted(*a, **k):
            self.count[name] += 1
            return real(*a, **k)

        return counted

    def __exit__(self, *exc) -> None:
        for (owner, name), real in zip(self.saved, self.real):
            setattr(owner, name, real)


def test_ranks_encode_their_parts_and_the_manifest_lists_every_item(tmp_path):
    """Two files from one rank (two writer threads): one part, every item listed; a
    step opens and loads as before."""
    folder = _save(tmp_path / "step-3", thread_count=2)
    seal = integrity.open_step(folder, whole=True).seal
    assert {f for f in seal.files} == {".metadata", "__0_0.distcp", "__0_1.distcp"}
    assert sorted(fqn for fqn, _ in seal.items) == sorted(_state())
    back = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(back, checkpoint_id=str(folder), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in _state().items())


def _results(ranks: int) -> list[list[WriteResult]]:
    """Every rank's write results as the coordinator gathers them (our digests on)."""
    out = []
    for r in range(ranks):
        info = _StorageInfo(f"__{r}_0.distcp", 0, 10)
        info.__dict__[dcp_hooks._DIGESTS] = ([10], bytes(8))
        out.append([WriteResult(MetadataIndex(f"w{r}", torch.Size([0])), 10, info)])
    return out


def test_the_coordinator_joins_the_ranks_parts_or_refuses_the_save(tmp_path):
    """Every rank's part joined in one manifest; a rank without one (its writes not all
    digested): the save refused in one line, no ``.metadata`` (issue #48: it was written
    as plain DCP without a word)."""
    from torch.distributed.checkpoint.metadata import Metadata

    for case, parted in (("joined", [0, 1, 2]), ("refused", [0, 2])):
        folder = tmp_path / case / "step-1"
        folder.mkdir(parents=True)
        writer = FileSystemWriter(folder)
        writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        results = [
            dcp_hooks._with_part(wrs) if r in parted else wrs for r, wrs in enumerate(_results(3))
        ]
        if case == "refused":
            with pytest.raises(integrity.ChecksumMismatch, match="1 of its 3 writing ranks"):
                dcp_hooks.finish(writer, Metadata({}), results)
            assert not (folder / ".metadata").exists()
            assert not (folder / manifest.NAME).exists()
            continue
        dcp_hooks.finish(writer, Metadata({}), results)
        meta = (folder / ".metadata").read_bytes()
        assert dcp_hooks._DIGESTS.encode() not in meta and dcp_hooks._PART.encode() not in meta
        seal = manifest.decode((folder / manifest.NAME).read_bytes(), str(folder))
        assert sorted(seal.items) == [("w0", (0,)), ("w1", (0,)), ("w2", (0,))]
        assert seal.files["__1_0.distcp"].bytes == 10


def test_a_rank_checks_each_file_once_and_keeps_nothing_after_the_load(tmp_path):
    folder = _save(tmp_path / "step-5", thread_count=2)
    step.release()
    with _Counted() as calls:
        integrity.open_step(folder)
    files = 3  # .metadata and two data files
    # the folder (and realpath's lstats of it, for the parse's key), the manifest's and
    # .metadata's signatures, then one lstat per file: none of it twice per file
    assert calls["stat"] == 0 and calls["realpath"] == 1
    assert calls["lstat"] <= files + 4 + len(Path(os.path.realpath(folder)).parts)
    assert step._parsed  # kept while the load goes on (opened again by its readers)
    integrity.release()
    assert not step._parsed


def test_a_link_inside_the_step_is_read_and_one_out_of_it_refused(tmp_path):
    """The one-lstat check still resolves links: a data file that is a link to a file
    inside the step opens; one to a copy outside it is refused."""
    folder = _save(tmp_path / "step-6")
    data = folder / "__0_0.distcp"
    data.rename(folder / "moved.bin")
    data.symlink_to("moved.bin")
    opened = integrity.open_step(folder)
    opened.reading("__0_0.distcp")  # (as a load checks each file it reads, before it opens it)
    assert opened.trust == "sealed"
    (tmp_path / "outside.bin").write_bytes((folder / "moved.bin").read_bytes())
    data.unlink()
    data.symlink_to(tmp_path / "outside.bin")
    step.release()
    with pytest.raises(integrity.ChecksumMismatch, match="outside the step folder"):
        integrity.open_step(folder).reading("__0_0.distcp")
    with pytest.raises(integrity.ChecksumMismatch, match="outside the step folder"):
        integrity.open_step(folder, whole=True)  # (verify's: every file)


def test_the_collector_is_back_on_after_a_parse_that_fails(tmp_path):
    folder = _save(tmp_path / "step-7")
    raw = (folder / manifest.NAME).read_bytes()
    assert gc.isenabled()
    with pytest.raises(integrity.ChecksumMismatch):
        manifest.decode(raw[:-5] + b"xxxx\n", str(folder))
    with pytest.raises(integrity.ChecksumMismatch):
        step._unpickle(str(folder), b"not a pickle", "")
    assert gc.isenabled()
    gc.disable()  # (left as it was found: off stays off)
    try:
        manifest.decode(raw, str(folder))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_scale_benchmark_runs_small(tmp_path):
    proc = subprocess.run(
        [sys.executable, "benchmarks/checkpoint_scale.py", "--items", "480", "--files", "8"],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for line in ("coordinator at save", "one rank at load", "fs calls", "ours/plain"):
        assert line in proc.stdout, proc.stdout


sys.path.insert(0, str(REPO_ROOT / "benchmarks"))
import checkpoint_scale  # noqa: E402


class _Read:
    """Counts the bytes read from ``.manifest.json``: all of them (os.pread, how a step's
    manifest is read: ``step_files``) and its sections' (``step_files._Source``), and
    file system calls (``checkpoint_scale.Calls``)."""

    def __enter__(self):
        self.real, self.source, self.bytes, self.sections = os.pread, step_files._Source, 0, 0
        self._calls = checkpoint_scale.Calls()
        self.count = self._calls.__enter__()
        read = self

        def pread(fd, n, at):
            got = read.real(fd, n, at)
            if os.readlink(f"/proc/self/fd/{fd}").endswith(manifest.NAME):
                read.bytes += len(got)
            return got

        class Source(step_files._Source):
            def __call__(self, start, n, bad):
                got = super().__call__(start, n, bad)
                read.sections += len(got)
                return got

        os.pread, step_files._Source = pread, Source
        return self

    def __exit__(self, *exc) -> None:
        os.pread, step_files._Source = self.real, self.source
        self._calls.__exit__(*exc)


def _rank_opens(folder: Path, rank: int) -> dict:
    """What one rank's load of a synthesized step does before it reads an item: the step
    opened, then its own file checked and its section read (``Step.reading``)."""
    step.release()  # (a fresh rank)
    with _Read() as read:
        opened = integrity.open_step(folder)
        opened.reading(f"__{rank}_0.distcp")
    calls, rest = dict(read.count), read.bytes - read.sections
    step.release()
    return {"calls": calls, "items": len(opened.seal.items), "sections": read.sections}, rest


def test_a_rank_parses_its_share_not_the_world(tmp_path):
    """Issue #48: a rank's open for its load parses the manifest's root and its own
    file's section: the items it parses, the section bytes it reads and its file
    system calls are the same for a step of 8 ranks and one of 64 (only the root, an
    entry per file, grows with the world); ``verify`` still reads every section."""
    got = {}
    for ranks in (8, 64):
        folder = tmp_path / f"w{ranks}" / "step-3"
        folder.mkdir(parents=True)
        checkpoint_scale.sealed_step(folder, 2, ranks)  # 2 tensors x 3 states per file
        got[ranks] = [_rank_opens(folder, r) for r in (0, ranks - 1)]
        whole = integrity.open_step(folder, whole=True)
        assert len(whole.seal.items) == 6 * ranks and len(whole.sizes) == ranks + 1
        step.release()
    for (small, root8), (large, root64) in zip(got[8], got[64]):
        # the same calls, the same 6 items parsed, from sections of the same size (but
        # for the digits of larger offsets and file numbers)
        assert small["calls"] == large["calls"] and small["items"] == large["items"] == 6
        assert 0 < small["sections"] <= large["sections"] < 1.05 * small["sections"]
        # a handful, whatever the world: realpath's lstats walk the folder's path (one
        # per component: pytest's tmp_path is deeper under xdist), then a few per file
        calls = dict(small["calls"])
        assert calls.pop("lstat") <= len(folder.parts) + 5 and sum(calls.values()) <= 5, small
        # the rest: the header and root (the first read is 4 KiB), a line per file
        assert root64 - max(root8, 4096) < 150 * 64, (root8, root64)


def test_a_damaged_section_is_noticed_by_the_rank_that_reads_its_file(tmp_path):
    """A byte flipped in the section of one rank's file: a rank that reads another file
    loads (it never reads that section); the rank that reads it is refused in one
    line, before it opens the file; ``verify`` names it too."""
    folder = tmp_path / "step-3"
    folder.mkdir()
    checkpoint_scale.sealed_step(folder, 2, 8)
    raw = (folder / manifest.NAME).read_bytes()
    head, root, _ = raw.split(b"\n", 2)
    start, length = json.loads(root)["sections"]["__5_0.distcp"][:2]
    at = len(head) + len(root) + 2 + start + length // 2
    damaged = bytearray(raw)
    damaged[at] ^= 0x01
    (folder / manifest.NAME).write_bytes(bytes(damaged))
    step.release()
    for rank in (0, 4, 6):
        integrity.open_step(folder).reading(f"__{rank}_0.distcp")
    with pytest.raises(integrity.ChecksumMismatch) as info:
        integrity.open_step(folder).reading("__5_0.distcp")
    line = str(info.value)
    assert line.startswith(
        f"checkpoint {folder} is corrupted: its .manifest.json section of __5_0.distcp: xxh3_64 "
    )
    assert "\n" not in line and line.endswith("; not loaded"), line
    assert integrity.verify(folder) == [line.removesuffix("; not loaded")]
    step.release()


def test_a_rank_that_loads_one_file_reads_no_other_section(tmp_path):
    """A real DCP load of the items of one file of a two-file step whose other file's
    section is damaged loads them; a load of every item is refused in one line."""
    folder = _save(tmp_path / "step-8", thread_count=2)
    whole = integrity.open_step(folder, whole=True).seal
    first = sorted({e.fqn for e in whole.items.values() if e.file == "__0_0.distcp"})
    assert first and len(first) < len(_state())
    raw = (folder / manifest.NAME).read_bytes()
    head, root, _ = raw.split(b"\n", 2)
    start, length = json.loads(root)["sections"]["__0_1.distcp"][:2]
    damaged = bytearray(raw)
    damaged[len(head) + len(root) + 2 + start + length // 2] ^= 0x01
    (folder / manifest.NAME).write_bytes(bytes(damaged))
    step.release()
    back = {k: torch.zeros_like(_state()[k]) for k in first}
    dcp.load(back, checkpoint_id=str(folder), no_dist=True)
    assert all(torch.equal(back[k], _state()[k]) for k in first)
    step.release()
    with pytest.raises(BaseException) as info:
        dcp.load({k: torch.zeros_like(v) for k, v in _state().items()}, checkpoint_id=str(folder),
                 no_dist=True)  # fmt: skip
    line = str(integrity.mismatch_in(info.value))
    assert "its .manifest.json section of __0_1.distcp: xxh3_64" in line and "\n" not in line
    step.release()


def test_the_launch_check_parses_no_item(tmp_path, monkeypatch):
    """The launch-time config check (``config_check.checkpoint._missing`` ->
    ``folder.missing_states`` -> ``open_step``) reads the manifest's root and
    ``.metadata`` (its digest checked before it is unpickled), no section: no item
    parsed, the same file system calls at 8 and 64 ranks on every rank; the first also
    lists the folder once (no call per file), so a lost file is refused at launch."""
    from boost_titan.train.config_check.checkpoint import _missing

    calls = {}
    real_unpickle = step._unpickle

    def no_unpickle(*args):
        raise AssertionError("the launch check unpickled .metadata")

    for ranks in (8, 64):
        folder = tmp_path / f"w{ranks}" / "step-3"
        folder.mkdir(parents=True)
        checkpoint_scale.sealed_step(folder, 2, ranks)
        for rank in ("5", "0"):
            monkeypatch.setenv("RANK", rank)
            step.release()
            monkeypatch.setattr(step, "_unpickle", no_unpickle)  # the root's states
            with _Read() as read:
                missing = _missing(str(folder), (), "initial_load_path", str(folder))
            monkeypatch.setattr(step, "_unpickle", real_unpickle)
            assert "optimizer" not in missing and read.sections == 0
            calls[ranks, rank] = dict(read.count)
        # the states the root records are the ones .metadata holds (the load's open)
        opened = integrity.open_step(folder)
        assert set(opened.seal.states) == opened.training_states == {"model", "optimizer"}
        assert opened.seal.items == {}  # (no section read)
        step.release()
    assert calls[8, "5"] == calls[64, "5"], calls
    # the first rank: the same calls for 64 data files as for 8, one listing more
    assert calls[8, "0"] == calls[64, "0"], calls
    assert calls[8, "0"]["scandir"] == 1 and calls[8, "5"].get("scandir", 0) == 0, calls
    meta = folder / ".metadata"  # a flipped byte: the first rank refuses it at launch
    clean = meta.read_bytes()
    meta.write_bytes(clean[:-1] + bytes([clean[-1] ^ 1]))
    step.release()
    with pytest.raises(ValueError) as info:
        _missing(str(folder), (), "initial_load_path", str(folder))
    assert ".metadata: xxh3_64 " in str(info.value) and "\n" not in str(info.value)
    monkeypatch.setenv("RANK", "5")  # (the others' loads check it before unpickling)
    step.release()
    assert "optimizer" not in _missing(str(folder), (), "initial_load_path", str(folder))
    meta.write_bytes(clean)
    monkeypatch.setenv("RANK", "0")
    (folder / "__63_0.distcp").unlink()
    step.release()
    with pytest.raises(ValueError) as info:
        _missing(str(folder), (), "initial_load_path", str(folder))
    assert "names a damaged checkpoint" in str(info.value) and "__63_0.distcp" in str(info.value)
    assert "\n" not in str(info.value)
    monkeypatch.setenv("RANK", "5")  # (another rank: found when its load reaches the file)
    step.release()
    assert "optimizer" not in _missing(str(folder), (), "initial_load_path", str(folder))
    step.release()
    # a manifest that records no states (saved before they were): .metadata unpickled
    folder = tmp_path / "w8" / "step-3"
    seal = manifest.decode((folder / manifest.NAME).read_bytes(), str(folder))
    seal.states = None
    (folder / manifest.NAME).write_bytes(manifest.encode_v1(seal))
    assert "optimizer" not in _missing(str(folder), (), "initial_load_path", str(folder))
    assert integrity.open_step(folder).seal.states is None
    step.release()


def test_a_seal_1_step_still_loads_and_verifies(tmp_path):
    """A step whose manifest is a seal/1 one (one body: steps saved before seal/2) opens,
    loads and verifies as before, every item parsed at the open; a flipped byte in its
    body is one line."""
    folder = _save(tmp_path / "step-9", thread_count=2)
    path = folder / manifest.NAME
    seal = manifest.decode(path.read_bytes(), str(folder))
    path.write_bytes(manifest.encode_v1(seal))
    assert path.read_bytes().startswith(b'{"seal":"boost_titan.seal/1"')
    step.release()
    opened = integrity.open_step(folder)
    assert opened.seal.sections is None and len(opened.seal.items) == len(_state())
    back = {k: torch.zeros_like(v) for k, v in _state().items()}
    dcp.load(back, checkpoint_id=str(folder), no_dist=True)
    assert all(torch.equal(back[k], v) for k, v in _state().items())
    assert integrity.verify(folder) == []
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    step.release()
    (line,) = integrity.verify(folder)
    assert line.startswith(f"checkpoint {folder} is corrupted: its .manifest.json body has "), line


def test_a_damaged_root_or_a_cut_manifest_is_refused_at_the_open(tmp_path):
    """The root (what every rank reads) checked against the header's digest before it is
    parsed, and the manifest's length against the root's: each one line at the open."""
    folder = tmp_path / "step-3"
    folder.mkdir()
    checkpoint_scale.sealed_step(folder, 2, 8)
    raw = (folder / manifest.NAME).read_bytes()
    head, root, _ = raw.split(b"\n", 2)
    total = len(raw) - len(head) - len(root) - 2  # the sections' bytes
    damaged = bytearray(raw)
    damaged[len(head) + 20] ^= 0x01
    cut = "its .manifest.json is cut or extended: its root gives"
    cases = {
        bytes(damaged): "its .manifest.json body has xxh3_64 ",
        raw[:-1]: f"{cut} {total} bytes of sections, it holds {total - 1}",
        raw + b"\n": f"{cut} {total} bytes of sections, it holds {total + 1}",
    }
    for data, expected in cases.items():
        (folder / manifest.NAME).write_bytes(data)
        step.release()
        with pytest.raises(integrity.ChecksumMismatch) as info:
            integrity.open_step(folder)
        line = str(info.value)
        assert line.startswith(f"checkpoint {folder} is corrupted: ") and expected in line, line
        assert "\n" not in line and line.endswith("; not loaded"), line
