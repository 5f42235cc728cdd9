"""What sealing checkpoints (boost_titan.checkpoint.integrity) costs: DCP save and load of a
>= 1 GB state dict sealed (every item digested as it is written, the manifest, every
item checked against it as it is read) and plain (torch's own DCP save, whose load
then checks nothing).

    PYTHONPATH=. .venv/bin/python benchmarks/checkpoint_integrity.py [--reps 15] [--dir D]

The state dict is one TP8 rank's shard of 10 blocks of a 7B LLaMA in fp32 (per block
wq/wk/wv/wo 4096x512, w1/w3 1376x4096, w2 4096x1376; plus a 32000x512 embedding and
output shard): 70 + 2 tensors, 1.09 GiB. One process, no process group
(``no_dist=True``), DCP's defaults (one file, fsync on save). "without": the writer is
given ``_extensions=()``, a plain DCP save, torch's code only (what a save did before
boost_titan.checkpoint.integrity); its load opens the step as every load does and reads
it unverified. The two variants alternate, rep by
rep, in one process, each saving into (and loading from) its own folder; the load reads
what the save just wrote, from the page cache (the case where verification's share of
the time is largest: a load from disk adds the disk's time to both). Prints the median
seconds of each and the median of the per-rep ratios (with / without), in wall time
and in this process's CPU time (less sensitive to other processes on the machine; a
save's fsync wait is wall time only); then xxh3_64's rate on one core and the read and
write rates of the plain runs, and from them what sealing adds to one rank's shard of
the CoLA 7B recipe (``recipes/cola_llama2_7b.toml``: TP4 x FSDP2 on 8 GPUs, 2.82e9
parameters in fp32 with AdamW's two moments: 3.94 GiB per rank) if none of the hashing
were hidden behind the I/O (it runs in a helper thread beside it)."""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from boost_titan.checkpoint import integrity
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


def save(state, path: Path, checksums: bool) -> tuple[float, float]:
    writer = FileSystemWriter(path) if checksums else FileSystemWriter(path, _extensions=())
    return timed(lambda: dcp.save(state, storage_writer=writer, no_dist=True))


def hash_rate() -> float:
    """xxh3_64 over 1 MiB blocks on one core, bytes/s (best of 5 passes over 256 MiB)."""
    data = memoryview(torch.randint(0, 256, (256 << 20,), dtype=torch.uint8).numpy())
    best = min(timed(lambda: block_digests(data))[0] for _ in range(5))
    return len(data) / best


def load(target, path: Path) -> tuple[float, float]:
    return timed(lambda: dcp.load(target, checkpoint_id=str(path), no_dist=True))


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
    times: dict[tuple[str, bool], list[tuple[float, float]]] = {}
    try:
        for rep in range(args.reps + 1):  # rep 0 warms up (allocator, page cache)
            for checksums in (rep % 2 == 0, rep % 2 == 1):  # alternate which goes first
                path = root / ("with" if checksums else "without")
                shutil.rmtree(path, ignore_errors=True)
                s = save(state, path, checksums)
                ld = load(target, path)
                assert all(torch.equal(target[k], state[k]) for k in state)
                if rep == 0:
                    assert integrity.check(path).checksummed == checksums
                if rep:
                    times.setdefault(("save", checksums), []).append(s)
                    times.setdefault(("load", checksums), []).append(ld)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"state dict: {len(state)} tensors, {nbytes / 2**30:.2f} GiB; {args.reps} reps")
    medians = {}
    for op in ("save", "load"):
        for i, clock in enumerate(("wall", "CPU")):
            with_ = [t[i] for t in times[(op, True)]]
            without = [t[i] for t in times[(op, False)]]
            ratios = [a / b for a, b in zip(with_, without)]
            medians[(op, clock)] = statistics.median(without)
            print(
                f"{op} ({clock} s): without {statistics.median(without):.3f}, sealed "
                f"{statistics.median(with_):.3f}; sealed/without: median "
                f"{statistics.median(ratios):.3f} (per rep {', '.join(f'{r:.3f}' for r in ratios)})"
            )
    rate = hash_rate()
    write, read = nbytes / medians[("save", "wall")], nbytes / medians[("load", "wall")]
    shard = COLA_7B_SHARD
    print(
        f"xxh3_64 on one core: {rate / 1e9:.2f} GB/s; plain DCP here: save {write / 1e9:.2f} "
        f"GB/s, load {read / 1e9:.2f} GB/s (page cache)"
    )
    print(
        f"CoLA 7B rank shard ({shard / 2**30:.2f} GiB): hashing is {shard / rate:.2f} s of one "
        f"core; plain save {shard / write:.2f} s, load {shard / read:.2f} s at these rates: "
        f"at most {1 + write / rate:.3f}x save, {1 + read / rate:.3f}x load with none of it "
        "hidden behind the I/O"
    )


if __name__ == "__main__":
    main()
