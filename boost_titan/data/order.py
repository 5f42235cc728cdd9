"""The global order of the training data: one sequence of packed windows, the same at every
data-parallel degree, and its position (no processes, no torch: plain arithmetic).

**The stream.** Documents are read in corpus order (a saved dataset by index; files in
path order, documents in file order), pass after pass; each is tokenized as BOS + its
tokens + EOS and the tokens of all of them are concatenated and cut into consecutive
windows of ``seq_len + 1`` tokens (a window's first ``seq_len`` tokens are the input, its
last ``seq_len`` the labels). That is how torchtitan's ``HuggingFaceTextDataset`` packs a
corpus on one data-parallel rank without DataLoader workers, so the window sequence at
dp 1 is the one boost_titan trained on before this order existed.

**Who trains on what.** A run that starts at window ``W0`` (0, or the position it resumed
from) takes global batch ``g`` = windows ``[W0 + g B, W0 + (g + 1) B)`` with ``B =
local_batch_size x dp``; data-parallel rank ``r`` trains on the contiguous slice ``[r L,
(r + 1) L)`` of each (:func:`rank_slice`, ``L = local_batch_size``). Gradient accumulation
takes one global batch per micro-batch, so a step of ``global_batch_size`` windows trains
on the same windows at every dp degree that keeps ``global_batch_size``.

**The position** (:class:`Position`) after ``windows`` windows is where the token stream
stands, identical on every rank and in every run at that window: the cursor right after
the last document whose tokens are all in windows (``epoch``, ``file``, ``doc``: the raw
document index in its file, counting held-out documents; a saved dataset uses file 0 and
its document index) and the ``offset`` tokens of the next document already cut. Resuming
reads on from the cursor, drops ``offset`` tokens and cuts windows as before, under any
dp degree, local batch size or number of DataLoader workers. (``pending``: tokens that
come before the cursor's next document; only a position converted from a checkpoint of
the per-rank loaders has them, see :func:`legacy_position`.)

**DataLoader workers** only tokenize: the documents are grouped in chunks of
:data:`CHUNK_DOCS`, worker ``w`` of ``W`` tokenizes chunks ``w, w + W, ...`` and the
rank's main process takes them in chunk order (the DataLoader's round-robin) and packs,
so the windows do not depend on ``W`` (:func:`chunk_worker`).
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

CHUNK_DOCS = 32  # documents a DataLoader worker tokenizes at a time (the order ignores it)
VERSION = 1  # of the saved position's layout
Cursor = tuple[int, int, int]  # (epoch, file, doc): right after a document


class PositionError(ValueError):
    """A saved position that is not one this module writes (one line)."""


@dataclasses.dataclass(frozen=True)
class Position:
    windows: int = 0  # windows cut since the stream began (every rank's, every pass)
    epoch: int = 0  # passes over the corpus completed before the cursor's
    file: int = 0
    doc: int = 0  # raw index in the file of the first document not entirely in windows
    offset: int = 0  # its tokens already in windows
    pending: tuple[int, ...] = ()  # tokens before that document (converted positions only)

    @property
    def cursor(self) -> Cursor:
        return (self.epoch, self.file, self.doc)

    def describe(self) -> str:
        where = f"window {self.windows} (pass {self.epoch}, file {self.file} document {self.doc}"
        if self.offset:
            where += f", {self.offset} tokens into it"
        if self.pending:
            where += f", after {len(self.pending)} buffered tokens"
        return where + ")"

    def to_state(self) -> dict[str, Any]:
        """Plain data (ints and a list: what a checkpoint's no-global reader accepts)."""
        state = {k: getattr(self, k) for k in ("windows", "epoch", "file", "doc", "offset")}
        return {"version": VERSION, **state, "pending": list(self.pending)}

    @classmethod
    def from_state(cls, state: Any, where: str) -> Position:
        fields = ("windows", "epoch", "file", "doc", "offset")
        ok = (
            isinstance(state, dict)
            and state.get("version") == VERSION
            and all(type(state.get(k)) is int and state[k] >= 0 for k in fields)
            and isinstance(state.get("pending"), list)
            and all(type(t) is int for t in state["pending"])
        )
        if not ok:
            raise PositionError(
                f"{where}: the saved data position is not one this boost_titan writes "
                f"(version {VERSION}: non-negative ints {', '.join(fields)} and a token list "
                f"'pending'); got {_short(state)}"
            )
        return cls(**{k: state[k] for k in fields}, pending=tuple(state["pending"]))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def rank_slice(dp_rank: int, local_batch: int) -> tuple[int, int]:
    """``[start, end)`` of the windows of a global batch that ``dp_rank`` trains on."""
    return dp_rank * local_batch, (dp_rank + 1) * local_batch


def rank_windows(start: int, batch: int, dp_rank: int, local_batch: int, dp: int) -> range:
    """The global window indices of local batch ``batch`` (0, 1, ... from the run's start
    at window ``start``) of ``dp_rank`` out of ``dp``."""
    lo, hi = rank_slice(dp_rank, local_batch)
    first = start + batch * local_batch * dp
    return range(first + lo, first + hi)


def chunk_worker(chunk: int, num_workers: int) -> int:
    """The DataLoader worker that tokenizes ``chunk`` (0 with no workers): the one the
    DataLoader's round-robin takes the chunk's turn from."""
    return chunk % num_workers if num_workers else 0


class Packer:
    """torchtitan's packing of one token stream into windows, with the position kept.

    ``add(after, tokens)`` appends a document's tokens (``after``: the cursor right after
    it); ``cut(keep)`` cuts the next window, returning its pieces (slices of the
    documents' token sequences, to concatenate) when ``keep`` and only advancing when
    not; :meth:`position` is the :class:`Position` after the last window cut. Token
    sequences are anything that slices (lists here, tensors in the loader)."""

    def __init__(self, start: Position, window: int):
        if window < 2:
            raise ValueError(f"a window holds seq_len + 1 >= 2 tokens, not {window}")
        self.window = window
        self.windows = start.windows
        self.cursor: Cursor = start.cursor
        self._drop = start.offset  # tokens of the first document added already cut
        self._segments: deque[list] = deque()  # [after (None: pending), tokens, start]
        self.available = 0
        if start.pending:
            self._segments.append([None, list(start.pending), 0])
            self.available = len(start.pending)

    def add(self, after: Cursor, tokens: Sequence[int]) -> None:
        start = 0
        if self._drop:
            if self._drop >= len(tokens):
                raise PositionError(
                    f"the saved data position is {self._drop} tokens into a document of "
                    f"{len(tokens)} tokens: the corpus or the tokenizer changed since the "
                    "checkpoint was saved"
                )
            start, self._drop = self._drop, 0
        self._segments.append([tuple(after), tokens, start])
        self.available += len(tokens) - start
        self._pop_finished()

    def _pop_finished(self) -> None:
        while self._segments and self._segments[0][2] >= len(self._segments[0][1]):
            after = self._segments.popleft()[0]
            if after is not None:
                self.cursor = after

    def cut(self, keep: bool) -> list | None:
        if self.available < self.window:
            raise ValueError(f"{self.available} tokens buffered, a window needs {self.window}")
        need, pieces = self.window, []
        while need:
            segment = self._segments[0]
            tokens, start = segment[1], segment[2]
            take = min(need, len(tokens) - start)
            if keep and take:
                pieces.append(tokens[start : start + take])
            segment[2] = start + take
            need -= take
            self._pop_finished()
        self.available -= self.window
        self.windows += 1
        return pieces if keep else None

    def position(self) -> Position:
        epoch, file, doc = self.cursor
        offset, pending = self._drop, ()
        if self._segments:
            after, tokens, start = self._segments[0]
            if after is None:
                pending = tuple(tokens[start:])
            else:
                offset = start
        return Position(self.windows, epoch, file, doc, offset, pending)


# ---------------------------------------------------------------------------------------
# Checkpoints of the per-rank loaders (before this order): one data-parallel rank only


def raw_index_after(kept: int, every: int, held: bool) -> int:
    """The raw document index in a file right after its ``kept``-th document read
    (``kept`` >= 1) under ``dataset_holdout_every = every`` (``held``: the held-out ones,
    raw indices every - 1, 2 every - 1, ...; else the others)."""
    if not every:
        return kept
    if held:
        return kept * every
    full, rest = divmod(kept, every - 1)
    return full * every + rest if rest else full * every - 1


def legacy_position(dataset_state: dict[str, Any], every: int, held: bool) -> Position:
    """The position of a one-rank, no-worker checkpoint of torchtitan's text dataset
    (map-style ``sample_idx``, or a streamed ``datasets`` state over one shard per file,
    saved in its first pass) and its ``token_buffer``: the same stream, as a cursor and
    the buffered tokens."""
    buffer = tuple(dataset_state["token_buffer"])
    if "sample_idx" in dataset_state:  # map-style: the pass is not recorded
        return Position(0, 0, 0, int(dataset_state["sample_idx"]), 0, buffer)
    data = dataset_state["data"]
    if int(data["epoch"]):
        raise PositionError(
            f"it was saved after {int(data['epoch'])} passes over a streamed corpus, and "
            "datasets shuffles the files of every pass after the first, the global order "
            "reads them in path order"
        )
    shard = data["examples_iterable"]
    kept = int(shard["shard_example_idx"])
    doc = raw_index_after(kept, every, held) if kept else 0
    return Position(0, 0, int(shard["shard_idx"]), doc, 0, buffer)
