"""A model-only DCP step folder written tensor by tensor, each made when DCP asks for it.

``dcp.save`` plans from the state dict's names, shapes and dtypes only, then asks its
planner for each item's data (``SavePlanner.resolve_data``) as it streams the items to
the files, one at a time, in the state dict's order (one writer thread: DCP's default),
one file per tensor (DCP holds every tensor of a file until the file is closed).
So the state dict here holds ``meta`` tensors and :class:`_LazyPlanner` asks ``make``
for each tensor when it is written: with
:class:`~boost_titan.checkpoint.from_dense.convert.Converter` a block is converted when
its first tensor is written and gone once its last one is.
The folder is what ``checkpoint import`` writes (the model's FQNs, float32, checksummed
by ``boost_titan.checkpoint.integrity``): ``--checkpoint.initial_load_path`` loads it in any layout.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner


class _LazyPlanner(DefaultSavePlanner):
    def __init__(self, make: Callable[[str], torch.Tensor], shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        self.make, self.shapes = make, shapes

    def resolve_data(self, write_item):
        fqn = write_item.index.fqn
        t = self.make(fqn)
        if tuple(t.shape) != self.shapes[fqn] or t.dtype != torch.float32:
            raise RuntimeError(f"{fqn}: made {t.dtype} {list(t.shape)}, planned {self.shapes[fqn]}")
        return t.contiguous()


def write_lazily(
    folder: Path, shapes: dict[str, tuple[int, ...]], make: Callable[[str], torch.Tensor]
) -> None:
    """Write a DCP checkpoint of float32 tensors ``shapes`` (FQN -> shape, written in this
    order) into the existing empty ``folder``, each tensor from ``make(fqn)``."""
    state = {k: torch.empty(s, dtype=torch.float32, device="meta") for k, s in shapes.items()}
    with warnings.catch_warnings():  # one process, no process group: the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(
            state,
            # one file per tensor: DCP keeps every tensor of a file referenced until the
            # file is closed (torch 2.13's _write_files_from_queue), so one file per rank
            # would hold the whole model in memory by the end of the write
            storage_writer=dcp.FileSystemWriter(
                str(folder), single_file_per_rank=False, thread_count=1
            ),
            planner=_LazyPlanner(make, shapes),
            no_dist=True,
        )
