"""A safetensors file written one tensor at a time, never holding them all.

``safetensors.torch.save_file`` takes every tensor at once: an export through it holds
the whole model (at 1.2B, export peaked at 3.4x the memory of the conversion that wrote
the step). The format needs only the names, dtypes and shapes up front: an 8-byte
little-endian header length, the JSON header (each tensor's dtype, shape and
``data_offsets``, and the ``__metadata__`` strings), padded with spaces to 8 bytes, then
the tensors' bytes end to end. :func:`write_safetensors` writes that header from the
specs, then asks ``fetch`` for each tensor in file order and writes its bytes before
asking for the next.

The layout is the one ``safetensors`` (0.4 - 0.8) writes: tensors ordered by dtype
(its ``Dtype`` enum, largest first) then name, compact JSON, the same padding; the
``__metadata__`` keys sorted (``save_file`` writes them in a Rust ``HashMap``'s order,
which differs from run to run). ``tests/test_export_stream.py`` checks that the files
hold exactly what ``save_file`` writes.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable

import torch

# torch dtype -> (safetensors name, its place in safetensors' Dtype enum)
_DTYPES = {
    torch.bool: ("BOOL", 0),
    torch.uint8: ("U8", 4),
    torch.int8: ("I8", 5),
    torch.int16: ("I16", 9),
    torch.float16: ("F16", 11),
    torch.bfloat16: ("BF16", 12),
    torch.int32: ("I32", 13),
    torch.float32: ("F32", 15),
    torch.float64: ("F64", 16),
    torch.int64: ("I64", 17),
}

Spec = tuple[tuple[int, ...], torch.dtype]  # (shape, dtype)


def file_order(specs: dict[str, Spec]) -> list[str]:
    """The order ``safetensors`` lays tensors out in: dtype (largest enum value first),
    then name. ``fetch`` is called in this order."""
    for name, (_, dtype) in specs.items():
        if dtype not in _DTYPES:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors")
    return sorted(specs, key=lambda k: (-_DTYPES[specs[k][1]][1], k))


def nbytes(spec: Spec) -> int:
    shape, dtype = spec
    return math.prod(shape) * dtype.itemsize


def header(specs: dict[str, Spec], metadata: dict[str, str] | None = None) -> bytes:
    """The header bytes (length prefix included) of a file holding ``specs``."""
    head: dict = {}
    if metadata:
        head["__metadata__"] = {k: metadata[k] for k in sorted(metadata)}
    offset = 0
    for name in file_order(specs):
        shape, dtype = specs[name]
        size = nbytes(specs[name])
        head[name] = {
            "dtype": _DTYPES[dtype][0],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(head, separators=(",", ":"), ensure_ascii=False).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_safetensors(
    path: str | os.PathLike,
    specs: dict[str, Spec],
    fetch: Callable[[str], torch.Tensor],
    metadata: dict[str, str] | None = None,
) -> None:
    """Write ``specs`` (name -> (shape, dtype)) to ``path`` (created or truncated; an
    existing file keeps its mode), each tensor from ``fetch(name)``, one at a time."""
    head = header(specs, metadata)
    with open(path, "wb") as f:
        f.write(head)
        for name in file_order(specs):
            t = fetch(name)
            if (tuple(t.shape), t.dtype) != (tuple(specs[name][0]), specs[name][1]):
                raise RuntimeError(
                    f"{name}: got {t.dtype} {list(t.shape)}, the header says "
                    f"{specs[name][1]} {list(specs[name][0])}"
                )
            if t.numel():
                f.write(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
            del t
