"""Sealed checkpoint steps (boost_titan.checkpoint.integrity): every save writes a manifest
that binds each item's bytes to its FQN, file, offset, length and step; every load opens
the step through it first and checks each item as it reads; the files stay plain DCP.

Unit cases save and load small state dicts in this process (DCP without a process
group), each one of issue #41's reproductions: a stale shard, two swapped items, a step
copied under another step's name, paths outside the step, a FIFO, a missing file,
crafted offsets, an empty ``.metadata``. The end-to-end cases run real gloo ranks (BTP
TP2, 6 steps): one resume meets five damaged steps at once and loads the one good
step; a named damaged checkpoint fails on one line; plain DCP in a fresh interpreter
(torch only) reads a trainer step to the same tensors."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from helpers import PYTHON, REPO_ROOT, run_main, run_training
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from boost_titan.checkpoint import integrity, safe_metadata
from boost_titan.checkpoint.integrity import manifest
from boost_titan.checkpoint.integrity.blocks import segment_blocks, segment_digests

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WQ = "layers.1.attention.wq.down.weight"
WK = "layers.1.attention.wk.down.weight"  # same shape as WQ
BIG = "tok_embeddings.weight"  # 600 x 1024 fp32: 2.4 MiB, three 1 MiB blocks


def _state(seed: int = 0, step: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        WQ: torch.randn(64, 256, generator=g),
        WK: torch.randn(64, 256, generator=g),
        BIG: torch.randn(600, 1024, generator=g),
        "steps": torch.arange(5),
        "train_state": {"step": step, "tokens": 1024},  # DCP pickles these (bytes items)
    }


def _empty() -> dict:
    return {
        WQ: torch.zeros(64, 256),
        WK: torch.zeros(64, 256),
        BIG: torch.zeros(600, 1024),
        "steps": torch.zeros(5, dtype=torch.long),
        "train_state": {"step": 0, "tokens": 0},
    }


def _save(path: Path, state: dict | None = None, **writer) -> Path:
    dcp.save(state or _state(), storage_writer=FileSystemWriter(path, **writer), no_dist=True)
    return path


def _meta(step_dir: Path):
    return pickle.loads((step_dir / ".metadata").read_bytes())


def _stored(step_dir: Path, fqn: str, file: str | None = None):
    """(file path, offset, length) of the item ``fqn`` (its chunk in ``file``, if
    given) as ``.metadata``'s storage_data records it."""
    meta = safe_metadata.loads((step_dir / ".metadata").read_bytes(), str(step_dir))
    for index, info in sorted(meta.storage_data.items(), key=lambda kv: kv[1].relative_path):
        if index.fqn == fqn and file in (None, info.relative_path):
            return step_dir / info.relative_path, info.offset, info.length
    raise KeyError(fqn)


def _segments(step_dir: Path, fqn: str, file: str | None = None) -> list[int]:
    """The segment lengths the manifest records for the item ``fqn``."""
    seal = manifest.decode((step_dir / ".manifest.json").read_bytes(), str(step_dir))
    return next(
        list(e.segments) for e in seal.items.values() if e.fqn == fqn and file in (None, e.file)
    )


def _block_at(segments: list[int], pos: int) -> tuple[int, int]:
    """[start, end) of the block holding byte ``pos`` of an item, as the manifest's
    format says blocks lie: each segment cut into MiB blocks from its start, except its
    last 64 KiB when it is longer than a MiB."""
    start = 0
    for n in segments:
        if pos < start + n:
            cut = n - 2**16 if n > 2**20 else n
            if pos - start >= cut:
                return start + cut, start + n
            first = start + (pos - start) // 2**20 * 2**20
            return first, min(first + 2**20, start + cut)
        start += n
    raise ValueError(pos)


def flip_bits(step_dir: Path, fqn: str, file: str | None = None, at: float = 0.5) -> int:
    """Flip bit 0x08 of the top byte of 16 consecutive fp32 words at fraction ``at`` of
    the stored item ``fqn`` (a torch.save archive whose tensor data is 64-byte aligned
    and makes up nearly all of it), located via .metadata's offsets. Returns the
    position in the file of the first flipped word."""
    path, offset, length = _stored(step_dir, fqn, file)
    pos = offset + int(length * at) // 64 * 64
    data = bytearray(path.read_bytes())
    for i in range(16):
        data[pos + 4 * i + 3] ^= 0x08
    path.write_bytes(bytes(data))
    return pos


def _forge(step_dir: Path, mutate) -> None:
    """Change ``.metadata`` with ``mutate(metadata)`` and, where the step has a manifest,
    rewrite it to match, digests and all, as a forger (not bit rot) would: what refuses
    the result is then the check of paths, kinds and ranges, not a digest."""
    meta = _meta(step_dir)
    mutate(meta)
    data = pickle.dumps(meta)
    (step_dir / ".metadata").write_bytes(data)
    path = step_dir / manifest.NAME
    if not path.exists():
        return
    seal = manifest.decode(path.read_bytes(), str(step_dir))
    items = {}
    for index, info in meta.storage_data.items():
        fqn, chunk = manifest.key(index)
        n = max(info.length, 0)
        digests = b"\0" * 8 * len(segment_blocks([n]))
        items[(fqn, chunk)] = manifest.ItemEntry(
            fqn, chunk, info.relative_path, info.offset, info.length, (n,), digests
        )
    seal.items = items
    for info in meta.storage_data.values():
        target = step_dir / info.relative_path  # (an absolute path stays one)
        size = target.stat().st_size if target.exists() and target.is_file() else 0
        seal.files.setdefault(info.relative_path, manifest.FileEntry(size, None))
    seal.files[".metadata"] = manifest.FileEntry(len(data), segment_digests(data))
    path.write_bytes(manifest.encode(seal))


def _load_line(step_dir: Path) -> str:
    """The one line a DCP load of ``step_dir`` fails on."""
    with pytest.raises(BaseException) as info:
        dcp.load(_empty(), checkpoint_id=str(step_dir), no_dist=True)
    bad = integrity.mismatch_in(info.value)
    assert bad is not None, info.value
    line = str(bad)
    assert "\n" not in line and line.startswith(f"checkpoint {step_dir} "), line
    return line


# ---------------------------------------------------------------- what a save writes


def test_a_step_is_plain_dcp_sealed_by_its_manifest(tmp_path):
    step = _save(tmp_path / "step-4")
    back = _empty()
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    for k, v in _state().items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k
    assert sorted(p.name for p in step.iterdir()) == [".manifest.json", ".metadata", "__0_0.distcp"]
    # plain DCP: no transform declared, nothing appended to any item (each item is a
    # torch.save archive that torch.load reads as it is, and they tile the file)
    meta = _meta(step)
    infos = sorted(meta.storage_data.values(), key=lambda i: i.offset)
    # (what torch's own save pickles: _StorageInfo drops a None transform list)
    assert all(set(vars(i)) == {"relative_path", "offset", "length"} for i in infos)
    assert [i.offset for i in infos] == [0, *(i.offset + i.length for i in infos[:-1])]
    raw = (step / "__0_0.distcp").read_bytes()
    assert len(raw) == infos[-1].offset + infos[-1].length
    path, offset, length = _stored(step, BIG)
    assert torch.equal(
        torch.load(__import__("io").BytesIO(raw[offset : offset + length])), _state()[BIG]
    )
    # the manifest: header (digest of the root), the root (files, and where each data
    # file's section lies, with its digest), then one section per data file: every
    # item's place and digests
    head, root, section, end = (step / ".manifest.json").read_bytes().split(b"\n")
    assert json.loads(head) == {
        "seal": "boost_titan.seal/2", "algorithm": "xxh3_64",
        "bytes": len(root), "digest": xxhash.xxh3_64_hexdigest(root),
    }  # fmt: skip
    body = json.loads(root)
    assert body["step"] == 4 and body["save_id"] == meta.storage_meta.save_id
    assert "boost_titan.seal/2" in meta.storage_meta.modules
    data = (step / ".metadata").read_bytes()
    assert body["files"] == {
        ".metadata": [len(data), xxhash.xxh3_64_hexdigest(data)],
        "__0_0.distcp": [len(raw), None],
    }
    assert end == b"" and body["sections_bytes"] == len(section) + 1
    assert body["sections"] == {
        "__0_0.distcp": [0, len(section), xxhash.xxh3_64_hexdigest(section), 6]
    }
    body["items"] = json.loads(section)
    listed = {e[0]: e for e in body["items"]}
    assert len(listed) == len(meta.storage_data) == 6
    fqn, chunk, file, off, n, segments, digests = listed[BIG]
    assert (chunk, file, off, n) == ([0, 0], "__0_0.distcp", offset, length)
    # the archive's header, the tensor's bytes as one segment, the archive's tail
    assert len(segments) == 3 and segments[1] == 600 * 1024 * 4 and sum(segments) == length
    item = raw[offset : offset + length]
    bounds, pos = [], 0
    while pos < length:
        bounds.append(_block_at(segments, pos))
        pos = bounds[-1][1]
    assert [b - a for a, b in bounds] == [
        segments[0],
        2**20,
        2**20,
        2457600 - 2 * 2**20 - 2**16,
        2**16,
        segments[2],
    ]
    assert digests == "".join(xxhash.xxh3_64_hexdigest(item[a:b]) for a, b in bounds)
    result = integrity.check(step)
    assert result.ok and result.trust == "sealed" and result.items == 6


def test_a_save_that_cannot_be_sealed_is_refused_in_one_line(tmp_path, monkeypatch):
    """Issue #48: a step is sealed or refused at save, never silently unsealed. An fsspec
    (object-store) writer is refused before it writes; a save with an item written
    without digests is refused at finish, its .metadata unwritten (the step stays
    incomplete); ``_extensions=()`` still saves plain, unsealed DCP on purpose."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    from boost_titan.checkpoint.integrity import dcp_hooks

    step = tmp_path / "step-1"
    with pytest.raises(BaseException) as info:
        dcp.save(_state(), storage_writer=FsspecWriter(f"file://{step}"), no_dist=True)
    line = str(integrity.mismatch_in(info.value))
    assert line.startswith(
        f"checkpoint save refused: file://{step} cannot be sealed: its writer's filesystem "
        "is torch.distributed.checkpoint._fsspec_filesystem.FileSystem; boost_titan seals "
    ), line
    assert not (step / ".metadata").exists()  # (refused before any write)

    sealed = filesystem._write_item

    def drop_one(*args):  # the big tensor's digests lost on their way to the coordinator
        result = sealed(*args)
        if args[3].index.fqn == BIG:
            result.storage_data.__dict__.pop(dcp_hooks._DIGESTS, None)
        return result

    monkeypatch.setattr(filesystem, "_write_item", drop_one)
    step = tmp_path / "step-2"
    with pytest.raises(BaseException) as info:
        _save(step)
    assert str(integrity.mismatch_in(info.value)) == (
        f"checkpoint save refused: {step} cannot be sealed: 1 of its 1 writing ranks wrote "
        "items without digests (6 items in all); its .metadata is not written (the step "
        "stays incomplete)"
    )
    assert not (step / ".metadata").exists() and not (step / ".manifest.json").exists()
    monkeypatch.setattr(filesystem, "_write_item", sealed)
    plain = _save(tmp_path / "step-3", _extensions=())  # asked for: plain DCP
    assert integrity.check(plain).trust == "unverified"


def test_flipped_bits_fail_the_load_on_one_line(tmp_path, monkeypatch):
    step = _save(tmp_path / "step-4")
    path, offset, length = _stored(step, WQ)  # 64 KiB of weights: one block
    a, b = _block_at(_segments(step, WQ), length // 2)
    assert b - a == 64 * 256 * 4
    clean = path.read_bytes()[offset + a : offset + b]
    flip_bits(step, WQ)
    corrupted = path.read_bytes()[offset + a : offset + b]
    back = _empty()
    assert _load_line(step) == (
        f"checkpoint {step} is corrupted: __0_0.distcp, item {WQ}: xxh3_64 of its bytes "
        f"{a}..{b} is {xxhash.xxh3_64_hexdigest(corrupted)} where its save recorded "
        f"{xxhash.xxh3_64_hexdigest(clean)} (the item starts at byte {offset} of the file); "
        "not loaded"
    )
    # and the same flip loads silently without the check: 16 weights scaled by 2^+-16
    monkeypatch.setattr(integrity.VerifyingReader, "_check", lambda self, k, data, found: None)
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    ref = _state()[WQ]
    changed = (back[WQ] != ref).nonzero()
    assert len(changed) == 16
    ratios = {float(back[WQ][tuple(i)] / ref[tuple(i)]) for i in changed}
    assert ratios <= {2.0**16, 2.0**-16}, ratios


def test_a_flip_in_a_middle_block_names_its_bytes(tmp_path):
    step = _save(tmp_path / "step-4")
    path, offset, length = _stored(step, BIG)
    pos = flip_bits(step, BIG)
    a, b = _block_at(_segments(step, BIG), pos - offset)
    assert 2**20 < a < pos - offset < b == a + 2**20  # the tensor's second MiB
    assert re.fullmatch(
        rf"checkpoint {re.escape(str(step))} is corrupted: "
        rf"__0_0\.distcp, item {BIG}: xxh3_64 of its bytes {a}\.\.{b} is [0-9a-f]{{16}} "
        rf"where its save recorded [0-9a-f]{{16}} \(the item starts at byte {offset} of the "
        r"file\); not loaded",
        _load_line(step),
    )


def test_a_flipped_metadata_byte_is_refused_before_unpickling(tmp_path, monkeypatch):
    step = _save(tmp_path / "step-4")
    clean = (step / ".metadata").read_bytes()
    data = bytearray(clean)
    data[len(data) // 2] ^= 0x08
    (step / ".metadata").write_bytes(bytes(data))

    def unpickled(*args, **kwargs):
        raise AssertionError(".metadata was unpickled")

    monkeypatch.setattr(safe_metadata, "loads", unpickled)
    expected = (
        f"checkpoint {step} is corrupted: .metadata: xxh3_64 "
        f"{xxhash.xxh3_64_hexdigest(bytes(data))} ({len(data)} bytes) where its .manifest.json "
        f"records {xxhash.xxh3_64_hexdigest(clean)} ({len(data)} bytes); not unpickled; not loaded"
    )
    with pytest.raises(integrity.ChecksumMismatch) as info:
        FileSystemReader(str(step)).read_metadata()
    assert str(info.value) == expected
    assert _load_line(step) == expected


def test_stale_swapped_and_renamed_steps_are_mismatches(tmp_path):
    """Issue #41, reproduction 1: a file copied from another step (same size: the same
    shapes, other values and train_state.step), two items of the same size swapped in
    a file, a whole step copied under another step's name: each verified ``ok`` and
    loaded before; each is now one line, in ``verify`` and in the load."""
    root = tmp_path / "checkpoint"
    old = _save(root / "step-2", _state(seed=1, step=2))
    stale = _save(root / "step-6", _state(seed=2, step=6))
    shutil.copy(old / "__0_0.distcp", stale / "__0_0.distcp")  # a half-finished rsync
    # one line for the file (issue #48: a stale file printed a line per item): its first
    # item that differs and how many more do (train_state.step, wq, wk and the big one;
    # the steps and train_state.tokens hold the same bytes)
    (line,) = integrity.verify(stale)
    assert line.startswith(
        f"checkpoint {stale} is corrupted: __0_0.distcp, item train_state.step: xxh3_64 "
    )
    assert line.endswith(" (and 3 more of its 6 items)"), line
    assert "item train_state.step: xxh3_64 of its bytes" in line
    assert _load_line(stale).startswith(f"checkpoint {stale} is corrupted: __0_0.distcp, item ")

    swapped = _save(root / "step-8", _state(seed=3, step=8))
    (pq, oq, nq), (_, ok, nk) = _stored(swapped, WQ), _stored(swapped, WK)
    assert nq == nk and ok != oq
    raw = bytearray(pq.read_bytes())
    raw[oq : oq + nq], raw[ok : ok + nk] = raw[ok : ok + nk], raw[oq : oq + nq]
    pq.write_bytes(bytes(raw))
    (line,) = integrity.verify(swapped)  # both items differ: one line for their file
    assert line.startswith(f"checkpoint {swapped} is corrupted: __0_0.distcp, item {WQ}: ")
    assert line.endswith(" (and 1 more of its 6 items)"), line
    assert re.search(rf"item ({WQ}|{WK}): xxh3_64", _load_line(swapped))

    shutil.copytree(old, root / "step-10")  # the whole step, manifest and all
    renamed = (
        f"checkpoint {root / 'step-10'} is corrupted: its .manifest.json was written for step "
        "2, the folder is step 10 (a step copied or linked under another step's name)"
    )
    assert integrity.verify(root / "step-10") == [renamed]
    assert _load_line(root / "step-10") == renamed + "; not loaded"
    # reproduction 5: a step that is a link to another (ln -s step-2 step-12) reads as
    # that step, named by the link; a save of step 12 never writes through it
    os.symlink("step-2", root / "step-12")
    assert integrity.verify(root / "step-12") == [
        renamed.replace("step-10", "step-12").replace("step 10", "step 12")
    ]
    before = {p.name: p.read_bytes() for p in old.iterdir()}
    with pytest.raises(BaseException) as info:
        dcp.save(_state(step=12), checkpoint_id=str(root / "step-12"), no_dist=True)
    assert str(integrity.mismatch_in(info.value)) == (
        f"checkpoint save refused: {root / 'step-12'} is a symbolic link (to step-2); a save "
        "writes a real step folder, never through a link into another one"
    )
    assert {p.name: p.read_bytes() for p in old.iterdir()} == before
    os.symlink("step-2", root / "latest")  # a link the user names: read through
    assert integrity.verify(root / "latest") == [] and integrity.verify(old) == []


def test_paths_kinds_and_ranges_are_refused_in_one_line(tmp_path):
    """Reproductions 2 and 4: ``.metadata`` naming files outside its step (absolute,
    ``..``, a link out), a FIFO in place of a file, offsets and lengths no file holds,
    an empty ``.metadata``; sealed steps whose manifest was rewritten to match, and
    unsealed ones. ``verify`` (its own process: before, a FIFO hung it) prints one line
    per step, exit 1, no traceback; a load fails on the same line."""
    root = tmp_path / "checkpoint"
    other = _save(root / "step-2")
    cases: dict[str, tuple[Path, str]] = {}

    def case(name: str, sealed: bool, mutate, expected: str) -> None:
        step = _save(root / name, **({} if sealed else {"_extensions": ()}))
        mutate(step)
        cases[name] = (step, expected)

    def relative(path: str):
        def mutate(step):
            _forge(
                step, lambda m: [setattr(i, "relative_path", path) for i in m.storage_data.values()]
            )

        return mutate

    def placed(offset: int, length: int):
        def mutate(step):
            def change(m):
                info = next(i for x, i in m.storage_data.items() if x.fqn == WQ)
                info.offset, info.length = offset, length

            _forge(step, change)

        return mutate

    for sealed in (True, False):
        s = "sealed" if sealed else "plain"
        case(
            f"{s}-abs",
            sealed,
            relative(str(other / "__0_0.distcp")),
            "not a relative path inside the step folder",
        )
        case(
            f"{s}-up",
            sealed,
            relative("../step-2/__0_0.distcp"),
            "not a relative path inside the step folder",
        )
        # (a forged manifest cannot even list such a place: it is refused first)
        ranged = "is corrupted: its .manifest.json item entry" if sealed else "puts item"
        case(f"{s}-far", sealed, placed(2**62, 100), ranged)
        case(f"{s}-neg", sealed, placed(-5, -5), ranged)
    case(
        "sealed-link",
        True,
        lambda st: (os.symlink(other / "__0_0.distcp", st / "x.distcp"), relative("x.distcp")(st)),
        "outside the step folder",
    )
    case(
        "plain-link",
        False,
        lambda st: (os.symlink(other / "__0_0.distcp", st / "x.distcp"), relative("x.distcp")(st)),
        "outside the step folder",
    )
    case(
        "sealed-fifo",
        True,
        lambda st: ((st / "__0_0.distcp").unlink(), os.mkfifo(st / "__0_0.distcp")),
        "is refused: __0_0.distcp is a FIFO, not a regular file",
    )
    case(
        "plain-fifo",
        False,
        lambda st: ((st / "__0_0.distcp").unlink(), os.mkfifo(st / "__0_0.distcp")),
        "is refused: __0_0.distcp is a FIFO, not a regular file",
    )
    case(
        "meta-fifo",
        True,
        lambda st: ((st / ".metadata").unlink(), os.mkfifo(st / ".metadata")),
        "is refused: its .metadata is a FIFO, not a regular file",
    )
    case(
        "sealed-empty",
        True,
        lambda st: (st / ".metadata").write_bytes(b""),
        "is corrupted: .metadata: xxh3_64",
    )
    case(
        "plain-empty",
        False,
        lambda st: (st / ".metadata").write_bytes(b""),
        "is damaged: its .metadata (0 bytes) is not DCP metadata (EOFError",
    )
    case(
        "no-manifest",
        True,
        lambda st: (st / ".manifest.json").unlink(),
        "is incomplete: its .metadata says its save sealed it, but its .manifest.json is missing",
    )
    case(
        "bad-manifest",
        True,
        lambda st: (st / ".manifest.json").write_bytes(b"{}\n"),
        "is corrupted: its .manifest.json does not start with the header line a save writes",
    )
    case(
        "missing",
        True,
        lambda st: (st / "__0_0.distcp").unlink(),
        "is incomplete: __0_0.distcp is missing",
    )

    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        "verify",
        *(str(s) for s, _ in cases.values()),
        timeout=120,
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert len(lines) == len(cases), proc.stderr
    for line, (name, (step, expected)) in zip(lines, cases.items()):
        assert line.startswith(f"checkpoint {step} "), (name, line)
        assert expected in line, (name, line)
        if name.endswith("fifo"):
            continue  # a load would block in torch's open() of a FIFO, past the check
        assert _load_line(step) == line + "; not loaded", name


def _reseal(step_dir: Path, change=None, body: bytes | None = None) -> None:
    """Rewrite the step's manifest as a seal/1 one (one body: still read) with its body
    changed (``change(fields)``, or ``body`` as given) under a header that matches it:
    what refuses it is then the body's own check."""
    if body is None:
        seal = manifest.decode((step_dir / manifest.NAME).read_bytes(), str(step_dir))
        fields = json.loads(manifest.encode_v1(seal).split(b"\n")[1])
        change(fields)
        body = json.dumps(fields).encode()
    head = {
        "seal": manifest.SEAL_1, "algorithm": "xxh3_64",
        "bytes": len(body), "digest": xxhash.xxh3_64_hexdigest(body),
    }  # fmt: skip
    (step_dir / manifest.NAME).write_bytes(json.dumps(head).encode() + b"\n" + body + b"\n")


def test_a_malformed_manifest_is_one_line_and_set_aside(tmp_path, monkeypatch):
    """Issue #48: manifests that raised other exceptions out of ``open_step`` (a folder
    in its place: IsADirectoryError; ``"bytes": Infinity``: OverflowError; 200k-deep
    JSON: RecursionError; a lone surrogate in a file name: UnicodeEncodeError), a null
    step that skipped the step-number check, and lengths of 2**61 that made 2**41 block
    entries (MemoryError) are each one line naming the step; resuming the dump folder
    sets each aside and loads the good step below them."""
    from boost_titan.checkpoint.integrity import blocks, resume

    root = tmp_path / "checkpoint"
    _save(root / "step-2", _state(step=2))
    expected = {}

    def case(n: int, mutate, line: str, sealed: bool = True) -> None:
        step = _save(root / f"step-{n}", _state(step=n), **({} if sealed else {"_extensions": ()}))
        mutate(step)
        expected[n] = line

    def folder(step):
        (step / manifest.NAME).unlink()
        (step / manifest.NAME).mkdir()

    def infinite(step):
        head, rest = (step / manifest.NAME).read_bytes().split(b"\n", 1)
        head = re.sub(rb'"bytes":\d+', b'"bytes":Infinity', head)
        (step / manifest.NAME).write_bytes(head + b"\n" + rest)

    deep = b"[" * 200_000 + b"]" * 200_000

    def surrogate(step):
        def change(fields):
            fields["files"]["\ud800.distcp"] = fields["files"].pop("__0_0.distcp")
            for item in fields["items"]:
                item[2] = "\ud800.distcp"

        _reseal(step, change)

    def huge(fields, n=2**61):
        fields["items"][0][4], fields["items"][0][5] = n, [n]

    def huge_metadata(fields):
        fields["files"][".metadata"][0] = 2**61

    def null_step(fields):
        fields["step"] = None

    case(4, folder, "is refused: its .manifest.json is a folder, not a regular file")
    case(
        6,
        infinite,
        "is corrupted: its .manifest.json header's bytes inf and digest",
    )
    case(
        8,
        lambda st: (st / manifest.NAME).write_bytes(deep + b"\n"),
        "is corrupted: its .manifest.json does not start with the header line a save writes",
    )
    case(
        10,
        lambda st: _reseal(st, body=deep),
        "is corrupted: its .manifest.json body is not the JSON a save writes",
    )
    case(
        12,
        surrogate,
        "is corrupted: its .manifest.json names the file '\\ud800.distcp', which is not valid "
        "UTF-8",
    )
    case(
        14,
        lambda st: _forge(
            st, lambda m: [setattr(i, "relative_path", "\ud800") for i in m.storage_data.values()]
        ),
        "is refused: its metadata names the file '\\ud800', a name no file can have (a lone "
        "surrogate)",
        sealed=False,
    )
    case(
        16,
        lambda st: _reseal(st, null_step),
        "is corrupted: its .manifest.json was written for no step (saved outside a step-N "
        "folder), the folder is step 16 (a step copied or linked under another step's name)",
    )
    case(
        18,
        lambda st: _reseal(st, huge),
        "is corrupted: its .manifest.json puts item",
    )
    case(
        20,
        lambda st: _reseal(st, huge_metadata),
        "is corrupted: its .manifest.json records '.metadata' as 2305843009213693952 bytes "
        "with 1 digests, where that size has 2199023255553",  # 2**41 MiB blocks + the tail
    )

    made = blocks.segment_blocks

    def no_huge_lists(segments, *args):  # 2**41 blocks: refused before any list is made
        assert sum(segments) < 2**40, f"segment_blocks({segments}) called"
        return made(segments, *args)

    monkeypatch.setattr(manifest, "segment_blocks", no_huge_lists, raising=False)
    monkeypatch.setattr(blocks, "segment_blocks", no_huge_lists)
    for n, line in expected.items():
        step = root / f"step-{n}"
        with pytest.raises(integrity.ChecksumMismatch) as info:
            integrity.open_step(step)
        got = str(info.value)
        assert got.startswith(f"checkpoint {step} ") and line in got, (n, got)
        assert "\n" not in got and got.endswith("; not loaded"), got
    assert "at bytes 0..+2305843009213693952 of __0_0.distcp, which its save wrote as" in (
        str(pytest.raises(integrity.ChecksumMismatch, integrity.open_step, root / "step-18").value)
    )
    monkeypatch.undo()
    outcome = resume._choose(str(root), None)
    assert outcome[:3] == ("ok", True, 2), outcome
    moved = outcome[3]
    newest_first = sorted(expected, reverse=True)
    assert [m for _, m in moved] == [str(root / f"step_{n}.corrupt") for n in newest_first]
    for (line, _), n in zip(moved, newest_first):
        assert line.startswith(f"checkpoint {root / f'step-{n}'} ") and expected[n] in line
    assert sorted(p.name for p in root.iterdir() if p.name.startswith("step-")) == ["step-2"]


def test_a_rank_parses_a_step_once(tmp_path, monkeypatch):
    """The launch pre-check's view, the data position check and DCP's load of one step
    in one process unpickle its .metadata once (and hash it once); a new save of the
    same folder is parsed again."""
    from boost_titan.checkpoint import folder as checkpoint_folder
    from boost_titan.checkpoint.data_position import saved_items

    state = {**_state(), "dataloader": {"dp_rank_0": b"position", "world_size": 1}}
    step = _save(tmp_path / "step-4", state)
    parsed = []
    loads = safe_metadata.loads
    monkeypatch.setattr(safe_metadata, "loads", lambda *a: parsed.append(a[1]) or loads(*a))
    assert checkpoint_folder.states_held(str(step)) == {"train_state", "dataloader"}
    assert saved_items(str(step)) == ["dataloader.dp_rank_0", "dataloader.world_size"]
    back = {**_empty(), "dataloader": {"dp_rank_0": b"", "world_size": 0}}
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    assert back["dataloader"]["dp_rank_0"] == b"position" and parsed == [str(step)]
    _save(step, state)
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    assert parsed == [str(step)] * 2


def test_older_steps_load_with_a_warning(tmp_path, caplog):
    """A step with no checksum (torchtitan's, or written before boost_titan checksummed)
    loads with one warning; one with the per-item trailers boost_titan wrote before it
    sealed steps loads with every item checked against its trailer and a warning that
    nothing binds it to its step (its damage is still one line)."""
    old = _save(tmp_path / "old" / "step-4", _extensions=())  # a plain DCP save
    assert sorted(p.name for p in old.iterdir()) == [".metadata", "__0_0.distcp"]
    trailers = _with_trailers(_save(tmp_path / "trailers" / "step-4", _extensions=()))
    with caplog.at_level(logging.WARNING):
        for step in (old, trailers, old, trailers):
            back = _empty()
            dcp.load(back, checkpoint_id=str(step), no_dist=True)
            assert torch.equal(back[BIG], _state()[BIG]) and back["train_state"]["step"] == 4
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"checkpoint {old} has no checksums (written before boost_titan checksummed "
        "checkpoints, or by another writer): its bytes cannot be verified; loaded unverified",
        f"checkpoint {trailers} was written before boost_titan sealed its steps: each item "
        "is checked against its own checksum, but nothing binds its items to this step",
    ]
    assert integrity.check(old).trust == "unverified" and integrity.verify(old) == []
    assert integrity.check(trailers).trust == "trailers" and integrity.verify(trailers) == []
    flip_bits(trailers, WQ, at=0.3)
    assert f"item {WQ}: xxh3_64 of its bytes 0.." in _load_line(trailers)
    assert len(integrity.verify(trailers)) == 1


def _with_trailers(step: Path) -> Path:
    """The format boost_titan wrote before sealed steps, rebuilt from a plain save: each
    item followed by one xxh3_64 per MiB and a footer, declared in .metadata as the
    extension ``boost_titan.xxh3/1``, and a ``.metadata.xxh3`` sidecar."""
    import struct

    meta = _meta(step)
    raw = (step / "__0_0.distcp").read_bytes()
    out = bytearray()
    for info in sorted(meta.storage_data.values(), key=lambda i: i.offset):
        payload = raw[info.offset : info.offset + info.length]
        digests = b"".join(
            xxhash.xxh3_64_digest(payload[i : i + 2**20]) for i in range(0, len(payload), 2**20)
        )
        info.offset = len(out)
        out += payload + digests + struct.pack("<QI", len(payload), 2**20) + b"BTxxh3\x00\x01"
        info.length = len(out) - info.offset
        info.transform_descriptors = ["boost_titan.xxh3/1"]
    (step / "__0_0.distcp").write_bytes(bytes(out))
    data = pickle.dumps(meta)
    (step / ".metadata").write_bytes(data)
    (step / ".metadata.xxh3").write_text(
        json.dumps(
            {"algorithm": "xxh3_64", "digest": xxhash.xxh3_64_hexdigest(data), "bytes": len(data)}
        )
    )
    return step


def test_verify_command(tmp_path, capsys):
    from boost_titan.cli import checkpoint

    def verify(*paths) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as info:
            checkpoint.main(["verify", *map(str, paths)])
        out = capsys.readouterr()
        return info.value.code, out.out, out.err

    root = tmp_path / "checkpoint"
    good = _save(root / "step-2", _state(step=2))
    bad = _save(root / "step-4")
    flip_bits(bad, WQ)
    flip_bits(bad, BIG, at=0.9)
    old = _save(root / "step-6", _state(step=6), _extensions=())
    shutil.copytree(bad, root / "step_8.corrupt")  # not a step folder: not verified
    code, out, err = verify(root)
    assert code == 1
    assert out.splitlines() == [
        f"ok: {good} (6 items, 2.5 MiB, xxh3_64)",
        f"unverified: checkpoint {old} has no checksums (written before boost_titan "
        "checksummed checkpoints, or by another writer): its bytes cannot be verified",
    ]
    (line,) = err.splitlines()  # one per bad file: its first bad item, without "; not loaded"
    assert line.startswith(f"checkpoint {bad} is corrupted: __0_0.distcp, item {WQ}: xxh3_64 ")
    assert line.endswith("of the file) (and 1 more of its 6 items)"), line
    assert verify(good)[0] == 0 and verify(old)[0] == 0
    code, _, err = verify(bad, good)
    assert code == 1 and len(err.splitlines()) == 1
    # a file the manifest does not list is reported, and changes nothing else
    (good / "notes.txt").write_text("copied in later")
    code, out, err = verify(good)
    assert code == 0 and out.startswith(f"ok: {good} "), out
    assert err == (
        f"note: {good} holds 1 entries its manifest does not list (notes.txt): not part of "
        "the sealed step, no load reads them\n"
    )
    (good / "notes.txt").unlink()
    code, _, err = verify(tmp_path / "nowhere")
    assert (code, err) == (
        1,
        f"{tmp_path / 'nowhere'} is not a DCP checkpoint: it does not exist\n",
    )
    path, _, _ = _stored(good, BIG)  # the cut tail of a file
    size = path.stat().st_size
    os.truncate(path, size - 100)
    code, _, err = verify(good)
    assert (code, err) == (
        1,
        f"checkpoint {good} is corrupted: __0_0.distcp holds {size - 100} bytes where its save "
        f"wrote {size}\n",
    )


def test_the_nan_stop_names_the_newest_checkpoint_that_verifies(tmp_path):
    """StepGuard's stop (boost_titan.train.fault) with step-6 cut off, step-4 corrupted: the
    message sends a restart to step-2, and says why not step-4."""
    from types import SimpleNamespace

    from boost_titan.train.fault import NonFiniteStepError, StepGuard

    folder = tmp_path / "checkpoint"
    _save(folder / "step-2", _state(step=2))
    flip_bits(_save(folder / "step-4"), WQ)
    (_save(folder / "step-6", _state(step=6)) / ".metadata").unlink()
    weight = torch.nn.Parameter(torch.ones(2))
    trainer = SimpleNamespace(
        optimizers=SimpleNamespace(step=lambda: None, zero_grad=lambda: None),
        lr_schedulers=SimpleNamespace(step=lambda: None),
        model_parts=[SimpleNamespace(parameters=lambda: [weight])],
        device="cpu",
        step=7,
        checkpointer=SimpleNamespace(enable=True, folder=str(folder)),
    )
    guard = StepGuard(trainer, "stop", 0, None)
    guard.record_loss(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteStepError) as info:
        trainer.optimizers.step()
    bad = integrity.verify(folder / "step-4")
    assert len(bad) == 1
    assert (
        f"Last checkpoint: {folder / 'step-2'} (untouched; newer, failed verification: "
        f"{bad[0]}). A NaN"
    ) in str(info.value)


def test_a_writer_pickled_into_a_fresh_process_seals(tmp_path):
    """DCP's process-based async save (torchtitan's async_with_pinned_mem) pickles the
    writer into a spawned process that never called install(): it seals the step there
    too."""
    step = tmp_path / "step-2"
    (tmp_path / "writer.pkl").write_bytes(pickle.dumps(FileSystemWriter(step)))
    script = (
        "import pickle, sys, warnings, torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import filesystem\n"
        "warnings.simplefilter('ignore')\n"
        "before = filesystem._FileSystemWriter.finish.__module__\n"
        "writer = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "dcp.save({'w': torch.arange(6.0)}, storage_writer=writer, no_dist=True)\n"
        "print(before, filesystem._FileSystemWriter.finish.__module__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "writer.pkl")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        "torch.distributed.checkpoint.filesystem",
        "boost_titan.checkpoint.integrity.dcp_hooks",
    ]
    result = integrity.check(step)
    assert result.ok and result.trust == "sealed" and (step / ".manifest.json").is_file()
    back = {"w": torch.zeros(6)}
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    assert torch.equal(back["w"], torch.arange(6.0))


def test_a_folder_seal_covers_every_file(tmp_path):
    """A Hugging Face save's folder (``last_save_in_hf``) is sealed file by file."""
    step = tmp_path / "step-3"
    step.mkdir()
    (step / "model.safetensors.index.json").write_text("{}")
    (step / "model-00001-of-00001.safetensors").write_bytes(os.urandom(3 * 2**20 + 5))
    integrity.seal_folder(str(step))
    result = integrity.check(step)
    assert result.ok and result.items == 2 and integrity.open_step(step).format == "hf"
    data = bytearray((step / "model-00001-of-00001.safetensors").read_bytes())
    data[2**20 + 7] ^= 1
    (step / "model-00001-of-00001.safetensors").write_bytes(bytes(data))
    (line,) = integrity.verify(step)
    assert line.startswith(
        f"checkpoint {step} is corrupted: model-00001-of-00001.safetensors, the file: xxh3_64 "
        "of its bytes 1048576..2097152 is "
    ), line


_SPREAD_SIZES = {
    "config.json": 17,
    "empty": 0,
    "model-00001-of-00002.safetensors": 3 * 2**20 + 5,
    "model-00002-of-00002.safetensors": 2**20,
    "model.safetensors.index.json": 2**20 + 70_000,
}


def _spread_folder(folder: Path) -> Path:
    folder.mkdir()
    for name, size in _SPREAD_SIZES.items():
        (folder / name).write_bytes(os.urandom(size))
    return folder


def test_a_folder_seal_spread_over_ranks_is_the_whole_folders(tmp_path):
    """A Hugging Face save and load hash it in shares (``folder_seal.shares``): every
    block is one rank's, no rank reads more than total / world + a block, the joined
    digests are xxh3 of each block read straight from the files, and a flipped byte is
    found by the one rank whose share holds it, in ``verify``'s line."""
    from boost_titan.checkpoint.integrity import folder_seal

    step = _spread_folder(tmp_path / "step-4")
    total = sum(_SPREAD_SIZES.values())
    want, every_block = {}, []
    for name in sorted(_SPREAD_SIZES):
        data = (step / name).read_bytes()
        blocks = segment_blocks([len(data)])
        want[name] = b"".join(xxhash.xxh3_64_digest(data[s : s + n]) for s, n in blocks)
        every_block += [(name, b) for b in range(len(blocks))]
    for world in (1, 2, 3, 7, 64):
        runs = folder_seal.shares(_SPREAD_SIZES, world)
        assert len(runs) == world
        mine = [(name, b) for rank in runs for name, k, j in rank for b in range(k, j)]
        assert mine == every_block, world  # each block once, ranks in order
        for rank in runs:
            read = sum(
                sum(n for _, n in segment_blocks([_SPREAD_SIZES[name]])[k:j]) for name, k, j in rank
            )
            assert read <= total / world + 2**20, (world, read)
        parts = [folder_seal.digest_share(str(step), _SPREAD_SIZES, r) for r in runs]
        files = folder_seal.join_shares(_SPREAD_SIZES, parts)
        assert {n: (e.bytes, e.digests) for n, e in files.items()} == {
            n: (_SPREAD_SIZES[n], want[n]) for n in want
        }, world
    integrity.seal_folder(str(step))
    assert [integrity.check(step, (r, 3)).nbytes for r in range(3)] == [
        sum(n for name, k, j in rank for _, n in segment_blocks([_SPREAD_SIZES[name]])[k:j])
        for rank in folder_seal.shares(_SPREAD_SIZES, 3)
    ]
    path = step / "model-00001-of-00002.safetensors"
    data = bytearray(path.read_bytes())
    data[2**20 + 7] ^= 1
    path.write_bytes(bytes(data))
    (line,) = integrity.verify(step)
    found = [integrity.check(step, (r, 3)).problems for r in range(3)]
    assert sorted(found) == [[], [], [line]], found


def _hf_seal_worker(rank: int, init_file: str, folder: str, out: str) -> None:
    """3 gloo ranks seal one folder (each its share), then check it and a copy with a
    byte flipped in rank 2's share as a load from Hugging Face does."""
    import torch.distributed as dist

    from boost_titan.checkpoint.manager import BoostCheckpointManager

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    integrity.seal_folder(folder)
    damaged = folder + "_damaged"
    if rank == 0:
        shutil.copytree(folder, damaged)
        path = os.path.join(damaged, "model.safetensors.index.json")
        with open(path, "r+b") as f:
            f.seek(2**20 + 69_999)
            last = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([last[0] ^ 1]))
    dist.barrier()
    BoostCheckpointManager._verify_hf(None, folder)
    try:
        BoostCheckpointManager._verify_hf(None, damaged)
        line = "loaded"
    except integrity.ChecksumMismatch as e:
        line = str(e)
    Path(out, f"rank{rank}.txt").write_text(line)
    dist.destroy_process_group()


def test_a_folder_seal_over_gloo_ranks(tmp_path):
    """The collective paths: the manifest three ranks write is the one process's, and a
    byte flipped in the last rank's share stops every rank on ``verify``'s line."""
    from launcher import spawn

    step = _spread_folder(tmp_path / "step-5")
    alone = tmp_path / "alone" / "step-5"
    shutil.copytree(step, alone)
    spawn(_hf_seal_worker, (str(tmp_path / "pg"), str(step), str(tmp_path)), 3)
    integrity.seal_folder(str(alone))
    assert integrity.check(step).ok
    spread, one = integrity.open_step(step).seal, integrity.open_step(alone).seal
    assert spread.files == one.files and spread.step == one.step == 5
    (line,) = integrity.verify(tmp_path / "step-5_damaged")
    assert "model.safetensors.index.json, the file: xxh3_64 of its bytes " in line
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(3)] == [line] * 3


# ---------------------------------------------------------------- end to end (gloo ranks)

CONFIG = "debug_cola_btp_tp2.toml"


def _train_args(seed: Path, steps: int) -> tuple[str, ...]:
    return (
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed),
        "--checkpoint.interval",
        "2",
        "--training.steps",
        str(steps),
        "--validation.no-enable",
        "--training.mixed_precision_param",
        "float32",
    )


def _expected_line(clean: Path, corrupted: Path, fqn: str, file: str, pos: int) -> str:
    """The mismatch line for the flip at byte ``pos`` of ``file``, from the two copies'
    bytes: the digest of the flipped MiB block of the item in each."""
    meta = _meta(corrupted)
    index, info = next(
        (i, s) for i, s in meta.storage_data.items() if i.fqn == fqn and s.relative_path == file
    )
    start, end = _block_at(_segments(corrupted, fqn, file), pos - info.offset)
    digest = [
        xxhash.xxh3_64_hexdigest((d / file).read_bytes()[info.offset + start : info.offset + end])
        for d in (corrupted, clean)
    ]
    chunk = f" (chunk at {tuple(index.offset)})" if any(index.offset) else ""
    return (
        f"checkpoint {corrupted} is corrupted: {file}, item {fqn}{chunk}: xxh3_64 of its bytes "
        f"{start}..{end} is {digest[0]} where its save recorded {digest[1]} (the item starts "
        f"at byte {info.offset} of the file); not loaded"
    )


@pytest.fixture(scope="module")
def uninterrupted(seed_checkpoint, tmp_path_factory):
    """6 BTP TP2 steps from the shared seed checkpoint, saving at steps 2, 4 and 6; a
    copy of its step-4 with 16 weights of layers.1.attention.wq.down.weight (rank 0's
    file) flipped."""
    root = tmp_path_factory.mktemp("integrity")
    run = run_training(CONFIG, 2, root / "ref", *_train_args(seed_checkpoint("debug_cola.toml"), 6))
    assert sorted(run.loss[0]) == list(range(1, 7))
    clean = run.dump_folder / "checkpoint" / "step-4"
    corrupted = root / "corrupted" / "step-4"
    shutil.copytree(clean, corrupted)
    pos = flip_bits(corrupted, WQ, "__0_0.distcp")
    return run, corrupted, _expected_line(clean, corrupted, WQ, "__0_0.distcp", pos)


@pytest.mark.slow
def test_resume_sets_every_damaged_step_aside(uninterrupted, seed_checkpoint, tmp_path):
    """Reproductions 1, 3, 4, 5 in one resume: newest first, step-10 has an empty
    .metadata, step-8 is a link to step-2, step-6 lost rank 1's file, step-4 carries
    rank 0's file of step-2 (a stale shard: found only as its items are read) and 16
    flipped weights. Rank 0 sets each aside as ``step_N.corrupt`` (the link renamed,
    step-2 untouched), every rank loads step-2 and trains steps 3-6 exactly as the
    uninterrupted run did (DCP resume is bit-exact, test_checkpoints.py)."""
    ref, corrupted, flip_line = uninterrupted
    saved = ref.dump_folder / "checkpoint"
    folder = tmp_path / "resumed" / "checkpoint"
    shutil.copytree(saved / "step-2", folder / "step-2")
    shutil.copytree(corrupted, folder / "step-4")
    shutil.copytree(saved / "step-6", folder / "step-6")
    (folder / "step-6" / "__1_0.distcp").unlink()
    os.symlink("step-2", folder / "step-8")
    shutil.copytree(saved / "step-6", folder / "step-10")
    (folder / "step-10" / ".metadata").write_bytes(b"")
    # the same command again: with the run's record of the initial_load_path it started
    # from (else that path over these steps is refused at parse time)
    shutil.copy(saved / "initial_load.json", folder)
    run = run_training(
        CONFIG, 2, tmp_path / "resumed", *_train_args(seed_checkpoint("debug_cola.toml"), 6)
    )
    warned = re.findall(r"\[rank0\]:.*?WARNING - (checkpoint .*)", run.output)
    moved = [
        (f"step-{n}", f"{folder / f'step_{n}.corrupt'}; resuming from step {step} instead: "
         f"{10 - step} steps ({step + 1}-10) are trained again")
        for n, step in ((10, 4), (8, 4), (6, 4), (4, 2))
    ]  # fmt: skip
    assert len(warned) == 4, run.output[-4000:]
    for line, (name, tail) in zip(warned, moved):
        assert line.startswith(f"checkpoint {folder / name} is ") and line.endswith(tail), line
    assert ": .metadata: xxh3_64 " in warned[0] and "symbolic link (to step-2)" in warned[1]
    assert "is incomplete: __1_0.distcp is missing" in warned[2]
    assert warned[3].startswith(
        flip_line.replace(str(corrupted), str(folder / "step-4"))
        .split(": xxh3_64")[0]
        .rsplit(", item", 1)[0]
    )
    assert re.search(
        rf"Loading the checkpoint from {re.escape(str(folder / 'step-2'))}\.", run.output
    )
    for rank in (0, 1):
        assert sorted(run.loss[rank]) == [3, 4, 5, 6]
        for step in (3, 4, 5, 6):
            assert run.loss[rank][step] == ref.loss[rank][step], (rank, step)
            assert run.grad_norm[rank][step] == ref.grad_norm[rank][step], (rank, step)
    assert (folder / "step_8.corrupt").is_symlink() and integrity.verify(folder / "step-2") == []
    assert [p.name for p in integrity.step_folders(folder)] == ["step-6", "step-4", "step-2"]
    assert all(integrity.check(p).ok for p in integrity.step_folders(folder))


@pytest.mark.slow
def test_a_named_damaged_checkpoint_fails_on_its_line(uninterrupted, tmp_path):
    """``initial_load_path`` and ``export`` at the corrupted step fail on the mismatch's
    line, with no traceback; the one-process load reads the TP2 checkpoint's chunks."""
    _, corrupted, line = uninterrupted
    run = run_training(
        "debug_cola.toml",
        1,
        tmp_path / "named",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(corrupted),
        "--training.steps",
        "1",
        expect_failure=True,
    )
    assert f"ERROR - {line}" in run.output, run.output[-3000:]
    assert "Traceback" not in run.output and "Training starts" not in run.output
    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        "export",
        "--from",
        str(corrupted),
        "--to",
        str(tmp_path / "x.safetensors"),
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / CONFIG),
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith(f"boost-titan checkpoint export: error: {line}")
    assert not list(tmp_path.glob("*x.safetensors*"))


@pytest.mark.slow
def test_plain_dcp_reads_a_trainer_step(uninterrupted, tmp_path):
    """Reproduction 6: a fresh interpreter that imports torch and nothing of
    boost_titan converts a trainer's full TP2 step with DCP's own
    ``dcp_to_torch_save`` and gets the tensors boost_titan's verified load reads."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    ref, _, _ = uninterrupted
    step = ref.dump_folder / "checkpoint" / "step-4"
    script = (
        "import sys, warnings\n"
        "warnings.simplefilter('ignore')\n"
        "from torch.distributed.checkpoint.format_utils import dcp_to_torch_save\n"
        "dcp_to_torch_save(sys.argv[1], sys.argv[2])\n"
        "assert not [m for m in sys.modules if m.startswith('boost_titan')]\n"
    )
    proc = subprocess.run(
        [PYTHON, "-I", "-c", script, str(step), str(tmp_path / "plain.pt")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = torch.load(tmp_path / "plain.pt", weights_only=False)
    ours = _load_state_dict_from_keys(checkpoint_id=str(step))
    assert plain.keys() == ours.keys() and {"model", "optimizer", "train_state"} <= {
        k.split(".")[0] for k in plain
    } | {"model"}
    tensors = 0

    def same(a, b, key) -> None:
        nonlocal tensors
        if isinstance(a, dict):
            assert a.keys() == b.keys(), key
            for k in a:
                same(a[k], b[k], f"{key}.{k}")
        elif isinstance(a, torch.Tensor):
            tensors += 1
            assert torch.equal(a, b), key
        else:
            assert a == b, key

    same(plain, ours, "")
    assert tensors > 100 and plain["train_state"]["step"] == 4
