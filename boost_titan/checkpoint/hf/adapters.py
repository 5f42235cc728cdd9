"""torchtitan's state-dict adapters (``TrainSpec.state_dict_adapter``) over our HF layouts.

``[checkpoint] last_save_in_hf = true`` makes torchtitan write the final model as
safetensors in Hugging Face names (``dcp_save(to_hf=True)``: ``adapter.to_hf`` of the
model's state dict, then DCP's ``HuggingFaceStorageWriter``); ``initial_load_in_hf =
true`` reads one (``adapter.to_hf`` of the live state dict gives the names and shapes to
read, DCP's ``HuggingFaceStorageReader`` fills them, ``adapter.from_hf`` maps them back).
Both pass *this rank's* state dict: DTensors under TP / FSDP (the q/k permutation and the
CoLA transposes are DTensor views, as in torchtitan's llama3 adapter), and only a
stage's tensors under PP (:class:`~boost_titan.checkpoint.hf.renames.RenamingFormat` maps tensor by
tensor and requires no completeness).

Which layout a model name is saved in:

===========  ========  ================================================
model        layout    readable by
===========  ========  ================================================
llama2       llama     ``transformers``' ``LlamaForCausalLM``
cola_llama2  cola      the CoLA authors' ``ColaForCausalLM`` (their code)
svd_llama2   boost     our ``transformers`` class (``boost_format``)
lax_llama2   boost     our ``transformers`` class (``boost_format``)
===========  ========  ================================================

What torchtitan writes is the weights only (``model-00001-of-00001.safetensors`` and its
index or, with ``model.safetensors.index.json`` in ``[model] hf_assets_path``, shards
named after it); :func:`finish_hf_save` adds ``config.json`` for the llama and cola
layouts, so ``LlamaForCausalLM.from_pretrained(<step folder>)`` works; tokenizer files,
token ids and our own layout's model code come with ``boost-titan checkpoint
export --format hf``, which writes the complete folder. ``initial_load_in_hf`` from a
folder with a config.json is checked to describe the run's model when the config is
parsed (``config_check/checkpoint.py``). A model the layout
cannot hold (a GQA CoLA in the authors' layout) is refused when the config is parsed,
not after training (``config_check/checkpoint.py``).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from typing import Any

import torch
import torch.distributed as dist
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from boost_titan.checkpoint.hf import HFFormat
from boost_titan.models.args import LlamaArgs

# [model] name -> the HF layout its state dict adapter writes and reads
LAYOUT_OF_MODEL = {
    "llama2": "llama",
    "cola_llama2": "cola",
    "svd_llama2": "boost",
    "lax_llama2": "boost",
}


def hf_format(name: str) -> HFFormat:
    """The layout ``name`` (one registry: :func:`boost_titan.checkpoint.hf.folder.get_format`)."""
    from boost_titan.checkpoint.hf.folder import get_format

    return get_format(name)


class FormatStateDictAdapter(StateDictAdapter):
    """One HF layout as a torchtitan adapter; subclasses name the layout."""

    layout = ""
    config_beside_save = False
    """Write config.json beside the weights of a ``last_save_in_hf`` save: for layouts
    whose model class needs no file from the folder (transformers' LLaMA, the CoLA
    authors' installed code); ours (boost) needs its modeling file: ``export``."""

    def __init__(self, model_args: LlamaArgs, hf_assets_path: str | None):
        # torchtitan reads [model] hf_assets_path/model.safetensors.index.json, if any, to
        # shard the HF save like it; it warns on every run where the file is absent (our
        # tokenizer folders: every run builds this adapter), so it only gets a path that
        # has one
        has_index = hf_assets_path and os.path.isfile(
            os.path.join(hf_assets_path, "model.safetensors.index.json")
        )
        super().__init__(model_args, hf_assets_path if has_index else None)
        self.hf_assets_path = hf_assets_path
        self.model_args = model_args

    @property
    def format(self) -> HFFormat:
        return hf_format(self.layout)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.format.to_hf(state_dict, self.model_args)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return self.format.from_hf(hf_state_dict, self.model_args)

    def write_config(self, checkpoint_id: str, dtype: torch.dtype) -> None:
        config = self.format.config(self.model_args)
        config["torch_dtype"] = str(dtype).removeprefix("torch.")
        with open(os.path.join(checkpoint_id, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
            f.write("\n")


def _adapter_class(layout: str, config_beside_save: bool) -> type[FormatStateDictAdapter]:
    name = f"{layout.capitalize()}StateDictAdapter"
    attrs = {"layout": layout, "config_beside_save": config_beside_save, "__module__": __name__}
    return type(name, (FormatStateDictAdapter,), attrs)


LlamaStateDictAdapter = _adapter_class("llama", True)
ColaStateDictAdapter = _adapter_class("cola", True)
BoostStateDictAdapter = _adapter_class("boost", False)
ADAPTERS = {
    "llama": LlamaStateDictAdapter,
    "cola": ColaStateDictAdapter,
    "boost": BoostStateDictAdapter,
}


def adapter_for(model_name: str) -> type[FormatStateDictAdapter]:
    return ADAPTERS[LAYOUT_OF_MODEL[model_name]]


def finish_hf_save(checkpoint_id: str, sd_adapter, dtype: torch.dtype) -> None:
    """After torchtitan's HF save (every rank, once every rank has consolidated): rank
    0 removes ``<step>/sharded``, each rank's part that torchtitan's writer
    consolidated into ``<step>/model-*.safetensors`` and left behind (the model a
    second time on disk), and writes config.json where the layout's model class needs
    nothing else; then every rank seals the folder with it (``integrity.seal_folder``:
    each rank hashes its share, rank 0 writes ``.manifest.json``), and no rank goes
    on before the manifest is in place."""
    from boost_titan.checkpoint.integrity import seal_folder

    if dist.is_initialized():
        dist.barrier()
    if not dist.is_initialized() or dist.get_rank() == 0:
        shards = os.path.join(checkpoint_id, "sharded")
        consolidated = [f for f in os.listdir(checkpoint_id) if f.endswith(".safetensors")]
        if os.path.isdir(shards) and consolidated:
            shutil.rmtree(shards)
        if isinstance(sd_adapter, FormatStateDictAdapter) and sd_adapter.config_beside_save:
            sd_adapter.write_config(checkpoint_id, dtype)
    seal_folder(checkpoint_id)  # (a collective: its broadcast waits for rank 0's listing)
    if dist.is_initialized():
        dist.barrier()


# ---------------------------------------------------------------- {"format": "pt"}

_torch_write_metadata = None


def _write_metadata_format_pt(output_files_data) -> None:
    """torch's consolidation header writer (``_write_metadata``), then each header
    rewritten with ``"__metadata__": {"format": "pt"}`` (padded to 8 bytes, as
    safetensors' own writer does), before any tensor data follows it: transformers
    (4.47, what the CoLA authors' code runs on) reads that key from every safetensors
    file it loads and fails on a file without it."""
    _torch_write_metadata(output_files_data)
    for path, data in output_files_data.items():
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        extra = header.pop("__metadata__", None) or {}
        raw = json.dumps({"__metadata__": {**extra, "format": "pt"}, **header}).encode()
        raw += b" " * (-len(raw) % 8)
        with open(path, "wb") as f:  # only the header is in the file yet
            f.write(struct.pack("<Q", len(raw)) + raw)
            data.metadata_size = f.tell()


def install() -> None:
    """Every Hugging Face save of this process (``last_save_in_hf``) writes safetensors
    with ``{"format": "pt"}`` metadata (idempotent)."""
    global _torch_write_metadata
    from torch.distributed.checkpoint import _consolidate_hf_safetensors as consolidate

    if consolidate._write_metadata is not _write_metadata_format_pt:
        _torch_write_metadata = consolidate._write_metadata
        consolidate._write_metadata = _write_metadata_format_pt
