"""A DCP checkpoint is never silently wrong: every byte a save writes is checksummed,
every load verifies what it reads before the state is used.

:func:`install` (idempotent; the entry points that save or load checkpoints call it,
next to ``safe_metadata.install()``) makes every DCP save and load of the process do this:

- **items** (each tensor chunk and each pickled item DCP writes into a ``__R_F.distcp``
  file): :class:`Xxh3Trailer`, a DCP ``StreamTransformExtension``, hashes the item's
  bytes as they stream to the file, one xxh3_64 digest per MiB, and appends the digests
  and a 20-byte footer (length, block size, magic). ``FileSystemWriter`` uses it unless
  the caller passes its own ``_extensions`` (torchtitan's ``dcp.save(state,
  checkpoint_id=...)`` and ``dcp.async_save`` pass none); ``.metadata`` records it per
  item (``transform_descriptors = ["boost_titan.xxh3/1"]``; ``length`` includes the
  trailer). On load, ``torch.load`` reads each item through the extension's reader,
  which checks every MiB block against its digest as it is read and before the read
  returns (whole blocks straight into torch's buffer, then hashed; the blocks torch
  reads in pieces, the archive's head and tail, read whole once and served from
  memory): no second pass, no extra copy. On every rank, for every layout, resharded
  loads included (a rank reads the whole stored chunks its shards overlap).
- **.metadata**: a sidecar ``.metadata.xxh3`` (JSON: algorithm, digest, bytes) is
  written, atomically, before ``.metadata`` is renamed into place; a load checks it
  before ``.metadata`` is unpickled (in ``safe_metadata``'s allowlisted reader).

A mismatch is one line (:class:`ChecksumMismatch`) naming the step folder, the file,
the item (FQN, chunk offset), the bytes and the expected and found digests;
:func:`mismatch_in` finds it inside DCP's per-rank ``CheckpointException`` (every rank
gets every rank's failure). :func:`load_past_corruption` makes the trainer set a
corrupted newest step aside (``step_N.corrupt``) and resume from the one before;
:func:`check` / ``boost-titan checkpoint verify PATH`` verify a checkpoint
without loading it.

A checkpoint without any checksum (written before boost_titan checksummed checkpoints,
or by a writer given ``_extensions=()``) loads with one warning that it is unverified.
Half and half (a sidecar but items without checksums, or the reverse) is refused: that
is not something any save writes.

DCP's process-based async save (``async_mode = "async_with_pinned_mem"``) writes in a
spawned process: the writer it pickles there carries the extension, whose unpickling
installs the save side (:func:`install_saving`). Not covered: torchtitan's HF
safetensors checkpoints (``last_save_in_hf``; their own writer, no ``.metadata``: a
trailer does not belong in files other tools read). Cost:
``benchmarks/checkpoint_integrity.py``.

Checkpoints written with checksums need this module to load: plain DCP does not know
the ``boost_titan.xxh3`` extension (``ValueError: Unknown extension``); call
``boost_titan.checkpoint.integrity.install()`` first."""

from boost_titan.checkpoint.integrity.dcp_hooks import (  # noqa: F401  (the API, by job)
    Xxh3Trailer,
    install,
    install_saving,
    installed,
)
from boost_titan.checkpoint.integrity.resume import load_past_corruption  # noqa: F401
from boost_titan.checkpoint.integrity.trailer import (  # noqa: F401
    ALGORITHM,
    BLOCK,
    DESCRIPTOR,
    SIDECAR_SUFFIX,
    ChecksumMismatch,
    _VerifyingReader,
    mismatch_in,
)
from boost_titan.checkpoint.integrity.verify import (  # noqa: F401
    Verification,
    check,
    main,
    newest_verified,
    step_folders,
    verify,
)
