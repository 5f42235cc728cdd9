"""Resuming a checkpoint under another data-parallel degree: refused in one line, or
resumed with every data-parallel rank re-positioned in its new shard
(``[boost] data_resume``).

Model, optimizer, LR schedule and step reshard through DCP whatever the layout. The data
position does not: torchtitan's ``ParallelAwareDataloader`` saves one state per
data-parallel rank (``dataloader.dp_rank_{r}``: a pickled StatefulDataLoader state with
the text dataset's ``sample_idx``, documents read from the rank's shard, and
``token_buffer``, tokens read but not yet trained on), and each rank reads its own
contiguous shard of the documents (``datasets.distributed.split_dataset_by_node``:
``Dataset.shard(dp_degree, dp_rank, contiguous=True)``). Under another dp degree the
shards are other ranges, and torchtitan's load dies inside DCP (``Missing key in
checkpoint state_dict: dataloader.dp_rank_1``) or on an assert.

Before DCP reads anything, :meth:`DataPosition.adapt` compares the dp degree the
checkpoint's ``.metadata`` declares (its ``dataloader.dp_rank_*`` keys) with this run's:

* ``"exact"`` (default): a change is refused with one line (:class:`DataResumeError`)
  naming both layouts and the ways forward. The same dp degree under another TP / PP /
  CP layout resumes exactly, as before.
* ``"reshard"``: every saved rank's state is read; the documents they consumed (the
  union of each old shard's first ``sample_idx`` documents, :func:`plan_reshard`) are
  counted per new shard, and each new rank skips that many documents of its own shard,
  so the documents consumed in total stay the same. Where a new rank's next document is
  a saved rank's next document, it continues that rank's stream exactly, buffered
  tokens included; other buffers are dropped. Growing from dp 1 to any degree, or from
  d to a multiple of d where every old shard boundary is a new one (always when the
  document count divides evenly; 2 -> 4 on the embedded corpus), nothing is read twice,
  skipped or dropped; a new shard that straddles an old boundary costs a few documents.
  The log states what this costs: the documents consumed before that will be read
  again, the never-read documents skipped (as many: the total is kept), and the
  buffered tokens dropped. Map-style datasets only (``boost_corpus``, a ``local_text``
  ``save_to_disk`` folder); a streamed dataset's position (``local_text`` files, see
  ``boost_titan.data.loader``) is not a document index and is refused.

Positions are within each rank's current pass over its shard (torchtitan's map-style
datasets re-loop and do not record the pass), so "read again" means again in this pass.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

from boost_titan.config import DATA_RESUME_MODES

_RANK_KEY = re.compile(r"dataloader\.dp_rank_(\d+)$")
_RESHARD_OPTION = '[boost] data_resume = "reshard" (--boost.data_resume reshard)'


class DataResumeError(SystemExit):
    """A checkpoint's data position cannot be resumed as asked: raised before DCP reads
    anything (a dp change in "exact" mode) or right after it read the saved data loader
    states (what "reshard" cannot re-position).

    A SystemExit, so that the run ends on this one line: torchtitan's ``Trainer.train``
    is wrapped in torchelastic's ``@record``, which writes any other exception's
    traceback to an error file that torchrun's failure summary prints once per rank
    (a refused 4-rank resume: 187 lines of output instead of 108). It exits with
    status 1."""


# ---------------------------------------------------------------------------------------
# The arithmetic (no processes, no torch): shards, consumed documents, the new positions


def contiguous_shards(n_docs: int, degree: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each rank's shard, as ``Dataset.shard(degree, rank,
    contiguous=True)`` cuts it (datasets' ``split_dataset_by_node`` for map-style
    datasets): the first ``n_docs % degree`` shards hold one document more."""
    div, mod = divmod(n_docs, degree)
    shards = []
    for rank in range(degree):
        start = div * rank + min(rank, mod)
        shards.append((start, start + div + (1 if rank < mod else 0)))
    return shards


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Documents in both unions of disjoint ``[start, end)`` ranges."""
    return sum(max(0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def _next_document(shard: tuple[int, int], position: int) -> int:
    """The document a rank at ``position`` of ``shard`` reads next (at the shard's end
    torchtitan's infinite loader starts the shard again)."""
    start, end = shard
    return start + position if start + position < end else start


@dataclasses.dataclass(frozen=True)
class ReshardPlan:
    n_docs: int
    old_shards: list[tuple[int, int]]
    new_shards: list[tuple[int, int]]
    consumed: int  # documents the saved ranks had read: sum of their positions
    positions: list[int]  # documents each new rank skips in its shard
    handover: dict[int, int]  # new rank -> saved rank whose stream it continues exactly
    repeated: int  # documents consumed before that the new ranks will read again
    skipped: int  # documents never read that the new ranks skip
    dropped_tokens: int  # buffered tokens of saved ranks no new rank continues


def plan_reshard(
    n_docs: int, saved_positions: list[int], saved_buffered: list[int], new_degree: int
) -> ReshardPlan:
    """Where each of ``new_degree`` ranks resumes in its shard of ``n_docs`` documents,
    given the saved ranks' positions (``sample_idx``) and buffered token counts.

    New rank j skips as many documents of its shard as the saved ranks had consumed
    inside it (consumed = the first ``sample_idx`` documents of each old shard), so the
    total consumed is kept and a new shard whose consumed documents form a prefix of it
    (every shard when the saved degree is 1) resumes with nothing read twice or
    skipped."""
    old_shards = contiguous_shards(n_docs, len(saved_positions))
    for rank, ((start, end), pos) in enumerate(zip(old_shards, saved_positions)):
        if not 0 <= pos <= end - start:
            raise DataResumeError(
                f"saved data-parallel rank {rank} had read {pos} documents of a shard that "
                f"holds {end - start} of the {n_docs} documents the dataset has now: the "
                "dataset changed since the checkpoint was saved; resume with the same "
                "data-parallel degree and dataset, or restart the data with "
                "--checkpoint.exclude_from_loading dataloader"
            )
    consumed = [(start, start + pos) for (start, _), pos in zip(old_shards, saved_positions)]
    new_shards = contiguous_shards(n_docs, new_degree)
    positions = [_overlap(consumed, [shard]) for shard in new_shards]
    ahead = [(start + pos, end) for (start, end), pos in zip(new_shards, positions)]
    behind = [(start, start + pos) for (start, _), pos in zip(new_shards, positions)]
    repeated = _overlap(consumed, ahead)
    skipped = sum(pos for pos in positions) - _overlap(consumed, behind)
    saved_next = {
        _next_document(shard, pos): rank
        for rank, (shard, pos) in enumerate(zip(old_shards, saved_positions))
        if shard[1] > shard[0]
    }
    handover = {}
    for rank, (shard, pos) in enumerate(zip(new_shards, positions)):
        saved = saved_next.get(_next_document(shard, pos)) if shard[1] > shard[0] else None
        if saved is not None:
            handover[rank] = saved
    kept = set(handover.values())
    return ReshardPlan(
        n_docs=n_docs,
        old_shards=old_shards,
        new_shards=new_shards,
        consumed=sum(saved_positions),
        positions=positions,
        handover=handover,
        repeated=repeated,
        skipped=skipped,
        dropped_tokens=sum(n for r, n in enumerate(saved_buffered) if r not in kept),
    )


def describe(plan: ReshardPlan, old_degree: int, new_degree: int, folder: str) -> str:
    """The one log line of a resharded data position."""
    continued = ", ".join(
        f"new rank {new} continues saved rank {old}'s stream" for new, old in plan.handover.items()
    )
    per_rank = ", ".join(
        f"rank {j}: {pos} of {end - start}"
        for j, (pos, (start, end)) in enumerate(zip(plan.positions, plan.new_shards))
    )
    return (
        f"data position resharded ({_RESHARD_OPTION.split(' (')[0]}), data-parallel degree "
        f"{old_degree} -> {new_degree}, checkpoint {folder}: the saved ranks had consumed "
        f"{plan.consumed} of {plan.n_docs} documents; each new rank skips the consumed "
        f"documents of its shard ({per_rank}){'; ' + continued if continued else ''}; "
        f"{plan.repeated} documents consumed before will be read again, {plan.skipped} "
        f"never-read documents are skipped, {plan.dropped_tokens} buffered tokens are dropped"
    )


# ---------------------------------------------------------------------------------------
# The checkpoint side: what .metadata says, what the saved states hold


def saved_layout(folder: str) -> tuple[int, int] | None:
    """(data-parallel degree, processes that wrote data) of a DCP step folder, from its
    ``.metadata`` (read through the allowlisted reader); None when it holds no data
    loader state (a model-only save) or has no local ``.metadata``."""
    from boost_titan.checkpoint.integrity.step import open_step

    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):  # not a local DCP folder: DCP's own load reports it
        return None
    meta = open_step(folder).metadata  # verified first; parsed once per rank (DCP reuses it)
    ranks = sorted(int(m[1]) for k in meta.state_dict_metadata if (m := _RANK_KEY.match(k)))
    if not ranks:
        return None
    if ranks != list(range(len(ranks))):
        raise DataResumeError(
            f"checkpoint {folder} holds data loader states of data-parallel ranks {ranks}, "
            f"not 0..{len(ranks) - 1}: it was not written by one complete save"
        )
    writers = {
        m[1]
        for info in meta.storage_data.values()
        if (m := re.match(r"__(\d+)_", os.path.basename(str(info.relative_path))))
    }
    return len(ranks), len(writers)


def dataset_position(state: dict[str, Any], key: str, folder: str) -> tuple[int, list[int]]:
    """(sample_idx, token_buffer) of one saved rank's StatefulDataLoader state."""
    if "_snapshot" in state:  # torchdata's state with worker processes
        raise DataResumeError(
            f"{_RESHARD_OPTION} cannot re-position checkpoint {folder}: its data loader "
            f"state {key} was saved with worker processes ([training.dataloader] "
            "num_workers > 0); reshard supports num_workers = 0"
        )
    dataset = state.get("dataset_state") or {}
    if "sample_idx" not in dataset:
        raise DataResumeError(
            f"{_RESHARD_OPTION} cannot re-position checkpoint {folder}: its data loader "
            f"state {key} holds no document index (a streamed dataset's position); "
            "resume with the saved data-parallel degree, or restart the data with "
            "--checkpoint.exclude_from_loading dataloader"
        )
    return int(dataset["sample_idx"]), list(dataset["token_buffer"])


# ---------------------------------------------------------------------------------------
# The hook in torchtitan's CheckpointManager


def _layout_of_this_run(parallel_dims) -> str:
    dims = ", ".join(
        f"{name} {getattr(parallel_dims, name)}"
        for name in ("dp_shard", "dp_replicate", "cp", "tp", "pp", "ep")
        if getattr(parallel_dims, name, 1) > 1
    )
    return f"{parallel_dims.world_size} processes" + (f": {dims}" if dims else "")


def refusal(folder: str, saved: tuple[int, int], dp_degree: int, layout: str) -> str:
    old, writers = saved
    return (
        f"checkpoint {folder} was saved with data-parallel degree {old} ({writers} "
        f"processes wrote it) and this run's data-parallel degree is {dp_degree} ({layout}): "
        "its model, optimizer, LR schedule and step would reshard, but each data-parallel "
        "rank's position in its shard of the data would not; resume with data-parallel "
        f"degree {old} (dp_shard x dp_replicate = {old}, any TP/PP), or set {_RESHARD_OPTION} "
        "to resume everything and re-position each rank in its new shard (the log states the "
        "documents read again and skipped), or restart the data from its first document "
        "with --checkpoint.exclude_from_loading dataloader"
    )


class _SavedPositions:
    """Stands for the data loader in a "reshard" load: asks DCP for every saved rank's
    state (not this rank's key, which may not exist) and re-positions the loader."""

    def __init__(self, degree: int, reposition):
        self.keys = [f"dp_rank_{r}" for r in range(degree)]
        self.reposition = reposition

    def state_dict(self) -> dict[str, Any]:
        return {key: b"" for key in self.keys}  # bytes items: DCP fills them in

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        from boost_titan.checkpoint import safe_metadata

        self.reposition([safe_metadata.dataloader_state(state_dict[key], key) for key in self.keys])


def _shard_sizes(dataloader) -> list[int]:
    """Every data-parallel rank's shard size, by rank (one all-gather over the world)."""
    import torch.distributed as dist

    mine = (dataloader.dp_rank, len(dataloader.dataset._data))
    if not dist.is_initialized():
        return [mine[1]]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    sizes = dict(gathered)
    return [sizes[r] for r in range(dataloader.dp_world_size)]


def _check_reshardable(dataloader, folder: str) -> None:
    from datasets import Dataset

    dataset = getattr(dataloader, "dataset", None)
    data = getattr(dataset, "_data", None)
    if data is None or not hasattr(dataset, "_sample_idx"):
        raise DataResumeError(
            f"{_RESHARD_OPTION} cannot re-position checkpoint {folder}: this run's dataset "
            f"({type(dataset).__name__}) is not torchtitan's map-style text dataset"
        )
    if not isinstance(data, Dataset):
        raise DataResumeError(
            f"{_RESHARD_OPTION} cannot re-position checkpoint {folder}: dataset "
            f"{getattr(dataset, 'dataset_name', '?')!r} is streamed ({type(data).__name__}), "
            "its position is not a document index; resume with the saved data-parallel "
            "degree, or restart the data with --checkpoint.exclude_from_loading dataloader"
        )
    if dataloader.num_workers != 0:
        raise DataResumeError(
            f"{_RESHARD_OPTION} needs [training.dataloader] num_workers = 0, not "
            f"{dataloader.num_workers}"
        )


def _reposition(dataloader, folder: str, old_degree: int, states: list[dict]) -> None:
    from torchtitan.tools.logging import logger

    saved = [dataset_position(s, f"dp_rank_{r}", folder) for r, s in enumerate(states)]
    sizes = _shard_sizes(dataloader)
    n_docs = sum(sizes)
    expected = [end - start for start, end in contiguous_shards(n_docs, len(sizes))]
    if sizes != expected:
        raise DataResumeError(
            f"{_RESHARD_OPTION} cannot re-position checkpoint {folder}: this run's shards "
            f"hold {sizes} documents, not the contiguous split {expected} of {n_docs} that "
            "datasets' split_dataset_by_node makes of a map-style dataset"
        )
    plan = plan_reshard(
        n_docs, [pos for pos, _ in saved], [len(buf) for _, buf in saved], len(sizes)
    )
    rank = dataloader.dp_rank
    source = plan.handover.get(rank)
    buffer = saved[source][1] if source is not None else []
    dataloader.dataset.load_state_dict({"sample_idx": plan.positions[rank], "token_buffer": buffer})
    logger.warning(describe(plan, old_degree, len(sizes), folder))


class DataPosition:
    """This run's data-parallel layout and ``[boost] data_resume`` mode, checked against
    every DCP load that includes the data loader (the checkpoint manager's ``dcp_load``:
    the one call every resume, ``load_step`` and ``initial_load_path`` goes through,
    with the step folder it reads)."""

    def __init__(self, dataloader, parallel_dims, mode: str):
        if mode not in DATA_RESUME_MODES:
            raise ValueError(
                f"[boost] data_resume = {mode!r}: choose one of {list(DATA_RESUME_MODES)}"
            )
        self.dataloader, self.parallel_dims, self.mode = dataloader, parallel_dims, mode

    @classmethod
    def for_run(cls, dataloader, parallel_dims, mode: str) -> DataPosition | None:
        """None when the run has no per-rank data position to check."""
        if dataloader is None or not hasattr(dataloader, "dp_world_size"):
            return None
        return cls(dataloader, parallel_dims, mode)

    def adapt(self, state_dict, checkpoint_id, from_hf: bool):
        """The state dict DCP should load: refused (``exact``) or with the data loader's
        entry re-positioning this run's shards (``reshard``) when the dp degree changed."""
        if from_hf or not isinstance(state_dict, dict) or "dataloader" not in state_dict:
            return state_dict
        folder = os.fspath(checkpoint_id)
        saved = saved_layout(folder)
        dataloader = self.dataloader
        if saved is None or saved[0] == dataloader.dp_world_size:
            return state_dict
        if self.mode == "exact":
            raise DataResumeError(
                refusal(
                    folder, saved, dataloader.dp_world_size, _layout_of_this_run(self.parallel_dims)
                )
            )
        _check_reshardable(dataloader, folder)
        state_dict = dict(state_dict)
        state_dict["dataloader"] = _SavedPositions(
            saved[0], lambda states: _reposition(dataloader, folder, saved[0], states)
        )
        return state_dict
