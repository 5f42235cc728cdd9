"""A layout that differs from ours by names, transposes and q/k row permutations only.

A format lists, for a model's arguments, one :class:`Entry` per tensor: our FQN, its
Hugging Face name, our shape, and the two exact maps between the orientations.
:meth:`RenamingFormat.to_hf` / :meth:`~RenamingFormat.from_hf` then rename tensor by
tensor. A state dict may be a *part* of the model (a pipeline stage's, under
``[checkpoint] last_save_in_hf`` / ``initial_load_in_hf``): every name must be known and
every shape right, but nothing is required to be there; :meth:`RenamingFormat.check_complete`
is the whole-model check a folder reader adds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from boost_titan.checkpoint.hf import HFFormat, HFFormatError
from boost_titan.models.args import LlamaArgs

Map = Callable[[torch.Tensor], torch.Tensor]


def same(t: torch.Tensor) -> torch.Tensor:
    return t


@dataclass(frozen=True)
class Entry:
    ours: str
    hf: str
    shape: tuple[int, ...]  # ours
    to_hf: Map = same
    from_hf: Map = same

    @property
    def hf_shape(self) -> tuple[int, ...]:
        # every map here is a permutation of rows or a transpose: evaluate it on meta
        return tuple(self.to_hf(torch.empty(self.shape, device="meta")).shape)


# our block-relative names -> LlamaForCausalLM's (the CoLA authors' model uses the same)
PROJECTIONS = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w3": "mlp.up_proj",
    "feed_forward.w2": "mlp.down_proj",
}
BLOCK_NORMS = {"attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


class RenamingFormat(HFFormat):
    def entries(self, args: LlamaArgs) -> Iterator[Entry]:
        raise NotImplementedError

    def check_args(self, args: LlamaArgs) -> None:
        """Refuse a model this layout cannot hold (one line)."""
        if args.arch not in self.archs:
            raise HFFormatError(
                f"the {self.name!r} Hugging Face layout holds architectures "
                f"{list(self.archs)}, not {args.arch!r}; use --hf-layout boost"
            )

    def table(self, args: LlamaArgs) -> list[Entry]:
        self.check_args(args)
        return list(self.entries(args))

    def hf_shapes(self, args: LlamaArgs) -> dict[str, tuple[int, ...]]:
        """Every tensor of the whole model in this layout: name -> shape."""
        return {e.hf: e.hf_shape for e in self.table(args)}

    def to_hf(self, state_dict: dict[str, Any], args: LlamaArgs) -> dict[str, Any]:
        by_ours = {e.ours: e for e in self.table(args)}
        out = {}
        for name, t in state_dict.items():
            e = _lookup(by_ours, name, "our", self.name)
            _check_shape(name, t, e.shape, self.name)
            out[e.hf] = e.to_hf(t)
        return out

    def from_hf(self, hf_state_dict: dict[str, Any], args: LlamaArgs) -> dict[str, Any]:
        by_hf = {e.hf: e for e in self.table(args)}
        out = {}
        for name, t in hf_state_dict.items():
            e = _lookup(by_hf, name, "Hugging Face", self.name)
            _check_shape(name, t, e.hf_shape, self.name)
            out[e.ours] = e.from_hf(t)
        return out

    def check_complete(self, hf_names, args: LlamaArgs) -> None:
        """Every tensor of the model is there (and nothing else)."""
        want = {e.hf for e in self.table(args)}
        have = set(hf_names)
        if want != have:
            missing, extra = sorted(want - have), sorted(have - want)
            raise HFFormatError(
                f"the {self.name!r} layout of this model has {len(want)} tensors; "
                f"missing {missing[:4]}{' ...' if len(missing) > 4 else ''}, "
                f"unexpected {extra[:4]}{' ...' if len(extra) > 4 else ''}"
            )


def _lookup(table: dict[str, Entry], name: str, side: str, fmt: str) -> Entry:
    try:
        return table[name]
    except KeyError:
        raise HFFormatError(
            f"{name!r} is not a tensor of this model in the {fmt!r} layout ({side} names, "
            f"e.g. {next(iter(table))!r})"
        ) from None


def _check_shape(name: str, t, shape: tuple[int, ...], fmt: str) -> None:
    if tuple(t.shape) != tuple(shape):
        raise HFFormatError(
            f"{name!r} has shape {list(t.shape)}; this model's {fmt!r} layout needs {list(shape)}"
        )
