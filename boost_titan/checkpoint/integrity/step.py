"""Opening a step folder: everything checked that can be checked before an item is
read, and ``.metadata`` unpickled only once its bytes are verified.

:func:`open_step` is the one reader of a step's ``.metadata`` and manifest: the launch
pre-check (``checkpoint.folder.states_held``), the data position check
(``checkpoint.data_position.saved_layout``), every DCP load (``safe_metadata``'s
``read_metadata`` hook, installed by ``integrity.install``), ``verify`` and export all
go through it, and a rank parses a step once per load (the last step opened is kept,
while its files' identity and size stay the same, until ``release`` at the end of the
load). In order:

1. the folder is a real folder (a symbolic link in the dump folder is refused: it would
   load as a step it is not, and the next save of that step would write through it; a
   checkpoint the user names may be a link, read through);
2. ``.manifest.json`` (:mod:`.manifest`), when there is one: a regular file, its
   header, then its root (``boost_titan.seal/2``; a seal/1 manifest: its whole body)
   checked against the header's digest, then parsed (JSON); the step it names is the
   folder's N; ``.metadata``'s bytes match their digests; only then is ``.metadata``
   unpickled (allowlisted, ``safe_metadata``), and it must list as many items as the
   manifest and the same save id;
3. without a manifest: a ``.metadata.xxh3`` sidecar (trailers, :mod:`.legacy`) is
   checked before ``.metadata`` is unpickled; with neither, ``.metadata`` is unpickled
   unverified (allowlisted) and refused if it says its step was sealed, and each file
   ``.metadata`` names is checked as in 4, every item within its file.
4. each file a load reads, before it is opened (:meth:`Step.reading`: a rank checks the
   files it reads, not the world's): a relative path inside the folder (no absolute
   path, no ``..``, no link out of it) to a regular file (no FIFO, no device: a read
   never blocks) of the size the manifest records; in a seal/2 step the file's section
   of the manifest is then read, checked against the root's digest and parsed, and each
   item a load reads must lie where the manifest puts it (:meth:`Step.entry`).

A seal/1 step (one body: every item parsed at once), a Hugging Face folder and
``whole`` (``verify``) check every file and match every item at the open.

Each problem is one :class:`ChecksumMismatch` line."""

from __future__ import annotations

import dataclasses
import os

from torch.distributed.checkpoint.metadata import Metadata

from boost_titan.checkpoint import safe_metadata
from boost_titan.checkpoint.integrity import legacy
from boost_titan.checkpoint.integrity.blocks import (
    NOT_LOADED,
    digest,
    segment_blocks,
    segment_digests,
)
from boost_titan.checkpoint.integrity.manifest import (
    METADATA,
    NAME,
    SEALS,
    Seal,
    gc_paused,
    key,
    load_all,
    load_section,
    mismatch,
)
from boost_titan.checkpoint.integrity.manifest import step_of as _step_of_name
from boost_titan.checkpoint.integrity.step_files import (  # noqa: F401  (read_regular: the API)
    _lstat,
    _open_regular,
    _problem,
    check_folder,
    member_size,
    present,
    read_manifest,
    read_regular,
)

HF_INDEX = "model.safetensors.index.json"
SEALED, TRAILERS, UNVERIFIED = "sealed", "trailers", "unverified"


@dataclasses.dataclass
class Step:
    folder: str
    format: str  # "dcp" | "hf"
    trust: str  # SEALED | TRAILERS | UNVERIFIED
    metadata: Metadata | None  # None: a Hugging Face folder
    seal: Seal | None
    sizes: dict[str, int]  # the size of every data file checked so far
    tail: str = NOT_LOADED

    @property
    def training_states(self) -> set[str]:
        """Top-level keys of what the step holds (``optimizer``, ``train_state``...)."""
        if self.metadata is None:
            return set()
        return {k.split(".", 1)[0] for k in self.metadata.state_dict_metadata}

    def reading(self, relative: str) -> None:
        """Before a load opens ``relative``: the file checked (``member_size``: a regular
        file inside the folder, of the size the manifest records) and, in a seal/2
        step, its section of the manifest read and checked; once per file."""
        if relative in self.sizes:
            return
        seal, folder, tail = self.seal, self.folder, self.tail
        if seal is None:
            self.sizes[relative] = member_size(folder, relative, tail)
            return
        entry = seal.files.get(relative) if isinstance(relative, str) else None
        if entry is None or entry.digests is not None:
            raise _problem(
                folder,
                f"is corrupted: its {METADATA} names the file {relative!r}, which its {NAME} "
                "lists as no data file",
                tail,
            )
        if seal.sections and relative in seal.sections and relative not in seal.loaded:
            load_section(seal, relative, mismatch(folder, tail))
        size = member_size(folder, relative, tail)
        if size != entry.bytes:
            raise _problem(
                folder,
                f"is corrupted: {relative} holds {size} bytes where its save wrote {entry.bytes}",
                tail,
            )
        self.sizes[relative] = size

    def entry(self, index, relative: str, offset: int, length: int, transforms=()):
        """The manifest's entry of the item ``index`` a load reads from ``relative`` at
        ``offset``, ``length`` (as ``.metadata`` says), refused unless the manifest puts
        it there too (its file's section read first: :meth:`reading`)."""
        self.reading(relative)
        item = self.seal.items.get(key(index))
        _placed(self.folder, index, (relative, offset, length), item, transforms, self.tail)
        return item


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


SIZES, PRESENT = "sizes", "present"  # how many of a step's files _check_files checks


def _check_files(folder: str, seal: Seal, tail: str, every: str | None = SIZES) -> dict[str, int]:
    """The manifest's step is the folder's; ``every`` = ``SIZES``: every file it lists
    is a regular file inside the folder, of the size it records (one lstat each);
    ``PRESENT``: every file it lists is there, a regular file (one listing of the
    folder, not a call per file: a start-up's check, whatever the world); None: each
    data file is checked when a load reads it (``Step.reading``), sizes then too."""
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
    if every == PRESENT:
        present(folder, seal.files, tail)
        return {}
    sizes = {}
    for name, entry in seal.files.items() if every == SIZES else ():
        size = member_size(folder, name, tail)
        if size != entry.bytes:
            raise _problem(
                folder,
                f"is corrupted: {name} holds {size} bytes where its save wrote {entry.bytes}",
                tail,
            )
        sizes[name] = size
    return sizes


def _metadata_bytes(folder: str, seal: Seal, tail: str) -> bytes:
    """``.metadata``'s bytes, checked against the manifest's digests (not unpickled)."""
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
    return data


def _metadata_streamed(folder: str, seal: Seal, tail: str) -> None:
    """``.metadata`` checked against the manifest's digests a block at a time, nothing
    kept (the launch check's: the file is ~130 bytes per item, 200 MB at 1.58M items);
    a mismatch is the load's line (:func:`_metadata_bytes`, which then reads it whole)."""
    entry = seal.files.get(METADATA)
    fd = _open_regular(folder, METADATA, tail)
    if entry is None or entry.digests is None or fd is None:
        if fd is not None:
            os.close(fd)
        _metadata_bytes(folder, seal, tail)  # (its line)
        return
    found = bytearray()
    with os.fdopen(fd, "rb") as f:
        same = os.fstat(f.fileno()).st_size == entry.bytes
        for _start, n in segment_blocks([entry.bytes], seal.block) if same else ():
            data = f.read(n)
            found += digest(data)
            if len(data) != n or found != entry.digests[: len(found)]:
                break
    if not same or bytes(found) != entry.digests:
        _metadata_bytes(folder, seal, tail)  # (its line)
        raise _problem(folder, f"is damaged: {METADATA} changed while it was read", tail)


def _check_metadata(folder: str, seal: Seal, tail: str) -> Metadata:
    """``.metadata``'s bytes against the manifest, then unpickled, then its items
    against the manifest's."""
    metadata = _unpickle(folder, _metadata_bytes(folder, seal, tail), tail)
    storage = metadata.storage_data
    if len(storage) != seal.count:
        raise _problem(
            folder,
            f"is corrupted: {METADATA} lists {len(storage)} items, its {NAME} {seal.count}",
            tail,
        )
    if seal.sections is None:  # every item at hand (seal/1): matched now
        _match_items(folder, seal, metadata, tail)
    save_id = getattr(metadata.storage_meta, "save_id", None)
    if seal.save_id is not None and save_id != seal.save_id:
        raise _problem(
            folder,
            f"is corrupted: {METADATA} is of save {save_id}, its {NAME} of save {seal.save_id}",
            tail,
        )
    return metadata


def _placed(folder: str, index, where: tuple, item, transforms, tail: str) -> None:
    """``.metadata``'s item ``index`` at ``where`` (file, offset, length) is the
    manifest's ``item`` (None: not listed), with no transform."""
    if item is None or item[2:5] != where:  # (file, offset, length)
        listed = (
            "does not list it" if item is None else f"at {(item.file, item.offset, item.length)}"
        )
        raise _problem(
            folder,
            f"is corrupted: {METADATA} puts item {index.fqn} at {where}, its {NAME} {listed}",
            tail,
        )
    if transforms:
        raise _problem(folder, f"is corrupted: {METADATA} declares transforms on {index.fqn}", tail)


def _match_items(folder: str, seal: Seal, metadata: Metadata, tail: str) -> None:
    """``.metadata`` lists exactly the manifest's items (all of them parsed), where it
    says they lie."""
    items = seal.items
    if len(items) != len(metadata.storage_data):
        raise _problem(
            folder,
            f"is corrupted: {METADATA} lists {len(metadata.storage_data)} items, its {NAME} "
            f"{len(items)}",
            tail,
        )
    for index, info in metadata.storage_data.items():
        offset = getattr(index, "offset", None)  # (``key``, inline: once per item)
        item = items.get((index.fqn, None if offset is None else tuple(offset)))
        where = (info.relative_path, info.offset, info.length)
        if item is None or item[2:5] != where or info.transform_descriptors:
            _placed(folder, index, where, item, info.transform_descriptors, tail)


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
    seal = read_manifest(folder, tail)
    if seal is not None:
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
            if set(SEALS) & set(getattr(metadata.storage_meta, "modules", None) or ()):
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


def open_step(
    folder: str | os.PathLike,
    tail: str = NOT_LOADED,
    allow_link: bool = True,
    whole: bool = False,
    files: bool = False,
) -> Step:
    """The step folder ``folder``, checked as the module says (one ChecksumMismatch
    line otherwise; an allowlist refusal stays ``UntrustedCheckpointError``).
    ``allow_link``: a folder that is a symbolic link is read through it (a checkpoint
    the user named, ``verify``; its manifest's step is still checked against the
    link's name); the dump folder's steps are chosen without (``resume``). ``whole``
    (``verify``): a seal/2 step's every section read and matched to ``.metadata``, and
    every file checked, as a seal/1 step always is; else a load checks each data file,
    and reads its section, when it reads it (``Step.reading``). ``files`` (rank 0's
    choice of the step a resume loads, the launch check): every file present, from one
    listing of the folder (sizes: as each is read), no section read."""
    folder = os.fspath(folder)
    check_folder(folder, tail, allow_link)
    trust, seal, metadata, fmt = _parse(folder, tail)
    if seal is not None:
        lazy = seal.sections is not None and seal.kind == "dcp"
        if whole and lazy and metadata is not None:
            load_all(seal, mismatch(folder, tail))
            _match_items(folder, seal, metadata, tail)
        # every file checked once (``whole``, seal/1, Hugging Face), or each as it is read;
        # a sealed step's items lie where the manifest says (``_check_metadata``, or
        # ``Step.entry`` as each is read), within the sizes it records, the files' sizes
        every = SIZES if whole or not lazy else PRESENT if files else None
        sizes = _check_files(folder, seal, tail, every)
    else:
        sizes = {} if metadata is None else _check_items_within(folder, metadata, tail, {})
    return Step(folder, fmt, trust, metadata, seal, sizes, tail)


def states_held(folder: str | os.PathLike, files: bool = False) -> set[str]:
    """The training states of the step ``folder`` (the launch check); ``files`` (the
    first rank, the pre-check): every file of it there (one listing of the folder) and
    ``.metadata``'s bytes checked against their digests a block at a time, nothing
    parsed or kept. A step whose manifest records them (``Seal.states``) is answered
    from its root, ``.metadata`` not unpickled (the load unpickles it, as plain DCP
    does: at 1,024 ranks 11 s and 3.5 GB a rank, held from launch to the load), and on
    the other ranks not read (their loads check it before they unpickle it: 200 MB a
    rank at 1,024 ranks)."""
    folder = os.fspath(folder)
    check_folder(folder, "", True)
    seal = read_manifest(folder, "")
    if seal is None or seal.kind != "dcp" or seal.states is None:
        return open_step(folder, "", files=files).training_states
    if files:  # (the first rank, the pre-check: the others' loads check .metadata)
        _check_files(folder, seal, "", PRESENT)
        _metadata_streamed(folder, seal, "")
    else:
        _check_files(folder, seal, "", None)
    return set(seal.states)
