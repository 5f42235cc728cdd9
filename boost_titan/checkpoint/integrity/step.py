"""Opening a step folder: everything checked that can be checked before an item is
read, and ``.metadata`` unpickled only once its bytes are verified.

:func:`open_step` is the one reader of a step's ``.metadata`` and manifest: the launch
pre-check (``checkpoint.folder.states_held``), the data position check
(``checkpoint.data_position.saved_layout``), every DCP load (``safe_metadata``'s
``read_metadata`` hook, installed by ``integrity.install``), ``verify`` and export all
go through it, and a rank parses a step once per load (the last step opened is kept,
while its files' identity and size stay the same, until ``release`` at the end of the
load: a step's parse is as large as its items). Each file of the step is checked once
per open. In order:

1. the folder is a real folder (a symbolic link in the dump folder is refused: it would
   load as a step it is not, and the next save of that step would write through it; a
   checkpoint the user names may be a link, read through);
2. ``.manifest.json`` (:mod:`.manifest`), when there is one: a regular file, its body
   checked against its header's digest, then parsed (JSON); the step it names is the
   folder's N; every file it lists is a regular file inside the folder, of the size it
   records; ``.metadata``'s bytes match their digests; only then is ``.metadata``
   unpickled (allowlisted, ``safe_metadata``), and it must list exactly the manifest's
   items, where the manifest says they lie, and the same save id;
3. without a manifest: a ``.metadata.xxh3`` sidecar (trailers, :mod:`.legacy`) is
   checked before ``.metadata`` is unpickled; with neither, ``.metadata`` is unpickled
   unverified (allowlisted) and refused if it says its step was sealed;
4. for every step: each file ``.metadata`` names is a relative path inside the folder
   (no absolute path, no ``..``, no link out of it) to a regular file (no FIFO, no
   device: a read never blocks), and every item lies within its file.

Each problem is one :class:`ChecksumMismatch` line."""

from __future__ import annotations

import dataclasses
import os
import stat
from pathlib import Path

from torch.distributed.checkpoint.metadata import Metadata

from boost_titan.checkpoint import safe_metadata
from boost_titan.checkpoint.integrity import legacy
from boost_titan.checkpoint.integrity.blocks import NOT_LOADED, ChecksumMismatch, segment_digests
from boost_titan.checkpoint.integrity.manifest import (
    METADATA,
    NAME,
    SEAL,
    Seal,
    decode,
    gc_paused,
)
from boost_titan.checkpoint.integrity.manifest import step_of as _step_of_name

HF_INDEX = "model.safetensors.index.json"
SEALED, TRAILERS, UNVERIFIED = "sealed", "trailers", "unverified"


@dataclasses.dataclass
class Step:
    folder: str
    format: str  # "dcp" | "hf"
    trust: str  # SEALED | TRAILERS | UNVERIFIED
    metadata: Metadata | None  # None: a Hugging Face folder
    seal: Seal | None
    sizes: dict[str, int]  # every data file's size

    @property
    def training_states(self) -> set[str]:
        """Top-level keys of what the step holds (``optimizer``, ``train_state``...)."""
        if self.metadata is None:
            return set()
        return {k.split(".", 1)[0] for k in self.metadata.state_dict_metadata}


def _problem(folder: str, what: str, tail: str) -> ChecksumMismatch:
    return ChecksumMismatch(f"checkpoint {folder} {what}{tail}")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "folder"),
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISLNK, "symbolic link"),
    ):
        if test(mode):
            return name
    return "special file"


def _lstat(path: str):
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def check_folder(folder: str, tail: str = NOT_LOADED, allow_link: bool = False) -> None:
    st = _lstat(folder)
    if st is None:
        raise _problem(folder, "does not exist", tail)
    if stat.S_ISLNK(st.st_mode) and allow_link:
        st = _lstat(os.path.realpath(folder))
        if st is None:
            raise _problem(
                folder, f"is a symbolic link to {os.readlink(folder)}, which does not exist", tail
            )
    if stat.S_ISLNK(st.st_mode):
        raise _problem(
            folder,
            f"is a symbolic link (to {os.readlink(folder)}), not a folder: a step folder "
            "must be a real one (a link loads as a step it is not, and the next save of "
            "that step would write through it)",
            tail,
        )
    if not stat.S_ISDIR(st.st_mode):
        raise _problem(folder, f"is a {_kind(st.st_mode)}, not a step folder", tail)


def read_regular(folder: str, name: str, tail: str = NOT_LOADED) -> bytes | None:
    """The bytes of ``folder/name`` (None if absent), refused unless a regular file
    (opened without following a link, without blocking on a FIFO)."""
    path = os.path.join(folder, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:
        kind = "symbolic link" if os.path.islink(path) else None
        if kind:
            raise _problem(
                folder, f"is refused: its {name} is a {kind}, not a regular file", tail
            ) from None
        raise _problem(
            folder, f"is damaged: its {name} cannot be read ({e.strerror})", tail
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # (before fdopen, which raises IsADirectoryError on a folder)
        os.close(fd)
        raise _problem(
            folder, f"is refused: its {name} is a {_kind(mode)}, not a regular file", tail
        )
    with os.fdopen(fd, "rb") as f:
        try:
            return f.read()
        except OSError as e:
            raise _problem(
                folder, f"is damaged: its {name} cannot be read ({e.strerror})", tail
            ) from None


def _encodable(name: str) -> bool:
    """Whether ``name`` can name a file (a lone surrogate cannot: the file system call
    would raise UnicodeEncodeError)."""
    try:
        os.fsencode(name)
    except UnicodeEncodeError:
        return False
    return True


def _stat(call, path: str, folder: str, relative: str, tail: str):
    """``call(path)`` (lstat or stat) with a missing or unreadable file as the step's line."""
    try:
        return call(path)
    except FileNotFoundError:
        raise _problem(folder, f"is incomplete: {relative} is missing", tail) from None
    except OSError as e:
        raise _problem(
            folder, f"is damaged: {relative} cannot be read ({e.strerror})", tail
        ) from None


def member_size(folder: str, relative, tail: str = NOT_LOADED) -> int:
    """The size of the file a step's metadata names, refused unless it is a relative
    path to a regular file inside the folder."""
    if (
        not isinstance(relative, str)
        or not relative
        or os.path.isabs(relative)
        or ".." in Path(relative).parts
        or "\x00" in relative
    ):
        raise _problem(
            folder,
            f"is refused: its metadata names the file {relative!r}, not a relative path "
            "inside the step folder",
            tail,
        )
    if not _encodable(relative):
        raise _problem(
            folder,
            f"is refused: its metadata names the file {relative!r}, a name no file can have "
            "(a lone surrogate)",
            tail,
        )
    path = os.path.join(folder, relative)
    st = _stat(os.lstat, path, folder, relative, tail)
    # one lstat suffices for a plain name that is no link (DCP's __R_0.distcp): it lies in
    # the folder checked; a link, or a name through subfolders (a link among them), is
    # resolved to be checked inside it
    if stat.S_ISLNK(st.st_mode) or os.sep in relative:
        real, base = os.path.realpath(path), os.path.realpath(folder)
        if os.path.commonpath([real, base]) != base:
            raise _problem(
                folder,
                f"is refused: its metadata names {relative!r}, which resolves to {real}, "
                "outside the step folder",
                tail,
            )
        st = _stat(os.stat, path, folder, relative, tail)
    if not stat.S_ISREG(st.st_mode):
        raise _problem(
            folder, f"is refused: {relative} is a {_kind(st.st_mode)}, not a regular file", tail
        )
    return st.st_size


def _unpickle(folder: str, data: bytes, tail: str) -> Metadata:
    try:
        with gc_paused():  # (millions of small objects: collections would only rescan them)
            metadata = safe_metadata.loads(data, folder)
    except safe_metadata.UntrustedCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001  (any damage: EOF, a bad opcode, a wrong arity)
        first = (str(e).strip().splitlines() or [""])[0][:120]
        raise _problem(
            folder,
            f"is damaged: its {METADATA} ({len(data)} bytes) is not DCP metadata "
            f"({type(e).__name__}{': ' + first if first else ''})",
            tail,
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise _problem(
            folder,
            f"is damaged: its {METADATA} holds a {type(metadata).__name__}, not DCP Metadata",
            tail,
        )
    if not isinstance(getattr(metadata, "storage_data", None), dict):
        raise _problem(folder, f"is damaged: its {METADATA} records no storage", tail)
    return metadata


def _check_files(folder: str, seal: Seal, tail: str) -> dict[str, int]:
    """The manifest's step is the folder's; every file it lists is a regular file
    inside the folder, of the size it records."""
    named = _step_of_name(os.path.basename(os.path.normpath(folder)))
    # a manifest with no step (a save outside a step-N folder) names no step-N either:
    # a null step must not let a step pass under any name
    if named is not None and named != seal.step:
        written = (
            "no step (saved outside a step-N folder)"
            if seal.step is None
            else (f"step {seal.step}")
        )
        raise _problem(
            folder,
            f"is corrupted: its {NAME} was written for {written}, the folder is step "
            f"{named} (a step copied or linked under another step's name)",
            tail,
        )
    sizes = {}
    for name, entry in seal.files.items():
        size = member_size(folder, name, tail)
        if size != entry.bytes:
            raise _problem(
                folder,
                f"is corrupted: {name} holds {size} bytes where its save wrote {entry.bytes}",
                tail,
            )
        sizes[name] = size
    return sizes


def _check_metadata(folder: str, seal: Seal, tail: str) -> Metadata:
    """``.metadata``'s bytes against the manifest, then unpickled, then its items
    against the manifest's."""
    entry = seal.files.get(METADATA)
    data = read_regular(folder, METADATA, tail)
    if entry is None or entry.digests is None or data is None:
        raise _problem(folder, f"is corrupted: its {NAME} does not cover {METADATA}", tail)
    found = segment_digests(data, seal.block)
    if found != entry.digests:
        shown = found.hex()[:64] or "(empty)"
        raise _problem(
            folder,
            f"is corrupted: {METADATA}: xxh3_64 {shown} ({len(data)} bytes) where "
            f"its {NAME} records {entry.digests.hex()[:64]} ({entry.bytes} bytes); not "
            "unpickled",
            tail,
        )
    metadata = _unpickle(folder, data, tail)
    storage = metadata.storage_data
    if len(storage) != len(seal.items):
        raise _problem(
            folder,
            f"is corrupted: {METADATA} lists {len(storage)} items, its {NAME} {len(seal.items)}",
            tail,
        )
    items = seal.items
    for index, info in storage.items():
        offset = getattr(index, "offset", None)  # (``key``, inline: once per item)
        item = items.get((index.fqn, None if offset is None else tuple(offset)))
        where = (info.relative_path, info.offset, info.length)
        if item is None or item[2:5] != where:  # (file, offset, length)
            listed = (
                "does not list it"
                if item is None
                else f"at {(item.file, item.offset, item.length)}"
            )
            raise _problem(
                folder,
                f"is corrupted: {METADATA} puts item {index.fqn} at {where}, its {NAME} {listed}",
                tail,
            )
        if info.transform_descriptors:
            raise _problem(
                folder, f"is corrupted: {METADATA} declares transforms on {index.fqn}", tail
            )
    save_id = getattr(metadata.storage_meta, "save_id", None)
    if seal.save_id is not None and save_id != seal.save_id:
        raise _problem(
            folder,
            f"is corrupted: {METADATA} is of save {save_id}, its {NAME} of save {seal.save_id}",
            tail,
        )
    return metadata


def _check_items_within(
    folder: str, metadata: Metadata, tail: str, sizes: dict[str, int]
) -> dict[str, int]:
    """Every file ``.metadata`` names checked (``member_size``, once: ``sizes`` holds
    those checked already) and every item within its file."""
    for index, info in metadata.storage_data.items():
        relative = getattr(info, "relative_path", None)
        if relative not in sizes:
            sizes[relative] = member_size(folder, relative, tail)
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (offset, length))
        if not ok or offset < 0 or length < 0 or offset + length > sizes[relative]:
            raise _problem(
                folder,
                f"is damaged: its {METADATA} puts item {getattr(index, 'fqn', index)} at bytes "
                f"{offset!r}..+{length!r} of {relative}, which holds {sizes[relative]} bytes",
                tail,
            )
    return sizes


def _signature(path: str):
    st = _lstat(path)
    return None if st is None else (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode)


# the step last opened, while its files stay the same: a resume opens its step several
# times (rank 0's choice, DCP's read_metadata, the data position, the run id), and
# ``release`` forgets it once the load is done (a step's parse is as large as its items)
_parsed: dict[tuple, tuple[str, Seal | None, Metadata | None]] = {}


def release() -> None:
    """Keeps nothing parsed: called when a load finishes (``CheckpointManager.load``)."""
    _parsed.clear()


def _parse(folder: str, tail: str) -> tuple[str, Seal | None, Metadata | None, str]:
    """(trust, seal, metadata, format) of ``folder``, parsed once while its files stay
    (and until ``release``)."""
    cache_key = (
        os.path.realpath(folder),
        *(_signature(os.path.join(folder, n)) for n in (NAME, METADATA, METADATA + ".xxh3")),
    )
    if cache_key in _parsed:
        trust, seal, metadata = _parsed[cache_key]
        return trust, seal, metadata, "hf" if metadata is None else "dcp"
    raw = read_regular(folder, NAME, tail)
    if raw is not None:
        seal = decode(raw, folder, tail)
        trust, metadata = SEALED, None
        if seal.kind == "dcp":
            metadata = _check_metadata(folder, seal, tail)
    else:
        seal = None
        data = read_regular(folder, METADATA, tail)
        if data is None:
            if os.path.isfile(os.path.join(folder, HF_INDEX)):
                return UNVERIFIED, None, None, "hf"
            raise _problem(folder, f"is incomplete: it has no {METADATA}", tail)
        record = read_regular(folder, METADATA + legacy.SIDECAR_SUFFIX, tail)
        if record is not None:
            legacy.check_sidecar(folder, METADATA, data, record, tail)
        metadata = _unpickle(folder, data, tail)
        if record is not None:
            legacy.consistency(folder, metadata.storage_data, tail)
            trust = TRAILERS
        else:
            trust = UNVERIFIED
            if SEAL in (getattr(metadata.storage_meta, "modules", None) or ()):
                raise _problem(
                    folder,
                    f"is incomplete: its {METADATA} says its save sealed it, but its {NAME} "
                    "is missing",
                    tail,
                )
            if any(
                legacy.DESCRIPTOR in (s.transform_descriptors or ())
                for s in metadata.storage_data.values()
            ):
                raise _problem(
                    folder,
                    f"is corrupted: its items carry checksums but {METADATA}"
                    f"{legacy.SIDECAR_SUFFIX} (the checksum of {METADATA}) is missing",
                    tail,
                )
    _parsed.clear()
    _parsed[cache_key] = (trust, seal, metadata)
    return trust, seal, metadata, "hf" if metadata is None else "dcp"


def open_step(folder: str | os.PathLike, tail: str = NOT_LOADED, allow_link: bool = True) -> Step:
    """The step folder ``folder``, checked as the module says (one ChecksumMismatch
    line otherwise; an allowlist refusal stays ``UntrustedCheckpointError``).
    ``allow_link``: a folder that is a symbolic link is read through it (a checkpoint
    the user named, ``verify``; its manifest's step is still checked against the
    link's name); the dump folder's steps are chosen without (``resume``)."""
    folder = os.fspath(folder)
    check_folder(folder, tail, allow_link)
    trust, seal, metadata, fmt = _parse(folder, tail)
    if seal is not None:
        # every file checked once; a sealed step's items already lie where the manifest
        # says (``_check_metadata``), within the sizes it records (``decode``), which are
        # the files' (``_check_files``)
        sizes = _check_files(folder, seal, tail)
    else:
        sizes = {} if metadata is None else _check_items_within(folder, metadata, tail, {})
    return Step(folder, fmt, trust, metadata, seal, sizes)


def states_held(folder: str | os.PathLike) -> set[str]:
    return open_step(folder, "").training_states
