"""What sealing checkpoints (boost_titan.checkpoint.integrity) costs: DCP save and load of a
>= 1 GB state dict sealed (every item digested as it is written, the manifest, every
item checked against it as it is read) and plain (torch's own DCP save and load).

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_integrity.py [--reps 15] [--dir D]

The state dict is one TP8 rank's shard of 10 blocks of a 7B LLaMA in fp32 (per block
wq/wk/wv/wo 4096x512, w1/w3 1376x4096, w2 4096x1376; plus a 32000x512 embedding and
output shard): 70 + 2 tensors, 1.06 GiB. One process, no process group
(``no_dist=True``), DCP's defaults (one file, fsync on save). "plain": the writer is
given ``_extensions=()``, a plain DCP save, torch's code only; its load opens the step
as every load does, then torch's own loop reads it unverified. Saves first, then
loads, each variant in its own folder, alternating rep by rep which goes first, in one
process; the loads read from the page cache (the case where verification's share of
the time is largest: a load from disk adds the disk's time to both). Loads: "sealed"
(each tensor read in place, ``integrity/in_place.py``), "sealed, staged" (every item
through the staging buffer and ``copy_``, as a load into GPU tensors reads on the
host), "sealed, unhashed" (the sealed load with no digest computed: hashing's share).
Prints the median seconds of each, the median of the per-rep ratios and the ratio of
the best reps, in wall time and in this process's CPU time (a save's fsync wait is
wall time only); then xxh3_64's rate on one core, the rates of the runs, and from them
what sealing means for one rank's shard of the CoLA 7B recipe
(``recipes/cola_llama2_7b.toml``: TP4 x FSDP2 on 8 GPUs, 2.82e9 parameters in fp32 with
AdamW's two moments: 3.94 GiB per rank)."""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from unittest.mock import patch

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from boost_titan.checkpoint import integrity
from boost_titan.checkpoint.integrity import blocks, in_place
from boost_titan.checkpoint.integrity.blocks import block_digests

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state_dict() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = {"tok_embeddings.weight": (32000, 512), "output.weight": (32000, 512)}
    for i in range(10):
        for w in ("wq", "wk", "wv", "wo"):
            shapes[f"layers.{i}.attention.{w}.weight"] = (4096, 512)
        for w in ("w1", "w3"):
            shapes[f"layers.{i}.feed_forward.{w}.weight"] = (1376, 4096)
        shapes[f"layers.{i}.feed_forward.w2.weight"] = (4096, 1376)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def timed(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


COLA_7B_SHARD = 2_820_935_680 * 12 / 8  # bytes: fp32 parameters + 2 AdamW moments, 8 ranks


def save(state, path: Path, checksums: bool, sync: bool = True) -> tuple[float, float]:
    extensions = {} if checksums else {"_extensions": ()}
    writer = FileSystemWriter(path, sync_files=sync, **extensions)
    return timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))


def hash_rate() -> float:
    """xxh3_64 over 1 MiB blocks on one core, bytes/s (best of 5 passes over 256 MiB)."""
    data = memoryview(torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy())
    best = min(timed(lambda: block_digests(data))[0] for _ in range(5))
    return len(data) / best


def load(target, path: Path) -> tuple[float, float]:
    return timed(lambda: dcp.load(target, checkpoint_id=str(path), no_dist=True))


@contextmanager
def staged():
    """Every item through the staging buffer and ``copy_``, as a load into tensors on
    a GPU (or of another dtype) reads: the host's side of such a load."""
    with patch.object(in_place, "takes_bytes_as_stored", lambda target, wanted: False):
        yield


@contextmanager
def unhashed():
    """The sealed load with no digest computed or checked (for this figure only):
    what reading in place costs without the seal, so that hashing's share shows."""
    with (
        patch.object(blocks.VerifyingReader, "_digest_at", staticmethod(lambda address, n: b"")),
        patch.object(blocks.VerifyingReader, "_check", lambda self, k, count, found: None),
    ):
        yield


# (what is loaded, how): "plain" is torch's own DCP load of an unsealed step
LOADS = {
    "plain": ("without", nullcontext),
    "sealed": ("with", nullcontext),
    "sealed, staged": ("with", staged),
    "sealed, unhashed": ("with", unhashed),
}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--dir", help="where to write (default: a temporary folder)")
    args = p.parse_args()
    integrity.install()
    state = state_dict()
    nbytes = sum(t.nbytes for t in state.values())
    target = {k: torch.empty_like(v) for k, v in state.items()}
    root = Path(tempfile.mkdtemp(prefix="ckpt_integrity_", dir=args.dir))
    saves: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    loads: dict[str, list[tuple[float, float]]] = {name: [] for name in LOADS}
    try:
        # the saves first, then the loads: a load frees (or not) a GiB of fresh tensors,
        # which would change what the next save's writes cost; within each phase the
        # variants alternate which goes first
        for rep in range(args.reps + 1):  # rep 0 warms up (allocator, page cache)
            for checksums in (rep % 2 == 0, rep % 2 == 1):
                path = root / ("with" if checksums else "without")
                shutil.rmtree(path, ignore_errors=True)
                s = save(state, path, checksums)
                if rep:
                    saves[checksums].append(s)
                else:
                    assert integrity.check(path).checksummed == checksums
        for rep in range(args.reps + 1):
            for name in list(LOADS) if rep % 2 == 0 else list(reversed(LOADS)):
                folder, how = LOADS[name]
                for t in target.values():
                    t.zero_()
                with how():
                    ld = load(target, root / folder)  # from the page cache
                assert all(torch.equal(target[k], state[k]) for k in state), name
                if rep:
                    loads[name].append(ld)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state dict: {len(state)} tensors, {nbytes / 2**30:.2f} GiB; {args.reps} reps")

    def compare(what: str, with_: list, without: list, against: str) -> None:
        for i, clock in enumerate(("wall", "CPU")):
            a, b = [t[i] for t in with_], [t[i] for t in without]
            ratios = [x / y for x, y in zip(a, b)]
            print(
                f"{what} ({clock} s): {statistics.median(a):.3f} against {against} "
                f"{statistics.median(b):.3f}: median ratio {statistics.median(ratios):.3f}, "
                f"best against best {min(a) / min(b):.3f} "
                f"(per rep {', '.join(f'{r:.3f}' for r in ratios)})"
            )

    compare("save sealed", saves[True], saves[False], "plain")
    for name in ("sealed", "sealed, staged"):
        compare(f"load {name}", loads[name], loads["plain"], "plain")
    compare("load sealed", loads["sealed"], loads["sealed, unhashed"], "sealed, unhashed")
    rate = hash_rate()
    write = nbytes / statistics.median(t[0] for t in saves[False])
    read = {name: nbytes / statistics.median(t[0] for t in ts) for name, ts in loads.items()}
    shard = COLA_7B_SHARD
    print(
        f"xxh3_64 on one core: {rate / 1e9:.2f} GB/s; here (page cache): plain DCP save "
        f"{write / 1e9:.2f} GB/s, load {read['plain'] / 1e9:.2f} GB/s, sealed load "
        f"{read['sealed'] / 1e9:.2f} GB/s (staged {read['sealed, staged'] / 1e9:.2f} GB/s)"
    )
    print(
        f"CoLA 7B rank shard ({shard / 2**30:.2f} GiB): hashing is {shard / rate:.2f} s of one "
        f"core; at these rates a plain save {shard / write:.2f} s, sealed at most "
        f"{1 + write / rate:.3f}x that with none of the hashing hidden behind the writes; "
        f"a plain load {shard / read['plain']:.2f} s, sealed {shard / read['sealed']:.2f} s "
        f"(staged {shard / read['sealed, staged']:.2f} s)"
    )


if __name__ == "__main__":
    main()
