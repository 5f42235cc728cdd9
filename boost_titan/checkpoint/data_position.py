"""The data loader's position in a checkpoint, checked against this run's loader before DCP
reads anything.

boost_titan's training loader (``boost_titan.data.window_loader``) reads one order of
windows of tokenized corpora, the same at every data-parallel degree, and saves one
position for all ranks: the item ``dataloader.position`` (:data:`POSITION_ITEM`), which every rank
writes alike and every rank reads, so a checkpoint resumes exactly under any dp degree
and TP / PP / CP layout. Model, optimizer, LR schedule and step reshard through DCP.

Two other kinds of data position remain, each one item per data-parallel rank
(``dataloader.dp_rank_{r}``: a pickled StatefulDataLoader state of a rank's own shard),
and :meth:`DataPosition.adapt` handles them:

* a checkpoint of boost_titan's per-rank loaders of older releases: its positions are
  in another order, and the resume is refused in one line (a ``dataloader.position``
  of the packed-stream loader that came after them is refused by the loader itself);
* a dataset boost_titan does not read itself (a Hugging Face streaming dataset in
  torchtitan's registry, such as ``c4``): torchtitan's per-rank loader, whose position
  resumes only at the dp degree it was saved at; another degree is refused in one line
  naming both layouts.

Either way the way out is ``--checkpoint.exclude_from_loading dataloader`` (the data
restarts at its first document).
"""

from __future__ import annotations

import os
import re

POSITION_ITEM = "position"  # the loader's key: DCP item dataloader.position
_RANK_KEY = re.compile(r"dataloader\.dp_rank_(\d+)$")
_RESTART = (
    "or restart the data from its first document with --checkpoint.exclude_from_loading "
    "dataloader (model, optimizer, LR schedule and step resume)"
)


class DataResumeError(SystemExit):
    """A checkpoint's data position cannot be resumed as asked: raised before DCP reads
    anything, or when the loader reads the saved position.

    A SystemExit, so that the run ends on this one line: torchtitan's ``Trainer.train``
    is wrapped in torchelastic's ``@record``, which writes any other exception's
    traceback to an error file that torchrun's failure summary prints once per rank
    (a refused 4-rank resume: 187 lines of output instead of 108). It exits with
    status 1."""


# ---------------------------------------------------------------------------------------
# What .metadata says


def saved_items(folder: str) -> list[str] | None:
    """The ``dataloader.*`` items of a DCP step folder, from its ``.metadata`` (read
    through the allowlisted reader, after the step's manifest is verified); None when it
    has no local ``.metadata``."""
    from boost_titan.checkpoint.integrity.step import open_step

    path = os.path.join(folder, ".metadata")
    if not os.path.isfile(path):  # not a local DCP folder: DCP's own load reports it
        return None
    meta = open_step(folder).metadata  # verified first; parsed once per rank (DCP reuses it)
    return sorted(k for k in meta.state_dict_metadata if k.startswith("dataloader."))


def saved_ranks(folder: str, items: list[str]) -> list[int]:
    """The data-parallel ranks of per-rank positions, checked to be 0..n-1."""
    ranks = sorted(int(m[1]) for k in items if (m := _RANK_KEY.match(k)))
    if ranks != list(range(len(ranks))):
        raise DataResumeError(
            f"checkpoint {folder} holds data loader states of data-parallel ranks {ranks}, "
            f"not 0..{len(ranks) - 1}: it was not written by one complete save"
        )
    return ranks


def _layout_of_this_run(parallel_dims) -> str:
    dims = ", ".join(
        f"{name} {getattr(parallel_dims, name)}"
        for name in ("dp_shard", "dp_replicate", "cp", "tp", "pp", "ep")
        if getattr(parallel_dims, name, 1) > 1
    )
    return f"{parallel_dims.world_size} processes" + (f": {dims}" if dims else "")


def refusal(folder: str, old: int, dp_degree: int, layout: str, name: str) -> str:
    """A per-rank position of torchtitan's own loader under another dp degree."""
    return (
        f"checkpoint {folder} was saved with data-parallel degree {old} and this run's "
        f"data-parallel degree is {dp_degree} ({layout}): dataset {name!r} is read by "
        "torchtitan's per-rank loader, whose position in each rank's shard does not carry "
        f"over to other shards; resume with data-parallel degree {old} (dp_shard x "
        f"dp_replicate = {old}, any TP/PP), {_RESTART}"
    )


def legacy_refusal(folder: str, ranks: int) -> str:
    return (
        f"checkpoint {folder} holds the data positions of {ranks} data-parallel rank(s), "
        "saved by an older boost_titan whose loader gave each rank its own shard: they do "
        "not continue the order this boost_titan reads (the same windows at any "
        f"data-parallel degree); resume it with the boost_titan that saved it, {_RESTART}"
    )


class DataPosition:
    """This run's data loader, checked against every DCP load that includes it (the
    checkpoint manager's ``dcp_load``: the one call every resume, ``load_step`` and
    ``initial_load_path`` goes through, with the step folder it reads)."""

    def __init__(self, dataloader, parallel_dims):
        self.dataloader, self.parallel_dims = dataloader, parallel_dims

    @classmethod
    def for_run(cls, dataloader, parallel_dims) -> DataPosition | None:
        """None when the run has no data-parallel data loader to check."""
        if dataloader is None or not hasattr(dataloader, "dp_world_size"):
            return None
        return cls(dataloader, parallel_dims)

    def adapt(self, state_dict, checkpoint_id, from_hf: bool):
        """The state dict DCP should load, or a one-line refusal (module docstring)."""
        if from_hf or not isinstance(state_dict, dict) or "dataloader" not in state_dict:
            return state_dict
        folder = os.fspath(checkpoint_id)
        items = saved_items(folder)
        if not items:  # a model-only save, or not a local folder
            return state_dict
        loader = self.dataloader
        name = getattr(loader, "dataset_name", None) or getattr(
            getattr(loader, "dataset", None), "dataset_name", "?"
        )
        has_position = f"dataloader.{POSITION_ITEM}" in items
        if getattr(loader, "global_order", False):
            if has_position:
                return state_dict
            ranks = saved_ranks(folder, items)
            raise DataResumeError(legacy_refusal(folder, len(ranks)))
        if has_position:
            raise DataResumeError(
                f"checkpoint {folder} holds one data position in boost_titan's global order, "
                f"and this run's dataset {name!r} is read by torchtitan's per-rank loader; "
                f"resume with the dataset it was saved with, {_RESTART}"
            )
        ranks = saved_ranks(folder, items)
        if ranks and len(ranks) != loader.dp_world_size:
            layout = _layout_of_this_run(self.parallel_dims)
            raise DataResumeError(refusal(folder, len(ranks), loader.dp_world_size, layout, name))
        return state_dict
