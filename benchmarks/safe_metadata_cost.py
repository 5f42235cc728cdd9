"""What reading DCP metadata through boost_titan.checkpoint.safe_metadata costs against
plain pickle.

    PYTHONPATH=. .venv/bin/python benchmarks/safe_metadata_cost.py [STEP_DIR ...]

For each step folder given (a real checkpoint) and for a synthetic metadata of
7B-model size (290 tensors x 3 for weights and AdamW moments, 8 shards each), prints
the medians of N unpickles of the in-memory ``.metadata`` (no file I/O) with
``pickle.loads`` and with the allowlisted unpickler, alternating, and the median of
their per-rep ratio."""

from __future__ import annotations

import pickle
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from boost_titan.checkpoint import safe_metadata


def synthetic(tensors: int = 870, shards: int = 8) -> bytes:
    """A Metadata shaped like a 7B checkpoint saved from 8 ranks (what DCP would pickle)."""
    sdm, storage = {}, {}
    for t in range(tensors):
        fqn = f"model.layers.{t // 9}.part{t % 9}.weight"
        chunks = [
            ChunkStorageMetadata(torch.Size([512 * s, 0]), torch.Size([512, 4096]))
            for s in range(shards)
        ]
        sdm[fqn] = TensorStorageMetadata(
            TensorProperties(dtype=torch.float32), torch.Size([4096, 4096]), chunks
        )
        for s, c in enumerate(chunks):
            storage[MetadataIndex(fqn, c.offsets, s)] = _StorageInfo(
                f"__{s}_0.distcp", t * 1000, 1000
            )
    meta = Metadata(
        sdm,
        planner_data={k: tuple(k.split(".")) for k in sdm},
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=Path("/x/step-1"), save_id="id"),
    )
    return pickle.dumps(meta)


def _seconds(fn, data: bytes) -> float:
    t0 = time.perf_counter()
    fn(data)
    return time.perf_counter() - t0


def timings(data: bytes, where: str, reps: int) -> tuple[float, float, float]:
    """Medians of plain and safe unpickling and of their per-rep ratio; the two
    alternate within each rep so that a busy machine slows both alike."""
    plain, safe, ratio = [], [], []
    for _ in range(reps):
        p = _seconds(pickle.loads, data)
        s = _seconds(lambda b: safe_metadata.loads(b, where), data)
        plain.append(p)
        safe.append(s)
        ratio.append(s / p)
    return statistics.median(plain), statistics.median(safe), statistics.median(ratio)


def main() -> None:
    cases = [(f"{d} (real)", (Path(d) / ".metadata").read_bytes()) for d in sys.argv[1:]]
    cases.append(("synthetic 7B, 8 shards", synthetic()))
    print(f"{'metadata':<60} {'bytes':>9} {'pickle ms':>10} {'safe ms':>10} {'ratio':>6}")
    for name, data in cases:
        reps = max(11, min(2001, int(2e7 / len(data))))
        safe_metadata.loads(data, name)  # warm (and: it reads it at all)
        pickle.loads(data)
        plain, safe, ratio = timings(data, name, reps)
        print(
            f"{name[-60:]:<60} {len(data):>9} {plain * 1e3:>10.3f} {safe * 1e3:>10.3f} "
            f"{ratio:>6.2f}  (medians of {reps})"
        )


if __name__ == "__main__":
    main()
