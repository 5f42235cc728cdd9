"""Megatron-LM's indexed dataset format: one ``.bin`` of token ids and one ``.idx`` saying
where each sequence starts (``megatron/core/datasets/indexed_dataset.py``; NeMo and
GPT-NeoX write the same files), read and written here without Megatron.

``.idx`` layout (little-endian)::

    b"MMIDIDX\\x00\\x00"            9 bytes of magic
    version                       uint64, 1
    dtype code                    uint8 (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                                         6 float64, 7 float32, 8 uint16)
    sequence count  S             uint64
    document count  D             uint64 (document_indices' length: documents + 1)
    sequence_lengths              int32[S]   tokens per sequence
    sequence_pointers             int64[S]   byte offset of each sequence in .bin
    document_indices              int64[D]   first sequence of each document, then S

``data tokenize`` writes one document per sequence (so ``document_indices`` is
``0..S``), sequences back to back in ``.bin`` (pointers are the running sum of the
lengths times the item size), uint16 when the vocabulary fits, else int32: what
Megatron's own ``IndexedDatasetBuilder`` writes for that ``dtype``.

Every refusal is a :class:`~boost_titan.data.local_text.CorpusError`: one line naming
the file and what is wrong with it.
"""

from __future__ import annotations

import dataclasses
import os
import struct

import numpy as np

from boost_titan.data.files import open_regular
from boost_titan.data.local_text import CorpusError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
TOKEN_DTYPES = {1, 2, 3, 4, 5, 8}  # integer codes: token ids (floats are not tokens)
CODE = {np.dtype(v): k for k, v in DTYPES.items()}
_HEAD = struct.Struct("<9sQBQQ")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (Megatron's rule: vocabulary < 65500), else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


@dataclasses.dataclass(frozen=True)
class Index:
    """An ``.idx`` file's header, and its arrays memory-mapped (nothing read up front)."""

    path: str
    dtype: np.dtype
    sequences: int
    documents: int  # document_indices' length (documents + 1)
    _offset: int  # of sequence_lengths in the file

    def _array(self, dtype, count: int, offset: int) -> np.ndarray:
        if not count:
            return np.zeros(0, dtype)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=(count,))

    @property
    def lengths(self) -> np.ndarray:
        return self._array(np.int32, self.sequences, self._offset)

    @property
    def pointers(self) -> np.ndarray:
        return self._array(np.int64, self.sequences, self._offset + 4 * self.sequences)

    @property
    def document_indices(self) -> np.ndarray:
        return self._array(np.int64, self.documents, self._offset + 12 * self.sequences)


def read_index(path: str) -> Index:
    """The header of an ``.idx``, checked against the file's size (a truncated index or
    another format is one line)."""
    fd = open_regular(path, "Megatron index ")  # a FIFO: one line, not a blocked open
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, _HEAD.size, 0)
    except OSError as e:
        raise CorpusError(f"cannot read Megatron index {path}: {e.strerror}") from None
    finally:
        os.close(fd)
    if len(head) < _HEAD.size or not head.startswith(MAGIC):
        raise CorpusError(
            f"{path} is not a Megatron .idx file (it does not start with {MAGIC!r}; {size} bytes)"
        )
    _, version, code, sequences, documents = _HEAD.unpack(head)
    if version != VERSION:
        raise CorpusError(
            f"{path} is a Megatron index of version {version}; this reader reads version "
            f"{VERSION} (Megatron-LM, NeMo and GPT-NeoX write version {VERSION})"
        )
    if code not in TOKEN_DTYPES:
        what = DTYPES[code].__name__ if code in DTYPES else f"unknown code {code}"
        raise CorpusError(
            f"{path}: token dtype {what} is not an integer type Megatron writes token ids "
            f"in (codes {sorted(TOKEN_DTYPES)})"
        )
    expected = _HEAD.size + 12 * sequences + 8 * documents
    if size != expected:
        raise CorpusError(
            f"{path} is {size} bytes; its header ({sequences} sequences, {documents} "
            f"document indices) makes it {expected}: the file is truncated or damaged"
        )
    return Index(path, np.dtype(DTYPES[code]), sequences, documents, _HEAD.size)


def contiguous_tokens(index: Index, bin_path: str, size: int) -> int:
    """The token count of a ``.bin`` whose sequences lie back to back from byte 0 (the
    only layout the window reader reads: a window is a byte range), checked against
    the index and the file's ``size``; else one line saying which."""
    lengths = index.lengths.astype(np.int64)
    item = index.dtype.itemsize
    tokens = int(lengths.sum())
    if index.sequences:
        expected = np.zeros(index.sequences, np.int64)
        np.cumsum(lengths[:-1] * item, out=expected[1:])
        bad = np.flatnonzero(np.asarray(index.pointers) != expected)
        if bad.size:
            i = int(bad[0])
            raise CorpusError(
                f"{index.path}: sequence {i} starts at byte {int(index.pointers[i])} of the "
                f".bin, not right after the one before ({int(expected[i])}): the windows of "
                "the token stream must be byte ranges of the .bin; rewrite it with "
                "`boost-titan data tokenize`"
            )
    if size != tokens * item:
        raise CorpusError(
            f"{bin_path} is {size} bytes; its index says {tokens} tokens of "
            f"{index.dtype.name} ({tokens * item} bytes): the .bin is truncated or not "
            "this index's"
        )
    return tokens


class IndexWriter:
    """Appends documents (one sequence each) to a ``.bin``; :meth:`finish` writes the
    ``.idx``. Both go to the paths given: the caller writes temporary names and renames."""

    def __init__(self, bin_path: str, dtype: np.dtype):
        self.dtype = np.dtype(dtype)
        self.bin_path = bin_path
        self._bin = open(bin_path, "wb")
        self.lengths: list[int] = []
        self.tokens = 0

    def add(self, tokens: np.ndarray) -> bytes:
        """Append one document; returns its bytes as written (for the caller's digest)."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        self._bin.write(data)
        self.lengths.append(len(tokens))
        self.tokens += len(tokens)
        return data

    def finish(self, idx_path: str) -> None:
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        write_index(idx_path, np.asarray(self.lengths, np.int64), self.dtype)


def write_index(path: str, lengths: np.ndarray, dtype: np.dtype) -> None:
    """The ``.idx`` of back-to-back sequences of ``lengths`` tokens, one document each."""
    n = len(lengths)
    if n and int(lengths.max()) > np.iinfo(np.int32).max:
        raise CorpusError(
            f"{path}: a document of {int(lengths.max())} tokens (the format's limit is 2^31 - 1)"
        )
    pointers = np.zeros(n, np.int64)
    if n:
        np.cumsum(lengths[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    with open(path, "wb") as f:
        f.write(_HEAD.pack(MAGIC, VERSION, CODE[np.dtype(dtype)], n, n + 1))
        f.write(np.asarray(lengths, np.int32).tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype=np.int64).tobytes())
        f.flush()
        os.fsync(f.fileno())
