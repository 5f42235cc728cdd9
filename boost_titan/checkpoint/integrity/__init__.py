"""A checkpoint step is one sealed object: every byte bound to its step, checked before
it is used, and the files stay plain DCP that stock PyTorch reads.

:func:`install` (idempotent; the entry points that save or load checkpoints call it,
next to ``safe_metadata.install()``) makes every DCP save and load of the process do this:

- **save**: each item (tensor chunk or pickled value) is digested as it streams to its
  ``__R_F.distcp`` file, one xxh3_64 per MiB (``blocks``: hashed beside the write, by a
  helper thread); each rank encodes its own files' sections of the manifest (every
  item's FQN, chunk, file, offset, length and digests) and their digests once its
  writes are done, and they travel with DCP's write results to the coordinator, which
  joins the ranks' bytes under a small root (save id, step N, every file's size, the
  digests of ``.metadata`` and of each section) into the step's manifest
  ``.manifest.json`` (``manifest``) atomically, then ``.metadata``, whose presence marks the step
  complete. ``.metadata`` is what torch writes (one string added to
  ``storage_meta.modules``): no transform, no trailer.
- **load**: every reader of a step opens it through :func:`~.step.open_step` first: the
  folder is no link, the manifest's root verifies and names the folder's step,
  ``.metadata``'s bytes match before it is unpickled (allowlisted); then, for each file
  a rank's load reads (only those), the file is a regular file inside the folder of its
  recorded size and its section of the manifest verifies, each item it reads lies where
  the manifest says, and DCP reads
  each item through a reader that checks every MiB against the manifest as it reads it,
  before the read returns, on every rank, in every layout, resharding included
  (``in_place``: a tensor's bytes go straight from the file into the tensor it loads
  into, each MiB hashed in the page cache just before it is copied).
- **a damaged step** is one line (:class:`ChecksumMismatch`) naming the folder, the file
  and what differs: a flipped bit, a file from another step or run, two items swapped,
  a missing or cut file, a path outside the folder, a FIFO, a bad manifest or
  ``.metadata``, a step saved under another step's name. Resuming from the dump folder,
  rank 0 sets such a step aside (``step_N.corrupt``) and every rank loads the newest one
  that opens (``resume.load_past_corruption``); a checkpoint the user named fails on the
  line. ``verify`` (:func:`check`, ``boost-titan checkpoint verify PATH``) checks a step
  without loading it.

Older steps: a step with the per-item trailers boost_titan wrote before (``legacy``:
``boost_titan.xxh3/1`` and a ``.metadata.xxh3`` sidecar) loads with each item checked
against its own trailer and a warning that nothing binds it to its step; a step with
no checksum at all (torchtitan's own, or another writer's) loads with one warning that
it is unverified. A step whose ``.metadata`` says it was sealed but whose manifest is
gone is damaged. Cost: ``benchmarks/checkpoint_integrity.py``; what is and is not
checked: docs/checkpoints.md.

DCP's process-based async save (``async_mode = "async_with_pinned_mem"``) writes in a
spawned process: every writer carries an object whose unpickling installs the save
side there (:func:`install_saving`). Hugging Face folders written by
``last_save_in_hf`` are sealed by ``checkpoint.hf.adapters.finish_hf_save``
(:func:`seal_folder`: every file's digests)."""

from boost_titan.checkpoint.integrity.blocks import (  # noqa: F401  (the API, by job)
    ALGORITHM,
    BLOCK,
    ChecksumMismatch,
    VerifyingReader,
    mismatch_in,
)
from boost_titan.checkpoint.integrity.dcp_hooks import (  # noqa: F401
    install,
    install_saving,
    installed,
    unverified_line,
)
from boost_titan.checkpoint.integrity.folder_seal import seal_folder  # noqa: F401
from boost_titan.checkpoint.integrity.manifest import NAME as MANIFEST  # noqa: F401
from boost_titan.checkpoint.integrity.resume import load_past_corruption  # noqa: F401
from boost_titan.checkpoint.integrity.step import open_step, release, states_held  # noqa: F401
from boost_titan.checkpoint.integrity.verify import (  # noqa: F401
    Verification,
    check,
    main,
    newest_verified,
    step_folders,
    verify,
)
