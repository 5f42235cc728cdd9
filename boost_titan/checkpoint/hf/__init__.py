"""Hugging Face interop: the layouts a boost_titan model is written in and read from.

One :class:`HFFormat` per Hugging Face layout (``FORMATS``):

boost   our own ``transformers`` model class (``model_type "boost_llama"``), shipped in
        the package and copied into each exported folder (``auto_map``): every
        architecture (dense, svd, cola, lax); ``boost_titan/checkpoint/hf/boost_format.py``
llama   ``transformers``' ``LlamaForCausalLM`` (dense ``llama2`` only):
        ``boost_titan/checkpoint/hf/llama_format.py``
cola    the CoLA authors' ``ColaForCausalLM`` (github alvin-zyl/CoLA, ``model_type
        "cola"``; ``cola_llama2`` only): ``boost_titan/checkpoint/hf/cola_format.py``

The folder writer/reader (config.json, generation_config.json, sharded safetensors,
tokenizer files) and torchtitan's state-dict adapters (``[checkpoint] last_save_in_hf``
/ ``initial_load_in_hf``) both go through these classes, so a name or orientation is
defined once. Nothing here imports ``transformers`` at module level.
"""

from __future__ import annotations

from typing import Any

import torch

from boost_titan.models.args import LlamaArgs


class HFFormatError(ValueError):
    """A Hugging Face folder or state dict that does not fit the model: one line naming
    what is wrong (missing / extra / mis-shaped tensors, another architecture or rank)."""


class HFFormat:
    """One Hugging Face layout: names, orientations and config.json of a model."""

    name: str = ""
    archs: tuple[str, ...] = ()
    """``LlamaArgs.arch`` values this layout can hold."""

    def check(self, args: LlamaArgs) -> None:
        """Refuse, in one line, a model this layout cannot hold."""
        if args.arch not in self.archs:
            raise HFFormatError(
                f"the {self.name!r} Hugging Face layout holds architectures "
                f"{list(self.archs)}, not {args.arch!r}"
            )
        self.config(args)  # raises on what the layout cannot express

    def config(self, args: LlamaArgs) -> dict[str, Any]:
        """config.json content (without tokenizer ids, which the folder writer adds)."""
        raise NotImplementedError

    def args_from_config(self, config: dict[str, Any]) -> LlamaArgs:
        """The model a config.json describes (import, and checks against a run's model)."""
        raise NotImplementedError

    def to_hf(
        self, state_dict: dict[str, torch.Tensor], args: LlamaArgs
    ) -> dict[str, torch.Tensor]:
        """Our FQNs -> this layout's names (exact: only renames, transposes, permutations)."""
        raise NotImplementedError

    def from_hf(
        self, hf_state_dict: dict[str, torch.Tensor], args: LlamaArgs
    ) -> dict[str, torch.Tensor]:
        """This layout's names -> our FQNs; the exact inverse of :meth:`to_hf`."""
        raise NotImplementedError


FORMATS: dict[str, HFFormat] = {}


def register(fmt: HFFormat) -> HFFormat:
    FORMATS[fmt.name] = fmt
    return fmt
