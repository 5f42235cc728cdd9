"""Consolidated safetensors export / import of a checkpoint's model weights.

``export`` reads the model weights of a DCP checkpoint written by any layout (1
process, TP/BTP, FSDP2, HSDP, PP: DCP stores global tensors, so the layout does not
matter) and writes them to one safetensors file. ``import`` writes a model-only DCP
checkpoint that training loads with ``--checkpoint.initial_load_path`` in any layout.
The config (model name, flavor, ``[boost]`` rank options) defines the model the weights
must fit: every parameter must be present with its exact shape, with nothing extra,
or the command fails naming the offending tensors, before writing anything.

File layout (documented in docs/checkpoints.md): one tensor per parameter under its model FQN
(``tok_embeddings.weight``, ``layers.{i}.attention.wq.down.weight`` = A [r, d],
``layers.{i}.attention.wq.up.weight`` = B [heads*head_dim, r], so W ~= B @ A, ...),
and string metadata: ``format`` (``boost_titan/1``), ``model_name``, ``flavor``,
``model_args`` (JSON), ``source`` and ``step``.

Both write to a temporary path in the target's folder and rename it into place when
complete (:mod:`boost_titan.checkpoint.files`): a failure never leaves a half-written
file or checkpoint behind. The command line is ``boost-titan checkpoint``
(:mod:`boost_titan.cli.checkpoint`); the train specs must be registered
(``boost_titan.train.specs.register_all``, which parsing a config does) before
:func:`model_for` looks one up.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from boost_titan.checkpoint.files import new_tmp, open_safetensors
from boost_titan.checkpoint.model_args import check_recorded

FORMAT = "boost_titan/1"


# top-level DCP keys torchtitan stores next to the (flattened) model state
@contextmanager
def _without_process_group():
    """DCP warns that it runs without a process group: that is the point here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
        )
        yield


_TRAINING_STATE = ("optimizer.", "lr_scheduler.", "dataloader.", "train_state")


def model_for(job_config):
    """(train spec's model args after the config's overrides, meta-device model)."""
    import copy

    from torchtitan.protocols.train_spec import get_train_spec

    spec = get_train_spec(job_config.model.name)
    args = copy.deepcopy(spec.model_args[job_config.model.flavor])
    args.update_from_config(job_config)
    with torch.device("meta"):
        model = spec.model_cls(args)
    return args, model


def expected_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent state (parameters and persistent buffers) by FQN, on meta."""
    return dict(model.state_dict())


def check_names_and_shapes(
    found: dict[str, torch.Size], expected: dict[str, torch.Tensor], where: str, model_desc: str
) -> None:
    missing = sorted(set(expected) - set(found))
    extra = sorted(set(found) - set(expected))
    wrong = sorted(
        f"{k}: {tuple(found[k])} (model: {tuple(expected[k].shape)})"
        for k in set(found) & set(expected)
        if tuple(found[k]) != tuple(expected[k].shape)
    )
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors, e.g. {missing[:5]}")
    if extra:
        problems.append(f"{len(extra)} tensors the model does not have, e.g. {extra[:5]}")
    if wrong:
        problems.append(f"{len(wrong)} shape mismatches, e.g. {wrong[:5]}")
    if problems:
        raise ValueError(
            f"{where} does not fit {model_desc}: "
            + "; ".join(problems)
            + ". Use the config (model name, flavor, [boost] rank options) "
            "the weights were trained with."
        )


def model_desc(job_config) -> str:
    return f"model {job_config.model.name!r} flavor {job_config.model.flavor!r}"


def _stored_model(checkpoint_dir, expected: dict[str, torch.Tensor], model_desc: str) -> dict:
    """The model tensors' DCP metadata (FQN -> TensorStorageMetadata), checked against
    ``expected`` (names and shapes) before any tensor is read."""
    path = Path(checkpoint_dir)
    if not (path / ".metadata").is_file():
        hint = (
            ""
            if path.exists()
            else ": it does not exist. Checkpoints are written by runs with [checkpoint] "
            "enable = true (e.g. `./run_train.sh --checkpoint.enable`), as "
            "<dump_folder>/checkpoint/step-N"
        )
        raise FileNotFoundError(f"{str(path)!r} is not a DCP checkpoint (no .metadata file){hint}")
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    with _without_process_group():
        meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    stored = {
        k: v
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata) and not k.startswith(_TRAINING_STATE)
    }
    check_names_and_shapes(
        {k: v.size for k, v in stored.items()}, expected, f"checkpoint {str(path)!r}", model_desc
    )
    return stored


def _load(path: Path, stored: dict, names) -> dict[str, torch.Tensor]:
    state = {k: torch.empty(stored[k].size, dtype=stored[k].properties.dtype) for k in names}
    with _without_process_group():
        dcp.load(state, checkpoint_id=str(path), no_dist=True)
    return state


def read_dcp_model(
    checkpoint_dir: str | os.PathLike,
    expected: dict[str, torch.Tensor],
    model_desc: str = "the model",
) -> dict[str, torch.Tensor]:
    """The model tensors of a DCP checkpoint as full, plain CPU tensors (their stored
    dtype), all at once (an export streams them instead: :class:`DCPModelReader`)."""
    stored = _stored_model(checkpoint_dir, expected, model_desc)
    return _load(Path(checkpoint_dir), stored, stored)


_BLOCK = re.compile(r"(layers\.\d+)\.")


def _group(fqn: str) -> str:
    """A block's tensors are read together (one ``dcp.load``); the rest one by one."""
    m = _BLOCK.match(fqn)
    return m[1] if m else fqn


class DCPModelReader:
    """A DCP checkpoint's model tensors, read one block at a time: :meth:`get` loads the
    block (or top-level tensor) a name belongs to with one ``dcp.load`` and drops the one
    before, and hands each tensor out once. Asked in an order that keeps a block's
    names together (name order does), memory holds one block. ``peak_bytes``: the most
    tensor bytes it held (what ``tests/test_export_stream.py`` checks)."""

    def __init__(self, checkpoint_dir, expected: dict[str, torch.Tensor], model_desc: str):
        self.path = Path(checkpoint_dir)
        self.stored = _stored_model(checkpoint_dir, expected, model_desc)
        self.specs = {k: (tuple(v.size), v.properties.dtype) for k, v in self.stored.items()}
        self.key: str | None = None
        self.held: dict[str, torch.Tensor] = {}
        self.peak_bytes = 0
        self.loads = 0

    def get(self, fqn: str) -> torch.Tensor:
        key = _group(fqn)
        if key != self.key or fqn not in self.held:
            self.held = {}  # dropped before the next block is read
            self.key = key
            self.held = _load(self.path, self.stored, [k for k in self.stored if _group(k) == key])
            self.loads += 1
            size = sum(t.numel() * t.element_size() for t in self.held.values())
            self.peak_bytes = max(self.peak_bytes, size)
        return self.held.pop(fqn)


def _step_of(path: Path) -> str:
    m = re.fullmatch(r"step-(\d+)", path.name)
    return m[1] if m else ""


def _args_json(args) -> str:
    fields = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
    return json.dumps(
        {k: v for k, v in fields.items() if isinstance(v, (int, float, str, bool, type(None)))},
        sort_keys=True,
    )


def export_safetensors(
    job_config, checkpoint_dir: str, out: str, dtype: torch.dtype | None = None
) -> Path:
    """The step's model weights -> one safetensors file, a block at a time
    (:class:`DCPModelReader`, ``safetensors_stream.write_safetensors``)."""
    from boost_titan.checkpoint.safetensors_stream import write_safetensors

    args, model = model_for(job_config)
    check_recorded(checkpoint_dir, args, model_desc(job_config))
    reader = DCPModelReader(checkpoint_dir, expected_tensors(model), model_desc(job_config))
    specs = {k: (shape, dtype or stored) for k, (shape, stored) in reader.specs.items()}
    out_path = Path(out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {
        "format": FORMAT,
        "model_name": job_config.model.name,
        "flavor": job_config.model.flavor,
        "model_args": _args_json(args),
        "source": str(Path(checkpoint_dir).resolve()),
        "step": _step_of(Path(checkpoint_dir)),
    }
    tmp = new_tmp(out_path, folder=False)  # (its mode is kept: a plain write's)
    try:
        write_safetensors(tmp, specs, lambda k: _cast(reader.get(k), dtype), metadata)
        os.replace(tmp, out_path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return out_path


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None else t.to(dtype)


def import_safetensors(job_config, path: str, out_dir: str) -> Path:

    src = Path(path)
    if not src.is_file():
        raise FileNotFoundError(f"safetensors file {path!r} does not exist")
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out_dir!r} exists; import writes a new checkpoint folder")
    args, model = model_for(job_config)
    with open_safetensors(src) as f:
        meta = f.metadata() or {}
        if meta.get("format") != FORMAT:
            raise ValueError(
                f"{path!r} is not a boost_titan export (format {meta.get('format')!r}, "
                f"expected {FORMAT!r})"
            )
        for key, want in (
            ("model_name", job_config.model.name),
            ("flavor", job_config.model.flavor),
        ):
            if meta.get(key) != want:
                raise ValueError(
                    f"{path!r} holds {key} {meta.get(key)!r}, the config says {want!r}"
                )
        state = {k: f.get_tensor(k) for k in f.keys()}
    check_names_and_shapes(
        {k: v.shape for k, v in state.items()},
        expected_tensors(model),
        f"file {path!r}",
        model_desc(job_config),
    )
    return write_dcp_model(state, out)


def write_dcp_model(state: dict[str, torch.Tensor], out: Path, args=None) -> Path:
    """A model-only DCP checkpoint folder at ``out`` (which must not exist), atomically;
    with ``args`` (LlamaArgs) it records them (``model_args.json``: ``--model.flavor OUT``)."""
    if out.exists():
        raise FileExistsError(f"{str(out)!r} exists; import writes a new checkpoint folder")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = new_tmp(out, folder=True)
    try:
        with _without_process_group():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        if args is not None:
            from boost_titan.models.recorded import write_model_args

            write_model_args(tmp, args)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
