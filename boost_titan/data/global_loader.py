"""The training data loader: the global order of ``boost_titan.data.order``, resumable at
any data-parallel degree.

Every data-parallel rank reads the whole corpus in order (``boost_titan.data.sources``),
tokenizes it, packs the same windows and keeps its slice of each global batch; the
position it saves is the stream's, the same on every rank, in one checkpoint item
(``dataloader.position``; ``boost_titan.checkpoint.data_position``), so a checkpoint
resumes exactly under any dp degree, local batch size (the run's ``global_batch_size``
kept by gradient accumulation), TP/PP layout or number of DataLoader workers.

The cost: each rank tokenizes the whole stream, dp times what it trains on. With
``[training.dataloader] num_workers = W`` the workers tokenize chunks of documents in
turn (``order.chunk_worker``) and the rank's main process packs, so a rank tokenizes at
W times one core's rate; with no workers the training process does it between steps.

``BOOST_TITAN_DUMP_BATCHES=FOLDER`` (tests): each process appends every batch it yields
to ``FOLDER/rank{RANK}.jsonl`` (its data-parallel rank, the global window indices and
their token ids); read once when iteration starts, nothing is done without it.
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from boost_titan.checkpoint.data_position import POSITION_ITEM, DataResumeError
from boost_titan.data import fingerprint
from boost_titan.data.local_text import CorpusError
from boost_titan.data.order import (
    CHUNK_DOCS,
    Packer,
    Position,
    PositionError,
    chunk_worker,
    legacy_position,
    rank_slice,
    rank_windows,
)
from boost_titan.data.sources import FileSource, chunks

DUMP_ENV = "BOOST_TITAN_DUMP_BATCHES"


class TokenChunks(IterableDataset):
    """The stream's documents from a cursor, tokenized a chunk at a time: in a DataLoader
    worker only the chunks that worker's turn takes, in the main process all of them.
    A corpus error is passed on as its line (a worker's exception would reach the run
    wrapped in a traceback)."""

    def __init__(self, source, tokenizer, cursor, infinite: bool):
        self.source, self.tokenizer, self.cursor, self.infinite = source, tokenizer, cursor, infinite

    def __iter__(self):
        info = get_worker_info()
        me, workers = (info.id, info.num_workers) if info else (0, 0)
        mine = lambda c: chunk_worker(c, workers) == me  # noqa: E731
        encode = self.tokenizer.encode
        try:
            for afters, texts in chunks(self.source, self.cursor, CHUNK_DOCS, self.infinite, mine):
                if texts is None:
                    continue
                tokens = [encode(t, add_bos=True, add_eos=True) for t in texts]
                yield {
                    "after": torch.tensor(afters, dtype=torch.long),
                    "lengths": torch.tensor([len(t) for t in tokens], dtype=torch.long),
                    "tokens": torch.tensor(list(itertools.chain.from_iterable(tokens)),
                                           dtype=torch.int32),
                }  # fmt: skip
        except CorpusError as e:
            yield {"error": str(e)}


class GlobalOrderLoader(BaseDataLoader):
    """One data-parallel rank's loader of the global order (see the module)."""

    global_order = True  # boost_titan.checkpoint.data_position: one position for all ranks

    def __init__(
        self,
        name: str,
        source,
        tokenizer,
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        infinite: bool = True,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        fingerprint: dict[str, Any] | None = None,
        where: str = "",
    ):
        self.dataset_name, self.source, self.tokenizer = name, source, tokenizer
        self.seq_len, self.local_batch_size, self.infinite = seq_len, local_batch_size, infinite
        self.dp_rank, self.dp_world_size = dp_rank, dp_world_size
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.persistent_workers, self.pin_memory = persistent_workers, pin_memory
        self.fingerprint = {"dataset": name, **(fingerprint or {})}
        self.where = where or name
        self.position = Position()

    # ------------------------------------------------------------------ batches
    def __iter__(self):
        return self._batches(os.environ.get(DUMP_ENV))

    def _chunks(self, cursor):
        chunks = TokenChunks(self.source, self.tokenizer, cursor, self.infinite)
        if not self.num_workers:
            return iter(chunks)
        kwargs = {"prefetch_factor": self.prefetch_factor} if self.prefetch_factor else {}
        return iter(
            DataLoader(
                chunks,
                batch_size=None,
                num_workers=self.num_workers,
                persistent_workers=self.persistent_workers,
                **kwargs,
            )
        )

    def _batches(self, dump_folder: str | None):
        start = self.position
        packer = Packer(start, self.seq_len + 1)
        stream = self._chunks(start.cursor)
        local, dp = self.local_batch_size, self.dp_world_size
        lo, hi = rank_slice(self.dp_rank, local)
        epoch = start.epoch
        for batch in itertools.count():
            rows = []
            for j in range(local * dp):
                while packer.available < packer.window:
                    chunk = next(stream, None)
                    if chunk is None:  # a finite stream: the incomplete global batch is dropped
                        return
                    if "error" in chunk:
                        raise CorpusError(chunk["error"])
                    docs = torch.split(chunk["tokens"], chunk["lengths"].tolist())
                    for after, tokens in zip(chunk["after"].tolist(), docs):
                        if after[0] > epoch:
                            epoch = after[0]
                            logger.warning(f"Dataset {self.dataset_name} is being re-looped")
                        packer.add(tuple(after), tokens)
                pieces = packer.cut(lo <= j < hi)
                if pieces is not None:  # (a converted position's pending tokens: a list)
                    rows.append(torch.cat([torch.as_tensor(p, dtype=torch.int32) for p in pieces]))
            self.position = packer.position()
            x = torch.stack(rows).long()
            if dump_folder:
                self._dump(dump_folder, start.windows, batch, x)
            inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
            if self.pin_memory and torch.cuda.is_available():
                inputs, labels = inputs.pin_memory(), labels.pin_memory()
            yield {"input": inputs}, labels

    def _dump(self, folder: str, start: int, batch: int, x: torch.Tensor) -> None:
        local, dp, rank = self.local_batch_size, self.dp_world_size, self.dp_rank
        record = {
            "dp_rank": rank,
            "dp": dp,
            "windows": list(rank_windows(start, batch, rank, local, dp)),
            "tokens": x.tolist(),
        }
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    def describe(self) -> str:
        """The one log line of this rank's reading."""
        local, dp = self.local_batch_size, self.dp_world_size
        lo, hi = rank_slice(self.dp_rank, local)
        line = (
            f"{self.where}, read in one global order: every data-parallel rank reads every "
            f"document in order and packs the same windows of {self.seq_len + 1} tokens; a "
            f"global batch is {local * dp} windows ({local} per rank x {dp} ranks) and rank "
            f"{self.dp_rank} trains on windows {lo}..{hi - 1} of each"
        )
        if self.num_workers:
            line += (
                f"; {self.num_workers} DataLoader workers tokenize chunks of {CHUNK_DOCS} "
                "documents in turn"
            )
        return line

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        state = {
            **self.position.to_state(),
            "seq_len": self.seq_len,
            "dp_world_size": self.dp_world_size,
            "local_batch_size": self.local_batch_size,
            fingerprint.KEY: self.fingerprint,
        }
        return {POSITION_ITEM: pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        from boost_titan.checkpoint import safe_metadata

        key = f"dataloader.{POSITION_ITEM}"
        state = safe_metadata.dataloader_state(state_dict[POSITION_ITEM], key)
        if not isinstance(state, dict):
            raise DataResumeError(f"{self.dataset_name}: the checkpoint's {key} is not a dict")
        self._check_corpus(state.get(fingerprint.KEY))
        try:
            self.position = Position.from_state(state, f"{self.dataset_name}: {key}")
        except PositionError as e:
            raise DataResumeError(str(e)) from None
        self._log_resume(state)

    def _check_corpus(self, saved: Any) -> None:
        now = self.fingerprint
        if not isinstance(saved, dict) or saved.get("dataset") != now["dataset"]:
            was = saved.get("dataset") if isinstance(saved, dict) else None
            raise DataResumeError(
                f"{self.dataset_name}: the checkpoint's data position was saved over dataset "
                f"{was!r}, this run reads {now['dataset']!r}: resume with the same dataset, "
                f"or {fingerprint.RESTART}"
            )
        saved = {k: v for k, v in saved.items() if k != "dataset"}
        if "files" in now:
            fingerprint.check(saved, {k: v for k, v in now.items() if k != "dataset"},
                              self.dataset_name, self.source.corpus.path)  # fmt: skip
        elif saved.get("documents") != now.get("documents"):
            raise DataResumeError(
                f"{self.dataset_name}: the checkpoint's data position was saved over "
                f"{saved.get('documents')} documents, {self.where.split(': ')[-1]} holds "
                f"{now.get('documents')} now: the saved document index would resume at the "
                f"wrong place; resume with the same dataset, or {fingerprint.RESTART}"
            )

    def _log_resume(self, state: dict[str, Any], saved_by: str = "") -> None:
        local, dp = self.local_batch_size, self.dp_world_size
        first = rank_windows(self.position.windows, 0, self.dp_rank, local, dp)
        was = saved_by or (
            f"saved at data-parallel degree {state.get('dp_world_size')} x local batch "
            f"{state.get('local_batch_size')}"
        )
        line = (
            f"{self.dataset_name}: data position from the checkpoint: {self.position.describe()}, "
            f"{was}; this run (degree {dp} x {local}) goes on with the same global stream, "
            f"rank {self.dp_rank} from windows {first.start}..{first.stop - 1}"
        )
        if state.get("seq_len", self.seq_len) != self.seq_len:
            line += (
                f" (saved with seq_len {state['seq_len']}, now {self.seq_len}: the token stream "
                "goes on, cut into windows of the new length)"
            )
        logger.info(line)

    def load_legacy(self, state: Any, folder: str) -> None:
        """The data position of a one-rank checkpoint of the per-rank loaders (before the
        global order): torchtitan's StatefulDataLoader state of rank 0 without workers,
        whose stream is the global order's, converted (``order.legacy_position``)."""
        why = None
        dataset = state.get("dataset_state") if isinstance(state, dict) else None
        if isinstance(state, dict) and "_snapshot" in state:
            why = "DataLoader workers read their own files (another order than this one's)"
        elif not isinstance(dataset, dict) or "token_buffer" not in dataset:
            why = "its state holds no dataset position"
        elif ("data" in dataset) != isinstance(self.source, FileSource):
            why = "it was saved over another kind of dataset (streamed / map-style)"
        if why:
            raise DataResumeError(
                f"checkpoint {folder}: its data position was saved by the per-rank data "
                f"loader of an older boost_titan and cannot continue this run's order ({why}); "
                f"{fingerprint.RESTART}"
            )
        corpus = getattr(self.source, "corpus", None)
        if corpus is not None:
            fingerprint.check(dataset.get(fingerprint.KEY), fingerprint.fingerprint(corpus),
                              self.dataset_name, corpus.path)  # fmt: skip
        try:
            every, held = (corpus.holdout_every, corpus.held) if corpus else (0, False)
            self.position = legacy_position(dataset, every, held)
        except PositionError as e:
            raise DataResumeError(
                f"checkpoint {folder}: its data position was saved by the per-rank data "
                f"loader of an older boost_titan and cannot continue this run's order ({e}); "
                f"{fingerprint.RESTART}"
            ) from None
        except (KeyError, TypeError, ValueError) as e:
            raise DataResumeError(
                f"checkpoint {folder}: its data position (per-rank loader, rank 0) is not one "
                f"torchtitan's text dataset writes ({type(e).__name__}: {e}); "
                f"{fingerprint.RESTART}"
            ) from None
        self._log_resume({}, "saved by the per-rank loader of an older boost_titan at dp 1")
