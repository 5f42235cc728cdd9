"""How a sealed step is read (boost_titan.checkpoint.integrity.in_place, .blocks): digests
computed by xxhash's C function through ctypes (the GIL released) equal xxhash's own;
every tensor of a sealed step is read straight into its target, through one reused
buffer when the target cannot take the bytes as stored, or by torch's path when the
bytes it wants are no contiguous run; every path gives the tensors torch's own load
gives and still refuses a flipped bit; a file cut short under a reader is a
mismatch, not a crash (the reader maps the file)."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.utils import _create_file_view

from boost_titan.checkpoint import integrity
from boost_titan.checkpoint.integrity import blocks, in_place
from boost_titan.checkpoint.integrity.blocks import ChecksumMismatch, Item, VerifyingReader
from boost_titan.checkpoint.integrity.manifest import key
from boost_titan.checkpoint.integrity.step import open_step

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(autouse=True)
def _installed():
    integrity.install()


@pytest.fixture(params=["ctypes", "python"])
def hashing(request, monkeypatch):
    """Each test twice: with xxhash's C function through ctypes (GIL-free; skipped where
    the extension hides the symbol, as on some aarch64 builds) and with its Python
    functions, the fallback there (forced here)."""
    if request.param == "ctypes" and not blocks.GIL_FREE:
        pytest.skip("this xxhash build does not expose XXH3_64bits_dispatch")
    if request.param == "python":
        monkeypatch.setattr(blocks, "_xxh3", None)
        monkeypatch.setattr(blocks, "GIL_FREE", False)
    return request.param


def test_the_pinned_xxhash_exposes_its_c_function():
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip(f"checked on x86_64 (here {platform.machine()}: the fallback serves)")
    assert blocks.GIL_FREE


def test_gil_free_digests_are_xxhash(hashing):
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (3 * 2**20 + 77,), dtype=torch.uint8, generator=g)
    raw = data.numpy().tobytes()
    for n in (0, 1, 7, 4099, 2**20, 2**20 + 5, len(raw)):
        expected = xxhash.xxh3_64_digest(raw[:n])
        assert blocks.digest(raw[:n]) == expected  # bytes (read-only)
        assert blocks.digest(bytearray(raw[:n])) == expected
        assert blocks.digest(memoryview(data.numpy())[:n]) == expected
    view = memoryview(raw)[5:]
    bounds = [(5, 2**20), (5 + 2**20, 2**20), (5 + 2**21, len(raw) - 5 - 2**21)]
    assert blocks.digests_of(view, bounds, base=5) == b"".join(
        xxhash.xxh3_64_digest(raw[s : s + n]) for s, n in bounds
    )
    with pytest.raises(ValueError, match="outside"):  # never an address past the buffer
        blocks.digests_of(view, [(5, len(raw))], base=5)


def _stored_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "big": torch.randn(600, 1024, generator=g),  # 2.4 MiB: three blocks and a tail
        "half": torch.randn(300, 700, generator=g).to(torch.bfloat16),
        "ids": torch.randint(0, 2**40, (1000,), generator=g),
        "transposed": torch.randn(700, 300, generator=g).t(),  # stored non-contiguous
        "empty": torch.zeros(0, 8),
        "scalar": torch.tensor(3.5),
    }


def test_every_path_loads_what_torch_loads(tmp_path, monkeypatch, hashing):
    ref = _stored_tensors()
    dcp.save(ref, storage_writer=FileSystemWriter(tmp_path / "step-1"), no_dist=True)
    calls = []
    torch_load = torch.load
    monkeypatch.setattr(
        torch,
        "load",
        lambda *a, **kw: calls.append(str(kw.get("map_location"))) or torch_load(*a, **kw),
    )

    # same dtype, contiguous CPU targets: read in place, into the targets' own memory
    same = {k: torch.full_like(v.contiguous(), 7) for k, v in ref.items()}
    where = {k: v.data_ptr() for k, v in same.items()}
    dcp.load(same, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    for k, v in ref.items():
        assert torch.equal(same[k], v), k
        assert same[k].data_ptr() == where[k], k
    # every item's header read to the meta device (DCP plans no read of "empty": no
    # bytes), torch's path (a full load to the CPU) only for the one stored non-contiguous
    assert calls.count("cpu") == 1 and calls.count("meta") == len(ref) - 1

    # other dtypes, non-contiguous targets: through the staging buffer, then copy_
    calls.clear()
    other = {
        "big": torch.zeros(600, 1024, dtype=torch.bfloat16),
        "half": torch.zeros(300, 700),
        "ids": torch.zeros(1000, dtype=torch.float64),
        "transposed": torch.zeros(300, 700),
        "empty": torch.zeros(0, 8, dtype=torch.float16),
        "scalar": torch.zeros((), dtype=torch.float64),
    }
    other["big"] = torch.zeros(1024, 600, dtype=torch.bfloat16).t()  # non-contiguous too
    dcp.load(other, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    for k, v in ref.items():
        assert torch.equal(other[k], v.to(other[k].dtype)), k
    assert calls.count("cpu") == 1


def _reader(step_dir: Path, fqn: str, f) -> VerifyingReader:
    step = open_step(step_dir, whole=True)  # (every item's entry)
    index, info = next((i, s) for i, s in step.metadata.storage_data.items() if i.fqn == fqn)
    entry = step.seal.items[key(index)]
    raw = _create_file_view(f, info.offset, info.length)
    item = Item(str(step_dir), info.relative_path, f"item {fqn}", info.offset)
    return VerifyingReader(
        raw,
        entry.length,
        entry.digests,
        item,
        blocks.segment_blocks(entry.segments, step.seal.block),
    )


class _Planner:
    def __init__(self, target):
        self.target, self.committed = target, 0

    def resolve_tensor(self, req):
        return self.target

    def commit_tensor(self, req, tensor):
        assert tensor.data_ptr() == self.target.data_ptr()  # (a detached view of it)
        self.committed += 1


def test_a_chunk_reads_its_run_and_checks_its_blocks(tmp_path, hashing):
    ref = _stored_tensors()["big"]
    step = tmp_path / "step-1"
    dcp.save({"big": ref}, storage_writer=FileSystemWriter(step), no_dist=True)
    file = step / "__0_0.distcp"
    # rows 100..399: one run from inside the first block to inside the third
    rows = SimpleNamespace(storage_offsets=[100, 0], lengths=[300, 1024])
    with open(file, "rb") as f:
        planner = _Planner(torch.zeros(300, 1024))
        assert in_place._read_in_place(_reader(step, "big", f), rows, planner, in_place._Staging())
        assert planner.committed == 1 and torch.equal(planner.target, ref[100:400])
        # columns 0..199: no contiguous run: torch's path, nothing read or committed
        cols = SimpleNamespace(storage_offsets=[0, 0], lengths=[600, 200])
        planner = _Planner(torch.zeros(600, 200))
        reader = _reader(step, "big", f)
        assert not in_place._read_in_place(reader, cols, planner, in_place._Staging())
        assert planner.committed == 0 and not planner.target.any() and reader.tell() == 0
    # a flipped bit in row 350 (inside the third block) fails the chunk's read
    data = bytearray(file.read_bytes())
    at = data.find(ref[350].numpy().tobytes())
    data[at + 11] ^= 0x10
    file.write_bytes(bytes(data))
    with open(file, "rb") as f, pytest.raises(ChecksumMismatch, match=r"item big: xxh3_64"):
        in_place._read_in_place(
            _reader(step, "big", f), rows, _Planner(torch.zeros(300, 1024)), in_place._Staging()
        )
    # and the whole load fails on the same line
    with pytest.raises(BaseException) as info:
        dcp.load({"big": torch.zeros(600, 1024)}, checkpoint_id=str(step), no_dist=True)
    assert "item big: xxh3_64 of its bytes" in str(integrity.mismatch_in(info.value))


def test_a_file_cut_under_the_reader_is_a_mismatch_and_a_stream_is_read(tmp_path):
    ref = _stored_tensors()["big"]
    step = tmp_path / "step-1"
    dcp.save({"big": ref}, storage_writer=FileSystemWriter(step), no_dist=True)
    file = step / "__0_0.distcp"
    whole = file.read_bytes()
    # a stream that is no file (no descriptor to map): read, then hashed, same result
    with open(file, "rb") as f:
        reader = _reader(step, "big", f)
    reader._file = None
    reader.raw = _create_file_view(io.BytesIO(whole), reader.item.offset, reader.size)
    out = torch.zeros(600, 1024)
    planner = _Planner(out)
    full = SimpleNamespace(storage_offsets=[0, 0], lengths=[600, 1024])
    assert in_place._read_in_place(reader, full, planner, in_place._Staging())
    assert torch.equal(out, ref)
    # the file cut short after the step was opened: one line, no SIGBUS from the map
    with open(file, "rb") as f:
        reader = _reader(step, "big", f)
        os.truncate(file, len(whole) - 3 * 2**20 // 2)
        with pytest.raises(ChecksumMismatch, match="the file ends before the item's"):
            in_place._read_in_place(reader, full, _Planner(out), in_place._Staging())


def test_plain_steps_take_torchs_path(tmp_path, monkeypatch):
    ref = _stored_tensors()
    step = tmp_path / "step-1"
    dcp.save(ref, storage_writer=FileSystemWriter(step, _extensions=()), no_dist=True)
    monkeypatch.setattr(in_place, "_read_in_place", lambda *a: pytest.fail("not sealed"))
    out = {k: torch.zeros_like(v.contiguous()) for k, v in ref.items()}
    dcp.load(out, storage_reader=FileSystemReader(step), no_dist=True)
    assert all(torch.equal(out[k], v) for k, v in ref.items())
