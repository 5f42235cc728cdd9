"""How many bytes a DCP checkpoint of this run takes, and whether the disk holds the
checkpoints the run will keep.

A DCP save writes every tensor chunk and every other value (optimizer settings, LR
schedule, data position, step) as one item: a ``torch.save`` zip in a ``__R_0.distcp``
file, indexed in ``.metadata`` and sealed in the step's manifest
(``integrity.manifest``). So a checkpoint's size is the tensors' bytes (each DTensor
once, at its global shape; a replicated one once) plus a fixed cost per item. Measured
on torch 2.13 (the CoLA debug model, TP2: 1280 items): a tensor chunk's zip adds
~1550 bytes, a small value's ~1250 bytes in all, ``.metadata`` ~275 bytes and the
manifest ~117 bytes per item; the constants below round these up.

Before the first step the optimizer has no state yet (torch creates it in the first
``step``; asking for its state dict then would run a zero-lr step): its state is
predicted from the optimizer's kind, the moments it keeps per parameter
(:data:`OPTIMIZER_STATES`). Once it has state, the real state dict is measured.

Every rank measures what it would save and the ranks exchange what differs, once
(:func:`global_items`): under pipeline parallelism each stage holds other FQNs, and the
data loader's position is kept per data-parallel rank.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pickle
import re
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

# zip container of one torch.save'd tensor chunk; of one pickled value (bytes beyond its
# pickle); .metadata's and the manifest's entries per item (FQN, place, digests)
TENSOR_ITEM_BYTES = 1600
VALUE_ITEM_BYTES = 1250
METADATA_ITEM_BYTES = 420

# optimizer class name -> (moment tensors per parameter, each shaped like it; whether
# the step counter is a 0-dim float32 tensor (torch's Adam) or a Python int (LORO))
OPTIMIZER_STATES: dict[str, tuple[tuple[str, ...], bool]] = {
    "Adam": (("exp_avg", "exp_avg_sq"), True),
    "AdamW": (("exp_avg", "exp_avg_sq"), True),
    "LORO": (("exp_avg", "exp_avg_sq"), False),
}
AMSGRAD_STATE = "max_exp_avg_sq"


@dataclasses.dataclass(frozen=True)
class Item:
    """One key of a flattened state dict as DCP writes it."""

    payload: int  # tensor bytes at the global shape, or the pickled value's length
    chunks: int  # items written: a sharded DTensor has one per shard
    itemsize: int = 0  # a tensor's element size; 0: a pickled value

    @property
    def bytes(self) -> int:
        per_chunk = TENSOR_ITEM_BYTES if self.itemsize else VALUE_ITEM_BYTES
        return self.payload + self.chunks * (per_chunk + METADATA_ITEM_BYTES)

    def cast(self, dtype: torch.dtype) -> Item:
        if not self.itemsize:
            return self
        return Item(self.payload // self.itemsize * dtype.itemsize, self.chunks, dtype.itemsize)


def tensor_item(t: torch.Tensor, dtype: torch.dtype | None = None) -> Item:
    itemsize = (dtype or t.dtype).itemsize
    if isinstance(t, DTensor):
        chunks = 1
        for dim, placement in enumerate(t.placements):
            if placement.is_shard():
                chunks *= t.device_mesh.size(dim)
        return Item(t.numel() * itemsize, chunks, itemsize)
    return Item(t.numel() * itemsize, 1, itemsize)


def value_item(v: Any) -> Item:
    return Item(len(pickle.dumps(v)), 1)


def flat_items(state_dict: dict[str, Any], prefix: str = "") -> dict[str, Item]:
    """Items of a (nested) state dict, keyed as DCP flattens it (``a.b.0``)."""
    out: dict[str, Item] = {}
    for k, v in state_dict.items():
        key = f"{prefix}{k}"
        if isinstance(v, torch.Tensor):
            out[key] = tensor_item(v)
        elif isinstance(v, dict):
            out.update(flat_items(v, key + "."))
        elif isinstance(v, list | tuple) and any(isinstance(x, torch.Tensor | dict) for x in v):
            out.update(flat_items(dict(enumerate(v)), key + "."))
        else:
            out[key] = value_item(v)
    return out


def predicted_optimizer_items(container) -> tuple[dict[str, Item], list[str]]:
    """A torchtitan OptimizersContainer's items as its first step will make them,
    without stepping; also the optimizer classes whose state is not modelled."""
    names = {id(p): name for part in container.model_parts for name, p in part.named_parameters()}
    items: dict[str, Item] = {}
    unknown = []
    for opt in container.optimizers:
        kind = type(opt).__name__
        moments, tensor_step = OPTIMIZER_STATES.get(kind, ((), False))
        if kind not in OPTIMIZER_STATES:
            unknown.append(kind)
        for group in opt.param_groups:
            settings = {k: v for k, v in group.items() if k != "params"}
            extra = (AMSGRAD_STATE,) if group.get("amsgrad") else ()
            for p in group["params"]:
                # the same key on every rank (ranks' items merge by key)
                name = names.get(id(p)) or f"unnamed{len(items)}"
                for k, v in settings.items():
                    items[f"optimizer.param_groups.{name}.{k}"] = value_item(v)
                if kind not in OPTIMIZER_STATES or not p.requires_grad:
                    continue
                for m in moments + extra:
                    items[f"optimizer.state.{name}.{m}"] = tensor_item(p)
                items[f"optimizer.state.{name}.step"] = (
                    Item(4, 1, 4) if tensor_step else value_item(0)
                )
    return items, unknown


def _has_state(container) -> bool:
    return any(len(opt.state) for opt in container.optimizers)


def local_items(states: dict[str, Any], predict_optimizer: bool) -> tuple[dict[str, Item], list]:
    """This rank's items of torchtitan's checkpoint ``states`` (its
    ``_flattened_model_states_sd()``: the model's tensors flat, every other entry a
    Stateful). The optimizer's are predicted while it has no state, when asked."""
    items: dict[str, Item] = {}
    unknown: list[str] = []
    for key, value in states.items():
        if key == "optimizer" and predict_optimizer and not _has_state(value):
            predicted, unknown = predicted_optimizer_items(value)
            items.update(predicted)
        elif hasattr(value, "state_dict"):
            items.update(flat_items(value.state_dict(), key + "."))
        elif isinstance(value, torch.Tensor):
            items[key] = tensor_item(value)
        elif isinstance(value, dict):
            items.update(flat_items(value, key + "."))
        else:
            items[key] = value_item(value)
    return items, unknown


_PER_RANK = ("dataloader.",)  # keys each data-parallel rank holds for itself


def global_items(items: dict[str, Item]) -> dict[str, Item]:
    """Every rank's items, merged by key (collective over the default group), without
    sending every rank's table to every rank: ranks holding the same table (all of a
    pipeline stage's TP/FSDP ranks) are found by a digest of it, and one rank of each
    distinct table broadcasts it; only the per-rank keys (each data-parallel rank's
    data position, a few bytes) are gathered from every rank."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return dict(items)
    own = {k: v for k, v in items.items() if k.startswith(_PER_RANK)}
    shared = {k: v for k, v in items.items() if not k.startswith(_PER_RANK)}
    digest = hashlib.sha256(pickle.dumps(sorted(shared.items()))).hexdigest()
    gathered: list[tuple[str, dict[str, Item]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (digest, own))
    leaders: dict[str, int] = {}
    for rank, entry in enumerate(gathered):
        leaders.setdefault(entry[0], rank)
    merged: dict[str, Item] = {}
    for leader in sorted(leaders.values()):
        box = [shared if dist.get_rank() == leader else None]
        dist.broadcast_object_list(box, src=leader)
        merged.update(box[0] or {})
    for _digest, per_rank in gathered:
        merged.update(per_rank)
    return merged


def total_bytes(items: dict[str, Item]) -> int:
    return sum(i.bytes for i in items.values())


def free_bytes(path: str) -> int:
    """Bytes this process may still write on ``path``'s filesystem (``os.statvfs``;
    ``path`` need not exist yet: its nearest existing parent is asked)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.statvfs(path)
    # root may also write the blocks reserved for it (ext4's 5%)
    blocks = st.f_bfree if os.geteuid() == 0 else st.f_bavail
    return blocks * st.f_frsize


def fmt_bytes(n: int) -> str:
    unit = f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
    return f"{n:,} bytes ({unit})"


# ---------------------------------------------------------------- the start-time check


@dataclasses.dataclass
class SpacePlan:
    full: int  # bytes of one full checkpoint
    parts: dict[str, int]  # model / optimizer / other
    last: int  # bytes of the save at the last step (model-only when last_save_model_only)
    saves: list[int]  # steps this run will save at
    copies: int  # new step folders on disk at the peak
    needed: int
    free: int
    unknown_optimizers: list[str]

    def line(self, folder: str, keep_latest_k: int) -> str:
        parts = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.parts.items())
        n = len(self.saves)
        saved = (
            f"{n} save{'s' if n != 1 else ''} (step{'s' if n != 1 else ''} {_steps(self.saves)})"
        )
        if keep_latest_k == 0 or self.copies == n:
            keep = f"keep_latest_k = {keep_latest_k} keeps all of this run's {saved}"
        else:
            keep = (
                f"keep_latest_k = {keep_latest_k} keeps {keep_latest_k} step folders and writes "
                f"the next before the oldest is purged: at most {self.copies} new ones of this "
                f"run's {saved}"
            )
        last = (
            f"; the last-step save is model-only: {fmt_bytes(self.last)}"
            if self.last != self.full
            else ""
        )
        unknown = (
            f"; the state of {', '.join(sorted(set(self.unknown_optimizers)))} is not counted "
            "(its layout is unknown to boost_titan.checkpoint.space)"
            if self.unknown_optimizers
            else ""
        )
        return (
            f"checkpoint space: one checkpoint takes ~{fmt_bytes(self.full)} ({parts}){last}; "
            f"{keep} -> ~{fmt_bytes(self.needed)} needed; {folder}'s filesystem has "
            f"{fmt_bytes(self.free)} free{unknown}"
        )


def _steps(steps: list[int]) -> str:
    return ", ".join(map(str, steps)) if len(steps) <= 6 else f"{steps[0]}, ..., {steps[-1]}"


def planned_saves(start: int, steps: int, interval: int, first_step: bool) -> list[int]:
    """Steps after ``start`` whose checkpoint torchtitan saves (``_should_save``)."""
    out = {s for s in range(start + 1, steps + 1) if s % interval == 0}
    if steps > start:
        out.add(steps)
    if first_step and start < 1 <= steps:
        out.add(1)
    return sorted(out)


def existing_step_folders(folder: str) -> list[int]:
    """``step-N`` folders torchtitan's purge counts (complete or not)."""
    if not os.path.isdir(folder):
        return []
    return sorted(
        int(m.group(1))
        for m in (re.fullmatch(r"step-(\d+)", n) for n in os.listdir(folder))
        if m and os.path.isdir(os.path.join(folder, m.group(0)))
    )


def split_parts(items: dict[str, Item], state_keys) -> dict[str, int]:
    """Bytes of the model (its FQNs sit at the top level of torchtitan's flattened
    states), of the optimizer and of everything else."""
    others = set(state_keys) - {"model"}
    parts = {"model": 0, "optimizer": 0, "other": 0}
    for key, item in items.items():
        head = key.split(".")[0]
        parts["model" if head not in others else head if head in parts else "other"] += item.bytes
    return parts


def plan(checkpointer, job_config) -> SpacePlan:
    """What the run's checkpoints need against the free space (collective)."""
    items, unknown = local_items(checkpointer._flattened_model_states_sd(), predict_optimizer=True)
    items = global_items(items)
    others = set(checkpointer.states) - {"model"}
    full = total_bytes(items)
    ckpt = job_config.checkpoint
    last = full
    if ckpt.last_save_model_only:  # torchtitan casts the model to export_dtype then
        export = checkpointer.export_dtype
        last = sum(
            (i.cast(export) if export != torch.float32 else i).bytes
            for k, i in items.items()
            if k.split(".")[0] not in others
        )
    start = checkpointer._find_load_step() if ckpt.load_step < 0 else ckpt.load_step
    saves = planned_saves(
        max(start, 0), job_config.training.steps, ckpt.interval, ckpt.enable_first_step_checkpoint
    )
    k = ckpt.keep_latest_k
    if k == 0:
        copies = len(saves)
        needed = full * (copies - 1) + last if saves else 0
    else:  # torchtitan purges after each save: k kept + the one being written
        existing = len(existing_step_folders(checkpointer.folder))
        copies = max(0, min(existing + len(saves), k + 1) - existing)
        needed = full * copies
    return SpacePlan(
        full,
        split_parts(items, checkpointer.states),
        last,
        saves,
        copies,
        needed,
        free_bytes(checkpointer.folder),
        unknown,
    )
