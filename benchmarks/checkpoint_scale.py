"""What sealing a DCP step costs at scale, against plain DCP, side by side (issue #48).

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_scale.py [--items N] [--files F]

Synthesizes, without any process group, what a save from F ranks hands the
coordinator (every rank's write results: ``_StorageInfo`` records, with the digests our
writes attach) and the ``.metadata`` DCP pickles from them; the default is a CoLA 30B
step at 1,024 ranks (579 tensors x 3 states, model and both AdamW moments, each cut in
1,024 row chunks: 1,778,688 items in 1,024 files). ``--items`` makes it smaller (fewer
tensors) for a quick check. The data files are sparse stand-ins of the right sizes:
only metadata is read here, never an item.

Prints, for the coordinator at save (torch's ``_FileSystemWriter.finish``: pickling and
writing ``.metadata``, against ours: the manifest too) and for one rank at load
(torch's ``read_metadata``: unpickling ``.metadata``, against ours: ``open_step``, the
step opened and checked as every load opens it, then the section of the one file
that rank reads, ``Step.reading``, as its load plan reads it; then again, as a resume
opens it more than once): seconds, peak RSS above the phase's start, RSS still held after it
(``gc.collect`` done), and the file system calls made (``os.stat``, ``os.lstat``,
``open``/``os.open``, ``os.path.realpath``; realpath's own lstats are counted under
lstat too), with our figure over plain DCP's; and what ours spends beyond the
unpickling of ``.metadata`` it does too (``safe_metadata.loads``, collector paused, as
``open_step`` unpickles it), and its manifest's part alone (the root read and checked,
the rank's own section read, checked and parsed), against what plain DCP spends
reading ``.metadata``."""

from __future__ import annotations

import argparse
import builtins
import ctypes
import gc
import io
import os
import pickle
import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from boost_titan.checkpoint import safe_metadata
from boost_titan.checkpoint.integrity import dcp_hooks, manifest, step, step_files

STATES = ("", "optimizer.state.{}.exp_avg", "optimizer.state.{}.exp_avg_sq")
ROWS, COLS = 8, 6400  # one rank's chunk of a tensor: 8 x 6400 fp32 (52M-parameter tensors)
HEADER, TAIL = 1088, 1473  # torch.save's archive around a tensor's data (small writes)


# ---------------------------------------------------------------- measuring


class Calls:
    """Counts file system calls by wrapping them (restored on exit)."""

    NAMES = (
        ("os", "stat"),
        ("os", "lstat"),
        ("os", "open"),
        ("os", "scandir"),
        ("os.path", "realpath"),
    )

    def __enter__(self) -> Counter:
        self.count: Counter = Counter()
        self.saved = []
        for module, name in self.NAMES:
            owner = os.path if module == "os.path" else os
            self._wrap(owner, name, name)
        self._wrap(builtins, "open", "open")
        self._wrap(io, "open", "open")
        return self.count

    def _wrap(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)
        count = self.count

        def counted(*args, **kwargs):
            count[label] += 1
            return real(*args, **kwargs)

        self.saved.append((owner, name, real))
        setattr(owner, name, counted)

    def __exit__(self, *exc) -> None:
        for owner, name, real in reversed(self.saved):
            setattr(owner, name, real)


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _settle() -> None:
    """Frees what the last phase left (so the next one starts from the same floor)."""
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def measure(fn) -> dict:
    """Seconds, peak RSS above the start, RSS held after, and the calls of ``fn()``."""
    _settle()
    start = _rss("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:  # VmHWM from here
        f.write("5")
    with Calls() as calls:
        t0 = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - t0
    peak = _rss("VmHWM") - start
    del result
    _settle()
    return {"s": seconds, "peak": peak, "held": _rss("VmRSS") - start, "calls": calls}


# ---------------------------------------------------------------- synthesizing


def shape(items: int, files: int) -> int:
    """Tensors for ``items`` (3 states of each, one chunk per file)."""
    return max(1, round(items / (len(STATES) * files)))


def fqns(tensors: int) -> list[str]:
    names = [f"model.layers.{t // 9}.part{t % 9}.weight" for t in range(tensors)]
    return [state.format(n) if state else n for n in names for state in STATES]


def results(tensors: int, files: int) -> tuple[Metadata, list[list[WriteResult]], dict]:
    """The Metadata a coordinator gets from the planner (no storage yet) and every
    rank's write results as gathered (our digests resolved: ``writing.Digests``), and
    each file's size."""
    data = ROWS * COLS * 4
    length = HEADER + data + TAIL
    segments = [HEADER, data, TAIL]
    digests = bytes(8 * 3)  # one block per segment (a chunk below a 1 MiB block)
    sdm, per_rank = {}, [[] for _ in range(files)]
    offsets = [0] * files
    for fqn in fqns(tensors):
        chunks = [
            ChunkStorageMetadata(torch.Size([ROWS * r, 0]), torch.Size([ROWS, COLS]))
            for r in range(files)
        ]
        size = torch.Size([ROWS * files, COLS])
        sdm[fqn] = TensorStorageMetadata(TensorProperties(dtype=torch.float32), size, chunks)
        for r, chunk in enumerate(chunks):
            info = _StorageInfo(f"__{r}_0.distcp", offsets[r], length)
            offsets[r] += length
            info.__dict__[dcp_hooks._DIGESTS] = (segments, digests)
            per_rank[r].append(WriteResult(MetadataIndex(fqn, chunk.offsets, r), length, info))
    planner = {k: tuple(k.split(".")) for k in sdm}
    sizes = {f"__{r}_0.distcp": offsets[r] for r in range(files)}
    return Metadata(sdm, planner_data=planner), per_rank, sizes


def writer(folder: Path) -> filesystem.FileSystemWriter:
    w = filesystem.FileSystemWriter(folder, sync_files=True)
    w.set_up_storage_writer(True, rank=0, use_collectives=True)
    w.save_id = "bench-save"
    return w


def sparse_files(folder: Path, sizes: dict) -> None:
    """The data files of a step: sparse, of their sizes (only metadata is ever read)."""
    for name, size in sizes.items():
        with open(folder / name, "wb") as f:
            f.truncate(size)


def sealed_step(folder: Path, tensors: int, files: int) -> None:
    """A step of ``files`` ranks as our save leaves it (``.metadata``, the manifest,
    sparse data files), written without measuring (for benchmarks that load it)."""
    metadata, per_rank, sizes = results(tensors, files)
    per_rank = [dcp_hooks._with_part(wrs) for wrs in per_rank]
    dcp_hooks.finish(writer(folder), metadata, per_rank)
    sparse_files(folder, sizes)


# ---------------------------------------------------------------- phases


def save(finish, folder: Path, tensors: int, files: int, parts: bool) -> tuple[dict, dict, float]:
    """``finish`` measured on the coordinator of a save of ``folder``; the files' sizes;
    with ``parts``, each rank's part of the manifest made first, as its write_data makes
    it (``dcp_hooks._with_part``, on every rank in parallel before the gather: its
    seconds, averaged over the ranks, outside the coordinator's)."""
    metadata, per_rank, sizes = results(tensors, files)
    t0 = time.perf_counter()
    if parts:
        per_rank = [dcp_hooks._with_part(wrs) for wrs in per_rank]
    rank_s = (time.perf_counter() - t0) / files
    w = writer(folder)
    return measure(lambda: finish(w, metadata, per_rank)), sizes, rank_s


def row(name: str, plain: dict, ours: dict) -> list[str]:
    def mib(n: int) -> str:
        return f"{n / 2**20:.0f} MiB"

    def ratio(a, b) -> str:
        return f"x{a / b:.2f}" if b else ("x1.00" if a == b else "-")

    lines = [f"{name}"]
    pc, oc = sum(plain["calls"].values()), sum(ours["calls"].values())
    for what, p, o in (
        ("seconds", f"{plain['s']:.2f}", f"{ours['s']:.2f}"),
        ("peak RSS", mib(plain["peak"]), mib(ours["peak"])),
        ("RSS held after", mib(plain["held"]), mib(ours["held"])),
        ("fs calls", str(pc), str(oc)),
    ):
        r = {
            "seconds": ratio(ours["s"], plain["s"]),
            "peak RSS": ratio(ours["peak"], plain["peak"]),
            "RSS held after": "",
            "fs calls": ratio(oc, pc),
        }[what]
        lines.append(f"  {what:<15} {p:>12} {o:>12}  {r}")
    detail = ", ".join(f"{k} {v}" for k, v in sorted(ours["calls"].items()))
    lines.append(f"  {'(ours: calls)':<15} {detail}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=579 * 3 * 1024)
    ap.add_argument("--files", type=int, default=1024)
    ap.add_argument("--dir", default=None, help="where to write the steps (default: a temp dir)")
    args = ap.parse_args()
    tensors = shape(args.items, args.files)
    root = Path(tempfile.mkdtemp(prefix="ckpt-scale-", dir=args.dir))
    try:
        plain_step, our_step = root / "plain" / "step-100", root / "ours" / "step-100"
        for folder in (plain_step, our_step):
            folder.mkdir(parents=True)
        print(
            f"{tensors * len(STATES) * args.files:,} items ({tensors} tensors x 3 states x "
            f"{args.files} chunks), {args.files} files, in {root}"
        )

        # the coordinator at save: results built outside the timing, afresh for each
        parts = hasattr(dcp_hooks, "_with_part")  # (a rank's part: since #48)
        plain_save, _, _ = save(dcp_hooks._torch_finish, plain_step, tensors, args.files, False)
        our_save, sizes, rank_s = save(dcp_hooks.finish, our_step, tensors, args.files, parts)
        sparse_files(our_step, sizes)

        # one rank at load
        def plain_load():
            with open(plain_step / ".metadata", "rb") as f:  # torch's read_metadata
                return pickle.load(f)

        def our_load():
            opened = step.open_step(our_step)
            if hasattr(opened, "reading"):  # (a rank's own file's section: since seal/2)
                opened.reading("__0_0.distcp")
            return opened

        def our_unpickle():
            data = (our_step / ".metadata").read_bytes()
            with manifest.gc_paused():
                return safe_metadata.loads(data, str(our_step))

        def our_manifest():  # the manifest's share of open_step: its root, the rank's section
            seal = step_files.read_manifest(str(our_step))
            if seal.sections is not None:
                manifest.load_section(seal, "__0_0.distcp", manifest.mismatch(str(our_step), ""))
            return seal

        plain_first = measure(plain_load)
        unpickle = measure(our_unpickle)
        parts = measure(our_manifest) if hasattr(step_files, "read_manifest") else None
        step._parsed.clear()  # a fresh rank
        floor = _rss("VmRSS")
        ours_first = measure(our_load)
        ours_again = measure(our_load)
        getattr(step, "release", lambda: None)()  # the load ends (CheckpointManager.load)
        _settle()
        kept = _rss("VmRSS") - floor
        # (after the release: a parse still held would slow every collection of plain's)
        plain_again = measure(plain_load)

        mib = [os.path.getsize(p) / 2**20 for p in (plain_step / ".metadata", our_step / step.NAME)]
        print(f".metadata {mib[0]:.0f} MiB, manifest {mib[1]:.0f} MiB")
        print(f"{'':<17} {'plain DCP':>12} {'ours':>12}  ours/plain")
        for line in (
            row("coordinator at save (finish)", plain_save, our_save)
            + row("one rank at load (read .metadata / open_step)", plain_first, ours_first)
            + row("the same rank, opening it again", plain_again, ours_again)
        ):
            print(line)
        print(f"ours, each rank before the gather (its part of the manifest): {rank_s:.4f} s")
        print(f"ours, RSS kept after the load ends: {kept / 2**20:.0f} MiB")
        if parts is not None:
            print(
                f"ours, the manifest's part (root, the rank's section): {parts['s']:.3f} s, "
                f"{100 * parts['s'] / plain_first['s']:.2f}% of plain DCP's read of .metadata, "
                f"peak RSS {parts['peak'] / 2**20:.0f} MiB"
            )
        extra = ours_first["s"] - unpickle["s"]
        print(
            f"ours beyond unpickling .metadata ({unpickle['s']:.2f} s, collector paused): "
            f"{extra:.3f} s, {100 * extra / plain_first['s']:.1f}% of plain DCP's read of "
            f".metadata ({plain_first['s']:.2f} s)"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
