"""The dense model a conversion starts from, read one tensor (or one block) at a time.

Every source gives tensors under our dense ``llama2`` FQNs and orientation
(``layers.{i}.attention.wq.weight`` ``[out, in]``, q/k rows in our interleaved RoPE order),
in the dtype they are stored in:

- :class:`HFSource`: a Hugging Face ``LlamaForCausalLM`` folder (config.json with
  ``model_type "llama"``, ``model.safetensors`` or sharded with its index), through the
  ``llama`` layout of ``boost_titan.checkpoint.hf.llama_format`` (names and the q/k row
  permutation);
  each tensor is read from its file with ``safe_open`` when asked for (memory-mapped,
  nothing else loaded);
- :class:`DCPSource`: a ``llama2`` DCP step folder written by the trainer (or by
  ``checkpoint import``), a block's tensors per ``dcp.load`` (checksums verified);
- :class:`StateDictSource`: a state dict in memory (tests, Python use).

:func:`open_source` picks by what the folder holds and checks, before anything is read,
that every tensor of the model is there with its shape: a wrong folder fails in one line.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

import torch

from boost_titan.checkpoint.files import open_safetensors
from boost_titan.checkpoint.hf import HFFormatError
from boost_titan.checkpoint.hf.folder import read_hf_config
from boost_titan.checkpoint.hf.llama_format import LLAMA
from boost_titan.models.args import LlamaArgs
from boost_titan.models.model import Transformer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# buffers old transformers versions saved beside the weights: not weights, ignored
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# top-level DCP keys the trainer stores next to the model state
_TRAINING_STATE = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state")


class SourceError(ValueError):
    """A dense source that cannot be converted: one line naming the folder and why."""


def model_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Every tensor of the model ``args`` describes: FQN -> shape, in the model's order."""
    with torch.device("meta"):
        model = Transformer(args)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


class DenseSource:
    """Read access to a dense model's tensors (our FQNs)."""

    args: LlamaArgs  # the dense model (arch "dense")
    shapes: dict[str, tuple[int, ...]]  # its tensors, FQN -> shape, in model order
    where: str = "the dense model"
    tokenizer_dir: Path | None = None  # a tokenizer.json that came with the weights

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def tensor(self, name: str) -> torch.Tensor:
        return self.tensors([name])[name]

    def block(self, i: int) -> dict[str, torch.Tensor]:
        """Block ``i``'s tensors by block-relative name (``attention.wq.weight``, ...)."""
        prefix = f"layers.{i}."
        names = [k for k in self.shapes if k.startswith(prefix)]
        return {k[len(prefix) :]: v for k, v in self.tensors(names).items()}


class StateDictSource(DenseSource):
    def __init__(self, args: LlamaArgs, state_dict: dict[str, torch.Tensor], where: str = ""):
        self.args, self.state = args, state_dict
        self.where = where or "the state dict"
        self.shapes = model_shapes(args)
        _check_complete({k: tuple(v.shape) for k, v in state_dict.items()}, self.shapes, self.where)

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        return {k: self.state[k] for k in names}


class HFSource(DenseSource):
    def __init__(self, folder: Path):
        self.folder = folder
        self.where = f"folder {str(folder)!r}"
        config = read_hf_config(folder)
        try:
            self.args = LLAMA.args_from_config(config)
        except HFFormatError as e:
            raise SourceError(f"{self.where} is not a Hugging Face LLaMA folder: {e}") from None
        except (KeyError, TypeError) as e:
            raise SourceError(f"{self.where}: config.json lacks LLaMA field {e}") from None
        self.files = self._weight_files()
        # a tied folder stores no lm_head.weight: ours is a copy of the embeddings
        self.stored_as = {}
        tied = config.get("tie_word_embeddings") and "lm_head.weight" not in self.files
        if tied and "model.embed_tokens.weight" in self.files:
            self.stored_as["lm_head.weight"] = "model.embed_tokens.weight"
            self.files["lm_head.weight"] = self.files["model.embed_tokens.weight"]
        self.entries = {e.ours: e for e in LLAMA.table(self.args)}
        shapes = self._stored_shapes()
        by_hf = {e.hf: e for e in self.entries.values()}
        unknown = sorted(set(shapes) - set(by_hf))
        if unknown:
            raise SourceError(
                f"{self.where} holds tensors a LLaMA model does not have, e.g. {unknown[:4]} "
                "(from-dense reads transformers' LlamaForCausalLM)"
            )
        ours = {}
        for hf, shape in shapes.items():
            e = by_hf[hf]
            if shape != e.hf_shape:
                raise SourceError(
                    f"{self.where}: {hf!r} has shape {list(shape)}, config.json implies "
                    f"{list(e.hf_shape)}"
                )
            ours[e.ours] = e.shape
        self.shapes = model_shapes(self.args)
        _check_complete(ours, self.shapes, self.where)
        if (folder / "tokenizer.json").is_file():
            self.tokenizer_dir = folder

    def _weight_files(self) -> dict[str, Path]:
        """HF name -> the safetensors file holding it."""
        folder = self.folder
        if (folder / INDEX_FILE).is_file():
            weight_map = json.loads((folder / INDEX_FILE).read_text()).get("weight_map", {})
            absent = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
            if absent:
                raise SourceError(f"{self.where}: {INDEX_FILE} names missing shards {absent[:3]}")
            return {
                k: folder / f for k, f in weight_map.items() if not k.endswith(_IGNORED_SUFFIXES)
            }
        if (folder / SINGLE_FILE).is_file():
            with open_safetensors(folder / SINGLE_FILE) as f:
                names = list(f.keys())
            return {k: folder / SINGLE_FILE for k in names if not k.endswith(_IGNORED_SUFFIXES)}
        bins = sorted(p.name for p in folder.glob("*.bin"))
        hint = (
            f": it holds {bins[:2]} (PyTorch pickles); save it with safetensors "
            "(save_pretrained(..., safe_serialization=True))"
            if bins
            else ""
        )
        raise SourceError(f"{self.where} has no weights ({SINGLE_FILE} or {INDEX_FILE}){hint}")

    def _stored_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = {}
        by_file: dict[Path, list[str]] = {}
        for name, path in self.files.items():
            by_file.setdefault(path, []).append(name)
        for path, names in by_file.items():
            with open_safetensors(path) as f:
                keys = set(f.keys())
                for name in names:
                    stored = self.stored_as.get(name, name)
                    if stored not in keys:
                        raise SourceError(f"{self.where}: {stored!r} is not in {path.name}")
                    shapes[name] = tuple(f.get_slice(stored).get_shape())
        return shapes

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        out = {}
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self.files[self.entries[name].hf], []).append(name)
        for path, group in by_file.items():
            with open_safetensors(path) as f:
                for name in group:
                    e = self.entries[name]
                    stored = self.stored_as.get(e.hf, e.hf)
                    out[name] = e.from_hf(f.get_tensor(stored)).contiguous()
        return out


class DCPSource(DenseSource):
    def __init__(self, folder: Path, args: LlamaArgs):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.folder, self.args = folder, args
        self.where = f"checkpoint {str(folder)!r}"
        meta = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
        stored = {
            k: tuple(v.size)
            for k, v in meta.items()
            if isinstance(v, TensorStorageMetadata) and not k.startswith(_TRAINING_STATE)
        }
        low_rank = sorted(k for k in stored if k.endswith((".down.weight", ".up.weight")))
        if low_rank:
            raise SourceError(
                f"{self.where} holds a low-rank model (e.g. {low_rank[0]!r}); from-dense reads "
                "a dense llama2 checkpoint"
            )
        self.dtypes = {k: meta[k].properties.dtype for k in stored}
        self.shapes = model_shapes(args)
        _check_complete(stored, self.shapes, self.where)

    def tensors(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        import torch.distributed.checkpoint as dcp

        state = {k: torch.empty(self.shapes[k], dtype=self.dtypes[k]) for k in names}
        with warnings.catch_warnings():  # one process, no process group: the point here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=str(self.folder), no_dist=True)
        return state


def _check_complete(
    found: dict[str, tuple[int, ...]], want: dict[str, tuple[int, ...]], where: str
) -> None:
    missing = [k for k in want if k not in found]
    extra = sorted(set(found) - set(want))
    wrong = [
        f"{k} {list(found[k])} (model: {list(want[k])})"
        for k in want
        if k in found and found[k] != want[k]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:3]}")
    if extra:
        problems.append(f"{len(extra)} tensors a dense LLaMA does not have, e.g. {extra[:3]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches, e.g. {wrong[:2]}")
    if problems:
        raise SourceError(f"{where} is not a complete dense LLaMA: " + "; ".join(problems))


def open_source(path: str | Path, dcp_args: LlamaArgs | None) -> DenseSource:
    """The dense model at ``path``: a Hugging Face LLaMA folder (config.json) or a DCP
    step folder (.metadata; its shapes are ``dcp_args``', the config's flavor as llama2)."""
    folder = Path(path)
    if not folder.exists():
        raise SourceError(
            f"--from {str(folder)!r} does not exist: from-dense reads a Hugging Face LLaMA "
            "folder (config.json + safetensors) or a llama2 DCP step folder"
        )
    if not folder.is_dir():
        import stat

        mode = folder.stat().st_mode
        kind = "a file" if stat.S_ISREG(mode) else "not a folder (a FIFO, socket or device)"
        raise SourceError(
            f"{str(folder)!r} is {kind}: from-dense reads a Hugging Face LLaMA folder "
            "(config.json + safetensors) or a llama2 DCP step folder"
        )
    if (folder / "config.json").is_file():
        return HFSource(folder)
    if (folder / ".metadata").is_file():
        return DCPSource(folder, dcp_args)
    raise SourceError(
        f"{str(folder)!r} is neither a Hugging Face LLaMA folder (no config.json) nor a "
        "DCP step folder (no .metadata)"
    )
