"""DCP's ``FileSystemReader.read_data`` (torch 2.13) with the tensors of a sealed step
read in place: straight from the file into the tensor they load into.

torch's loop ``torch.load``s each item into a fresh tensor (every page of it faulted
in) and ``copy_``s that into the target: the bytes cross memory twice. When an item is
read through a :class:`~.blocks.VerifyingReader` (a sealed step) and the part of it
the request wants is one contiguous run of its bytes, this reads only the archive's
header (``torch.load`` to the meta device: the stored tensor's dtype, size, strides
and the byte offset of its data record), then the reader fills the target with those
bytes, every block checked against the manifest before the read returns. A target
that cannot take them as they are (on another device, of another dtype, not
contiguous) gets them through one reused CPU buffer and its ``copy_``. Everything
else (``BYTE_IO`` items, a chunk of a tensor that is no contiguous run, a step that
is not sealed) takes torch's own path, unchanged. Why here: a load pays for hashing
every byte (the seal), and reading in place saves more than that costs
(``benchmarks/checkpoint_integrity.py``)."""

from __future__ import annotations

import ctypes
import io
from typing import cast

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.futures import Future

from boost_titan.checkpoint.integrity.blocks import ChecksumMismatch, VerifyingReader


class _Staging:
    """One CPU buffer, grown to the largest item, that items whose target cannot take
    the bytes themselves (another device or dtype) are read into before ``copy_``:
    torch's path allocates (and faults in) a fresh tensor per item instead."""

    def __init__(self):
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def like(self, wanted: torch.Tensor) -> torch.Tensor:
        nbytes = wanted.numel() * wanted.element_size()
        if self.buffer.numel() < nbytes:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8)
        return self.buffer[:nbytes].view(wanted.dtype).view(wanted.size())


def takes_bytes_as_stored(target: torch.Tensor, wanted: torch.Tensor) -> bool:
    """Whether the stored bytes of ``wanted`` can be read into ``target``'s memory."""
    return (
        type(target) is torch.Tensor
        and target.device.type == "cpu"
        and target.dtype == wanted.dtype
        and target.is_contiguous()
    )


def _read_in_place(reader: VerifyingReader, req, planner: LoadPlanner, staging: _Staging) -> bool:
    """Read ``req`` from ``reader`` into its target in place (or through ``staging``),
    if the bytes it wants are one run (see the module's docstring); False, with nothing
    read, if not."""
    stored = torch.load(reader, map_location="meta", weights_only=True)
    if type(stored) is not torch.Tensor:
        reader.seek(0)
        return False
    record = getattr(stored.untyped_storage(), "_checkpoint_offset", None)
    wanted = narrow_tensor_by_index(stored, req.storage_offsets, req.lengths)
    target = planner.resolve_tensor(req).detach()
    if record is None or not wanted.is_contiguous() or target.size() != wanted.size():
        reader.seek(0)  # torch's path (which names a size mismatch)
        return False
    direct = takes_bytes_as_stored(target, wanted)
    into = target if direct else staging.like(wanted)
    nbytes = wanted.numel() * wanted.element_size()
    start = record + wanted.storage_offset() * wanted.element_size()
    if start + nbytes > reader.size:  # (its header says so: bytes the seal verified)
        raise ChecksumMismatch(
            f"checkpoint {reader.item.folder} is corrupted: {reader.item.file}, "
            f"{reader.item.what}: its header puts the tensor's {nbytes} bytes at {start}, "
            f"past the item's {reader.size} bytes{reader.item.tail}"
        )
    if nbytes:
        reader.seek(start)
        reader.readinto((ctypes.c_ubyte * nbytes).from_address(into.data_ptr()))
    if not direct:
        target.copy_(into)
    planner.commit_tensor(req, target)
    return True


def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
    """torch 2.13's ``FileSystemReader.read_data``, with :func:`_read_in_place` tried
    first for each tensor item of a sealed step."""
    per_file: dict[str, list] = {}
    staging = _Staging()
    for read_item in plan.items:
        item_md = self.storage_data[read_item.storage_index]
        per_file.setdefault(item_md.relative_path, []).append(read_item)

    step = getattr(self.transforms, "_boost_step", None)  # (``dcp_hooks._read_verified``)
    for relative_path, reqs in per_file.items():
        if step is not None:  # the file checked (and its section read) before it is opened
            step.reading(relative_path)
        new_path = self.fs.concat_path(self.path, relative_path)
        with self.fs.create_stream(new_path, "rb") as stream:
            for req in reqs:
                item_md = self.storage_data[req.storage_index]
                file_slice = self._slice_file(stream, item_md)
                transform_from = self.transforms.transform_load_stream(
                    req, item_md.transform_descriptors or (), file_slice
                )
                if req.type == LoadItemType.BYTE_IO:
                    read_bytes = io.BytesIO(transform_from.read(-1))
                    read_bytes.seek(0)
                    planner.load_bytes(req, read_bytes)
                    continue
                if isinstance(transform_from, VerifyingReader) and _read_in_place(
                    transform_from, req, planner, staging
                ):
                    continue
                if transform_from.seekable():
                    seekable = transform_from
                else:  # torch.load needs a seekable input
                    seekable = io.BytesIO(transform_from.read(-1))
                    seekable.seek(0)
                tensor = cast(
                    torch.Tensor, torch.load(seekable, map_location="cpu", weights_only=True)
                )
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                target_tensor = planner.resolve_tensor(req).detach()
                if target_tensor.size() != tensor.size():
                    raise AssertionError(
                        f"req {req.storage_index} mismatch sizes {target_tensor.size()} vs "
                        f"{tensor.size()}"
                    )
                target_tensor.copy_(tensor)
                planner.commit_tensor(req, target_tensor)

    fut: Future = Future()
    fut.set_result(None)
    return fut


_torch_read_data = filesystem.FileSystemReader.read_data


def install() -> None:
    filesystem.FileSystemReader.read_data = read_data  # type: ignore[method-assign]


def installed() -> bool:
    return filesystem.FileSystemReader.read_data is read_data
