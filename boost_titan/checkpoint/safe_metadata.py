"""Loading a DCP checkpoint runs no code from it: every pickle in it is read restricted.

A DCP step folder holds three kinds of pickle, and torch / torchtitan read two of them
with plain pickle, so a crafted folder (a colleague's run, a shared or downloaded
checkpoint) would run any code it likes the moment it is loaded. :func:`install`
routes each through a restricted reader; each refusal is one line naming the step
folder, the item and the refused global, raised before anything is built from it:

- ``.metadata`` (torch's ``FileSystemReader.read_metadata``: plain ``pickle.load``):
  :func:`read_metadata`, whose unpickler resolves only the globals DCP metadata is
  made of (:data:`ALLOWED`).
- non-tensor items (train state, LR schedulers, optimizer settings, the data loader's
  state; torch's ``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``):
  :func:`load_bytes`, the same with ``weights_only=True``. torch's weights-only
  defaults cover every item boost_titan and torchtitan save (checked on real
  checkpoints: one process and every parallel layout, with AdamW and LORO state, the
  boost_corpus and local_text data loaders), so no global is added to them.
  :func:`create_local_plan` first refuses a key the load asks for as a tensor that the
  metadata declares a bytes item (a pickle in place of, say, a model weight).
- the data loader's own state, a pickle inside its bytes item (torchtitan's
  ``ParallelAwareDataloader.load_state_dict``: ``pickle.loads``):
  :func:`load_dataloader_state` unpickles it first with no global allowed at all (the
  state of torchtitan's text datasets and torchdata's loader, with or without workers,
  is made of dicts, lists, ints and None), then hands it to torchtitan's method.

Tensor items were already safe (torch reads each with ``weights_only=True``). Still
trusted: torch's own weights-only allowlist (and anything this process adds to it with
``torch.serialization.add_safe_globals``), and any loader outside DCP (see docs/checkpoints.md,
"Loading checkpoints you did not write"). When a newer torch or torchtitan saves a
global outside these lists, the refusal names it: extend a list on purpose, never
bypass the check.

Why patches of methods and not readers or planners of our own: torchtitan's
CheckpointManager calls ``dcp.load(state, checkpoint_id=...)`` and DCP builds its
``FileSystemReader`` and ``DefaultLoadPlanner`` itself; replacing the methods covers
that, ``boost_titan.cli.checkpoint`` and every other ``dcp.load`` /
``_load_state_dict_from_keys`` of the process (subclasses such as fsspec's reader and
``_EmptyStateDictLoadPlanner`` inherit them) without copying torchtitan's loading code.
They are applied by the entry points that load checkpoints (``boost_titan.train``, which
the fork server preloads, and ``boost_titan.cli.checkpoint``), not on ``import
boost_titan``, which must stay light."""

from __future__ import annotations

import io
import os
import pickle
import re
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

_DCP_METADATA = "torch.distributed.checkpoint.metadata"
# (module, name) of every global a DCP .metadata pickle refers to (torch 2.13, every
# layout boost_titan saves: tests/test_safe_metadata.py and the checkpoint tests check
# real checkpoints against this). Each one only builds inert data when called.
ALLOWED: frozenset[tuple[str, str]] = frozenset(
    [
        *(
            (_DCP_METADATA, n)
            for n in (
                "Metadata",
                "StorageMeta",
                "MetadataIndex",
                "TensorStorageMetadata",
                "BytesStorageMetadata",
                "ChunkStorageMetadata",
                "TensorProperties",
                "_MEM_FORMAT_ENCODING",  # an Enum: TensorProperties' memory format
            )
        ),
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),  # file, offset, length
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),  # a dict lookup: "torch.strided" -> layout
        # StorageMeta.checkpoint_id: the writer's folder, a Path (a POSIX one here)
        ("pathlib", "PosixPath"),
        # dtypes pickle as a global of the torch module (torch.float32, ...)
        *(("torch", n) for n, v in vars(torch).items() if isinstance(v, torch.dtype)),
    ]
)


class UntrustedCheckpointError(BaseException):
    """A checkpoint refused: a pickle in it refers to a global outside its allowlist,
    or its metadata declares a pickle where a tensor is expected.

    A BaseException, like DCP's own CheckpointException: DCP's loader catches any
    ``Exception`` from ``read_metadata`` and falls back to rank-local ``__N.metadata``
    files; a refusal must end the load, not be logged and worked around."""


def _refusal(
    where: str, what: str, allowed: str | None = "boost_titan.checkpoint.safe_metadata.ALLOWED"
) -> UntrustedCheckpointError:
    return UntrustedCheckpointError(
        f"checkpoint {where} was not loaded: {what}; it is not a DCP checkpoint "
        "boost_titan wrote or trusts" + (f" (allowed: {allowed})" if allowed else "")
    )


def refusal_in(exc: BaseException) -> UntrustedCheckpointError | None:
    """The refusal inside DCP's CheckpointException (it wraps each rank's failure),
    so that a run ends on the refusal's line rather than on DCP's per-rank report;
    or ``exc`` itself (the data loader's refusal comes after DCP's read, unwrapped)."""
    if isinstance(exc, UntrustedCheckpointError):
        return exc
    failures = getattr(exc, "failures", None) or {}
    for failure, _trace in failures.values():
        if isinstance(failure, UntrustedCheckpointError):
            return failure
    return None


class _Unpickler(pickle.Unpickler):
    """The C unpickler (as fast as ``pickle.load``) with globals restricted to
    ``allowed``; ``refuse(global)`` makes the error for any other.

    ``find_class`` runs when the pickle names a global, before anything can call it;
    without a ``persistent_load`` any persistent id is refused by pickle itself."""

    def __init__(self, file, allowed: frozenset[tuple[str, str]], refuse, **kwargs):
        super().__init__(file, **kwargs)
        self.allowed = allowed
        self.refuse = refuse

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise self.refuse(f"{module}.{name}")
        return super().find_class(module, name)


def _allowed_objects() -> list[tuple[str, Any]]:
    """(name, object) of each allowed global that has attributes a pickle could set,
    and of each member of the allowed enum (REDUCE hands back the singletons)."""
    import enum
    import importlib

    out = []
    for module, name in sorted(ALLOWED):
        obj = getattr(importlib.import_module(module), name)
        out.append((f"{module}.{name}", obj))
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            out += [(f"{module}.{name}.{m.name}", m) for m in obj]
    return [(n, o) for n, o in out if hasattr(o, "__dict__") and not _immutable(o)]


def _immutable(obj) -> bool:
    """A class no setattr can change (``torch.Size``: a static C type)."""
    return isinstance(obj, type) and bool(obj.__flags__ & _IMMUTABLE_TYPE)


_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE


# The special attributes a setattr can replace, by kind of object (beyond its type and
# its __dict__'s entries): a class's __module__ and __doc__ are entries of its __dict__
_FUNCTION_ATTRS = (
    "__code__",
    "__defaults__",
    "__kwdefaults__",
    "__name__",
    "__qualname__",
    "__module__",
    "__doc__",
    "__annotations__",
    "__dict__",
)
_CLASS_ATTRS = ("__name__", "__qualname__", "__bases__")
_INSTANCE_ATTRS = ("__dict__",)


def _setattr(obj) -> Callable[[Any, str, Any], None]:
    """The setattr that puts ``obj``'s state back whatever its class now says (a frozen
    dataclass's ``__setattr__`` refuses, an Enum class's guards its members)."""
    return type.__setattr__ if isinstance(obj, type) else object.__setattr__


def _identity(obj) -> tuple[dict[str, Any], dict[str, Any]]:
    """All of ``obj`` a BUILD could change: its type and the special attributes of its
    kind (each by identity), and its __dict__'s entries."""
    if isinstance(obj, type):
        names = _CLASS_ATTRS
    elif isinstance(obj, types.FunctionType):
        names = _FUNCTION_ATTRS
    else:
        names = _INSTANCE_ATTRS
    special = {"__class__": type(obj), **{n: getattr(obj, n) for n in names if hasattr(obj, n)}}
    return special, dict(vars(obj))


def _restore(obj, before: tuple[dict[str, Any], dict[str, Any]]) -> list[str]:
    """Put back what a pickle changed of ``obj`` (its type first: what can be set depends
    on it); the names of what it changed."""
    special, entries = before
    changed = []
    if type(obj) is not special["__class__"]:
        _setattr(obj)(obj, "__class__", special["__class__"])
        changed.append("__class__")
    now_special, _ = _identity(obj)
    for k, v in special.items():
        if k != "__class__" and now_special.get(k) is not v:
            _setattr(obj)(obj, k, v)
            changed.append(k)
    now = dict(vars(obj))
    moved = [k for k in now if k not in entries or now[k] is not entries[k]]
    moved += [k for k in entries if k not in now]
    for k in moved:
        if k in entries:
            _setattr(obj)(obj, k, entries[k])
        else:
            (type.__delattr__ if isinstance(obj, type) else object.__delattr__)(obj, k)
    return changed + [k for k in moved if k not in changed]


def _is_dunder(key) -> bool:
    if isinstance(key, bytes):
        key = key.decode("latin-1")
    return isinstance(key, str) and _DUNDER.fullmatch(key) is not None


_DUNDER = re.compile(r"__[A-Za-z0-9_]+__")
# What could be a special ("dunder") name in a pickle's bytes (see loads): written out,
# or hidden in protocol 0's \u escapes
_MAYBE_DUNDER = (
    re.compile(rb"__[A-Za-z0-9_]+__"),
    re.compile(rb"\\(u[0-9A-Fa-f]{4}|U[0-9A-Fa-f]{8})"),
)


class _CheckedUnpickler(pickle._Unpickler):  # type: ignore[name-defined]
    """The pure Python unpickler with :class:`_Unpickler`'s globals, whose BUILD
    refuses, before it sets anything, a special attribute (``__class__``, ``__dict__``,
    ``__defaults__``, ...) on any object and any attribute on an allowed global or enum
    member (``guarded``: id -> name). DCP metadata's own BUILDs set dataclass fields."""

    dispatch = dict(pickle._Unpickler.dispatch)  # type: ignore[attr-defined]

    def __init__(self, file, allowed, refuse, guarded: dict[int, str], where: str):
        super().__init__(file, encoding="bytes")
        self.allowed, self.refuse, self.guarded, self.where = allowed, refuse, guarded, where

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self.allowed:
            raise self.refuse(f"{module}.{name}")
        return super().find_class(module, name)

    def load_build(self) -> None:
        state, inst = self.stack[-1], self.stack[-2]
        parts = state if isinstance(state, tuple) and len(state) == 2 else (state,)
        keys = [k for part in parts if isinstance(part, dict) for k in part]
        target = self.guarded.get(id(inst))
        bad = keys if target is not None else [k for k in keys if _is_dunder(k)]
        if target is not None or bad:
            what = target or f"a {type(inst).__module__}.{type(inst).__qualname__} it builds"
            attrs = ", ".join(k.decode("latin-1") if isinstance(k, bytes) else str(k) for k in bad)
            raise _refusal(
                self.where,
                f"its .metadata sets {what}.{attrs or '(its state)'} while it is unpickled "
                "(refused before it was set)"[:300],
                None,
            )
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build


def loads(data: bytes, where: str) -> Any:
    """Unpickle DCP metadata from its bytes. ``where`` (the step folder) starts the error
    message.

    An allowed global runs no code, but pickle's BUILD can set attributes: on the global
    itself (``setattr`` of its slot state: a class, a function, an enum member), which
    would outlive the load and the refusal, and special ones (``__class__``) on any
    object it builds. Where the bytes hold a special name, :class:`_CheckedUnpickler`
    reads them, refusing such a BUILD before it sets anything; otherwise the C
    unpickler (4.5x faster: a 273 MiB ``.metadata`` unpickles in ~25 s), which cannot
    make that name: an attribute's name is a string of the pickle, and every string is
    in its bytes as it is, but for protocol 0's \\u escapes (scanned for too) and
    its STRING escapes (read as bytes, ``encoding="bytes"``: no attribute name). Either
    way the complete identity of every allowed global and enum member (type, special
    attributes, __dict__) is compared before and after; any change is put back and the
    step refused."""

    def refuse(name: str) -> UntrustedCheckpointError:
        return _refusal(where, f"its .metadata refers to {name}, which DCP metadata is not made of")

    guarded = _allowed_objects()
    before = [_identity(obj) for _, obj in guarded]
    file = io.BytesIO(data)
    try:
        if any(p.search(data) for p in _MAYBE_DUNDER):
            names = {id(obj): name for name, obj in guarded}
            return _CheckedUnpickler(file, ALLOWED, refuse, names, where).load()
        return _Unpickler(file, ALLOWED, refuse, encoding="bytes").load()
    finally:
        touched = [
            f"{name}.{attr}"
            for (name, obj), state in zip(guarded, before)
            for attr in _restore(obj, state)
        ]
        if touched:
            raise _refusal(
                where,
                f"its .metadata sets {', '.join(touched)[:200]} while it is unpickled (put back)",
                None,
            )


# The step folder whose .metadata this process read last, for the errors below: DCP
# reads a step's metadata at the start of each load (on every rank), then its items,
# then hands Stateful objects such as the data loader their state. Loads of one
# process do not overlap (DCP has no asynchronous load).
_loading = ""


def _where() -> str:
    return _loading or "(a folder not read through boost_titan.checkpoint.safe_metadata)"


# Set by boost_titan.checkpoint.integrity.install(): ``metadata_reader(reader, folder)``
# opens the step folder of a local DCP load itself (its manifest and the bytes of its
# .metadata verified first) and returns its Metadata, unpickled by :func:`loads`.
metadata_reader: Callable[..., Metadata] | None = None


def read_metadata(self: filesystem.FileSystemReader, *args: Any, **kwargs: Any) -> Metadata:
    """``FileSystemReader.read_metadata`` of torch 2.13 with :data:`metadata_reader`
    (else :func:`loads`) in place of ``pickle.load``; the rest is torch's, line for
    line."""
    global _loading
    rank = kwargs.get("rank")
    path = self._get_metadata_path(rank)
    _loading = folder = os.fspath(Path(os.fspath(path)).parent)
    if metadata_reader is not None and rank is None and type(self.fs) is filesystem.FileSystem:
        metadata = metadata_reader(self, folder)
    else:
        with self.fs.create_stream(path, "rb") as metadata_file:
            data = metadata_file.read()
        metadata = loads(data, folder)
        if not isinstance(metadata, Metadata):
            raise _refusal(
                folder, f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata"
            )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    metadata.storage_meta.load_id = self.load_id
    return metadata


_torch_create_local_plan = DefaultLoadPlanner.create_local_plan


def create_local_plan(self: DefaultLoadPlanner) -> LoadPlan:
    """torch's plan, refused if it would read a pickle where this load expects a
    tensor: the metadata decides an item's kind, so a crafted one could declare a model
    weight a bytes item, and DCP would put whatever that pickle unpickles to (even
    weights-only) in the weight's place."""
    plan = _torch_create_local_plan(self)
    for item in plan.items:
        key = item.dest_index.fqn
        if item.type == LoadItemType.BYTE_IO and isinstance(self.state_dict.get(key), torch.Tensor):
            raise _refusal(
                _where(),
                f"its .metadata declares {key} a pickled (bytes) item, where this load "
                "expects a tensor",
                None,
            )
    return plan


def load_bytes(self: DefaultLoadPlanner, read_item: ReadItem, value: io.BytesIO) -> None:
    """``DefaultLoadPlanner.load_bytes`` of torch 2.13 with ``weights_only=True`` in
    place of ``weights_only=False``; the rest is torch's, line for line."""
    key = read_item.dest_index.fqn
    try:
        obj = torch.load(value, weights_only=True)
    except pickle.UnpicklingError as e:  # torch's weights-only refusal
        raise _refusal(
            _where(), f"its item {key} {_refused_globals(value, e)}", _WEIGHTS_ONLY
        ) from None
    if self.flatten_state_dict:
        set_element(self.original_state_dict, self.mappings[key], obj)
    else:
        self.state_dict[key] = obj


_WEIGHTS_ONLY = "torch.load(weights_only=True)'s globals"


def _refused_globals(value: io.BytesIO, e: pickle.UnpicklingError) -> str:
    """What torch refused, in one line: the globals a static scan of the item's pickle
    finds outside the weights-only allowlist (torch's multi-line message buries them),
    else the first line of torch's message."""
    value.seek(0)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(value)
    except ValueError:  # not a torch.save archive
        names = []
    if names:
        return f"refers to {', '.join(sorted(names))}, which no item boost_titan saves is made of"
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return f"is refused by torch's weights-only loader: {first}"


def dataloader_state(blob: bytes, key: str) -> Any:
    """A data loader's pickled state unpickled with no global allowed: torchtitan's
    text datasets (boost_corpus, local_text, ...) and torchdata's StatefulDataLoader
    save dicts, lists, ints, bools and None only (checked on real checkpoints)."""

    def refuse(name: str) -> UntrustedCheckpointError:
        return _refusal(
            _where(),
            f"its data loader state {key} refers to {name}, which data loader state is not made of",
            "no global: plain data",
        )

    return _Unpickler(io.BytesIO(blob), frozenset(), refuse).load()


_torchtitan_load_dataloader_state = None


def load_dataloader_state(self, state_dict: dict[str, Any]) -> None:
    """torchtitan's ``ParallelAwareDataloader.load_state_dict``, which ``pickle.loads``
    this rank's state, after :func:`dataloader_state` has read that pickle. A pickle
    that names no global cannot call anything, so torchtitan's own ``pickle.loads`` of
    the same bytes then builds the same plain data; its method (checks, warning) is
    kept as it is."""
    blob = state_dict.get(self._rank_id) if state_dict else None
    if isinstance(blob, (bytes, bytearray)):
        dataloader_state(blob, self._rank_id)
    _torchtitan_load_dataloader_state(self, state_dict)


def install() -> None:
    """Route every DCP load of this process through the readers above (idempotent).
    Imports torchtitan: call it after ``cpu_runtime.activate()``."""
    global _torchtitan_load_dataloader_state
    from torchtitan.components.dataloader import ParallelAwareDataloader

    filesystem.FileSystemReader.read_metadata = read_metadata  # type: ignore[method-assign]
    DefaultLoadPlanner.create_local_plan = create_local_plan  # type: ignore[method-assign]
    DefaultLoadPlanner.load_bytes = load_bytes  # type: ignore[method-assign]
    if ParallelAwareDataloader.load_state_dict is not load_dataloader_state:
        _torchtitan_load_dataloader_state = ParallelAwareDataloader.load_state_dict
        ParallelAwareDataloader.load_state_dict = load_dataloader_state  # type: ignore[method-assign]


def installed() -> bool:
    from torchtitan.components.dataloader import ParallelAwareDataloader

    return (
        filesystem.FileSystemReader.read_metadata is read_metadata
        and DefaultLoadPlanner.create_local_plan is create_local_plan
        and DefaultLoadPlanner.load_bytes is load_bytes
        and ParallelAwareDataloader.load_state_dict is load_dataloader_state
    )
