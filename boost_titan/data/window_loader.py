"""The loader of tokenized corpora, training's and validation's: each data-parallel rank
reads only the windows of its slice of each global batch (``boost_titan.data.order``),
by ``pread`` from the corpora's ``.bin`` files (``boost_titan.data.tokenized``), each
block of a part checked against its digest the first time it is read, and no corpus
whose largest token id is outside ``vocab_size`` (the tokenizer's: the model's is at
least that, checked at launch) read at all.

Per rank and step it reads ``local_batch_size x (seq_len + 1)`` tokens and computes
their places arithmetically: what it reads, its CPU time and its memory do not depend
on the data-parallel degree or the corpus' size. ``[training.dataloader] num_workers``
moves the reads into DataLoader workers (batch ``b`` of the rank is item ``b`` of a
map-style dataset, read ahead in order); they are not needed to keep up.

**Position.** The samples consumed (every rank's: the same number on every rank) plus
what makes them mean the same windows: ``seq_len``, the seed and shuffle, the blend's
weights and every corpus' identity (its manifest digest, tokenizer, counts). One
checkpoint item (``dataloader.position``) for all ranks; a resume under any dp degree,
local batch size, TP/PP layout or worker count goes on with the same global batches,
and a change of any of the rest is refused in one line naming it.

**Validation** reads one corpus in order, no shuffle: a pass (``[validation] steps =
-1``) is ``windows // (local_batch_size x dp)`` global batches on every rank, the last
``windows % (local_batch_size x dp)`` windows not scored (every rank runs the same
number of batches: no rank waits in a collective another never enters); with ``steps``
set the windows wrap around.

``BOOST_TITAN_DUMP_BATCHES=FOLDER`` (tests): each process appends every batch it yields
to ``FOLDER/rank{RANK}.jsonl`` (its data-parallel rank, the global sample indices and
their token ids).
"""

from __future__ import annotations

import itertools
import json
import os
import pickle
from fractions import Fraction
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from torchtitan.components.dataloader import BaseDataLoader
from torchtitan.tools.logging import logger

from boost_titan.checkpoint.data_position import POSITION_ITEM, DataResumeError
from boost_titan.data.local_text import CorpusError
from boost_titan.data.order import VERSION, Blend, Order, rank_slice, rank_windows
from boost_titan.data.tokenized import TokenizedCorpus, WindowReader

DUMP_ENV = "BOOST_TITAN_DUMP_BATCHES"
RESTART = (
    "resume with the same data, or keep the model, optimizer and step and restart the "
    "data from its first window with --checkpoint.exclude_from_loading dataloader"
)


class _Batches(Dataset):
    """Batch ``b`` of a rank (from the run's start): what DataLoader workers read."""

    def __init__(self, loader: WindowLoader, start: int):
        self.loader, self.start = loader, start

    def __getitem__(self, b: int) -> torch.Tensor:
        return self.loader.read_batch(self.loader.samples_of(self.start, b))

    def __len__(self) -> int:  # (the sampler decides; DataLoader asks only with workers)
        return 1 << 62


class WindowLoader(BaseDataLoader):
    global_order = True  # boost_titan.checkpoint.data_position: one position for all ranks
    restarts_each_pass = True  # validation: every iteration from the first window

    def __init__(
        self,
        name: str,
        corpora: list[TokenizedCorpus],
        weights: list[Fraction],
        *,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int,
        dp_world_size: int,
        seed: int = 0,
        shuffle: bool = True,
        infinite: bool = True,
        validation: bool = False,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory: bool = False,
        vocab_size: int | None = None,
    ):
        self.dataset_name, self.corpora, self.weights = name, list(corpora), list(weights)
        self.seq_len, self.window = seq_len, seq_len + 1
        self.local_batch_size, self.dp_rank, self.dp_world_size = (
            local_batch_size,
            dp_rank,
            dp_world_size,
        )
        self.seed, self.shuffle, self.infinite, self.validation = (
            seed,
            shuffle,
            infinite,
            validation,
        )
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        self.persistent_workers, self.pin_memory = persistent_workers, pin_memory
        counts = [c.windows(self.window) for c in self.corpora]
        for c, n in zip(self.corpora, counts):
            if n == 0:
                raise CorpusError(
                    f"{name}: {c.path} holds {c.tokens} tokens, less than one window of "
                    f"seq_len + 1 = {self.window}"
                )
        self.order = Order(counts, Blend(self.weights), seed, shuffle)
        self.readers = [WindowReader(c, self.window, vocab_size) for c in self.corpora]
        self.global_batch = local_batch_size * dp_world_size
        if validation and not infinite and counts[0] < self.global_batch:
            raise CorpusError(
                f"{name}: {self.corpora[0].path} holds {counts[0]} windows of {self.window} "
                f"tokens, fewer than one global batch of {self.global_batch} (local batch "
                f"{local_batch_size} x {dp_world_size} data-parallel ranks): lower "
                "[validation] local_batch_size or seq_len, or hold out more data"
            )
        self.samples = 0  # the position: global samples consumed before the next batch
        self._passes = [0] * len(self.corpora)
        self._seeks = 0

    # ------------------------------------------------------------------ reading
    def samples_of(self, start: int, b: int) -> range:
        return rank_windows(start, b, self.dp_rank, self.local_batch_size, self.dp_world_size)

    def read_batch(self, samples: range) -> torch.Tensor:
        corpus, _, window = self.order.lookup(np.arange(samples.start, samples.stop))
        rows = [self.readers[k].read(int(w)) for k, w in zip(corpus, window)]
        return torch.from_numpy(np.stack(rows))

    def passes(self) -> int | None:
        """Batches of a finite pass (validation), None when endless."""
        if self.infinite:
            return None
        return self.order.windows[0] // self.global_batch

    def seek(self, samples: int) -> None:
        """Continue from global position ``samples`` at the next batch (a replica group
        recovered from a live one: ``boost_titan.train.replicas``); an iteration in
        progress restarts from there."""
        if type(samples) is not int or samples < 0:
            raise ValueError(f"{self.dataset_name}: data position {samples!r} is not a count")
        self.samples = samples
        self._seeks += 1

    def __iter__(self):
        while True:  # once, unless a seek restarts it
            seeks = self._seeks
            yield from self._iter_from(self.samples, seeks)
            if self._seeks == seeks:
                return

    def _iter_from(self, start: int, seeks: int):
        n = self.passes()
        batches = itertools.count() if n is None else range(n)
        dump = os.environ.get(DUMP_ENV)
        if self.num_workers:
            kwargs = {"prefetch_factor": self.prefetch_factor} if self.prefetch_factor else {}
            rows = iter(DataLoader(_Batches(self, start), batch_size=None, sampler=batches,
                                   num_workers=self.num_workers,
                                   persistent_workers=self.persistent_workers,
                                   **kwargs))  # fmt: skip
        else:
            rows = (self.read_batch(self.samples_of(start, b)) for b in batches)
        for b, x in enumerate(rows):
            if self._seeks != seeks:  # (before the position moves past the seek's)
                return
            samples = self.samples_of(start, b)
            if not self.validation:
                self.samples = start + (b + 1) * self.global_batch
                self._note_passes(samples)
            if dump:
                self._dump(dump, samples, x)
            inputs, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
            if self.pin_memory and torch.cuda.is_available():
                inputs, labels = inputs.pin_memory(), labels.pin_memory()
            yield {"input": inputs}, labels

    def _note_passes(self, samples: range) -> None:
        corpus, epoch, _ = self.order.lookup(np.arange(samples.start, samples.stop))
        for k, e in zip(corpus.tolist(), epoch.tolist()):
            if e > self._passes[k]:
                self._passes[k] = e
                which = f" ({self.corpora[k].path})" if len(self.corpora) > 1 else ""
                logger.warning(f"Dataset {self.dataset_name} is being re-looped{which}")

    def _dump(self, folder: str, samples: range, x: torch.Tensor) -> None:
        record = {"dp_rank": self.dp_rank, "dp": self.dp_world_size,
                  "windows": list(samples), "tokens": x.tolist()}  # fmt: skip
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{os.environ.get('RANK', '0')}.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ description
    def view(self) -> dict[str, Any]:
        """What makes a sample index mean the same tokens: compared between ranks before
        the first step and saved with the position."""
        return {
            "seq_len": self.seq_len,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "weights": [str(w) for w in self.weights],
            "corpora": [c.identity() for c in self.corpora],
        }

    def describe(self) -> str:
        local, dp = self.local_batch_size, self.dp_world_size
        lo, hi = rank_slice(self.dp_rank, local)
        if len(self.corpora) == 1:
            what = self.corpora[0].describe()
        else:
            share = [
                f"{float(w / sum(self.weights)):.3g} x {c.path}"
                for w, c in zip(self.weights, self.corpora)
            ]
            what = f"a blend of {len(self.corpora)} tokenized corpora ({', '.join(share)})"
        order = (
            f"shuffled windows (seed {self.seed})" if self.shuffle else "windows in corpus order"
        )
        line = (
            f"{self.dataset_name}: {what}; {order} of {self.window} tokens; a global batch is "
            f"{local * dp} windows ({local} per rank x {dp} ranks) and rank {self.dp_rank} "
            f"reads windows {lo}..{hi - 1} of each, nothing else"
        )
        if self.validation and not self.infinite:
            n, rest = self.passes(), self.order.windows[0] % self.global_batch
            line += f"; a validation pass is {n} batches on every rank ({rest} windows left out)"
        return line

    # ------------------------------------------------------------------ position
    def state_dict(self) -> dict[str, Any]:
        state = {
            "version": VERSION,
            "samples": self.samples,
            **self.view(),
            "dp_world_size": self.dp_world_size,
            "local_batch_size": self.local_batch_size,
        }
        return {POSITION_ITEM: pickle.dumps(state)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        from boost_titan.checkpoint import safe_metadata

        key = f"dataloader.{POSITION_ITEM}"
        state = safe_metadata.dataloader_state(state_dict[POSITION_ITEM], key)
        name = self.dataset_name
        if not isinstance(state, dict):
            raise DataResumeError(f"{name}: the checkpoint's {key} is not a dict")
        if state.get("version") != VERSION:
            raise DataResumeError(
                f"{name}: the checkpoint's data position (version {state.get('version')!r}) "
                "was saved by an older boost_titan's loader, which packed the raw text "
                f"stream; it does not continue the tokenized corpus' order; {RESTART}"
            )
        if type(state.get("samples")) is not int or state["samples"] < 0:
            raise DataResumeError(
                f"{name}: {key} 'samples' is not a count: {state.get('samples')!r}"
            )
        what = differences(state, self.view())
        if what:
            raise DataResumeError(
                f"{name}: the checkpoint's data position was saved over other data: "
                f"{'; '.join(what)}; {RESTART}"
            )
        self.samples = state["samples"]
        local, dp = self.local_batch_size, self.dp_world_size
        first = self.samples_of(self.samples, 0)
        logger.info(
            f"{name}: data position from the checkpoint: sample {self.samples}, saved at "
            f"data-parallel degree {state.get('dp_world_size')} x local batch "
            f"{state.get('local_batch_size')}; this run (degree {dp} x {local}) goes on "
            f"with the same global order, rank {self.dp_rank} from samples "
            f"{first.start}..{first.stop - 1}"
        )


def differences(
    saved: dict[str, Any], now: dict[str, Any], then: str = "the checkpoint's"
) -> list[str]:
    """What differs between a saved view of the data (``then``'s) and this run's, one
    phrase each."""
    out = []
    for key, what in (("seq_len", "seq_len"), ("seed", "[training] dataset_seed"),
                      ("shuffle", "[training] dataset_shuffle"),
                      ("weights", "the blend's weights")):  # fmt: skip
        if saved.get(key) != now[key]:
            out.append(f"{what} was {saved.get(key)!r}, now {now[key]!r}")
    was, now_c = saved.get("corpora") or [], now["corpora"]
    if len(was) != len(now_c):
        out.append(f"{len(was)} corpora then, {len(now_c)} now")
        return out
    for i, (a, b) in enumerate(zip(was, now_c)):
        if not isinstance(a, dict) or a.get("digest") != b["digest"]:
            a = a if isinstance(a, dict) else {}
            changed = [
                f"{k} {a.get(k)!r} -> {b[k]!r}"
                for k in ("tokenizer", "tokens", "documents")
                if a.get(k) != b[k]
            ] or ["same counts: its files or their contents changed"]
            if a.get("source") != b["source"]:
                changed.append(f"tokenized from {b['source']!r}, then from {a.get('source')!r}")
            label = f"corpus {i} " if len(now_c) > 1 else "the corpus "
            out.append(
                f"{label}{b['path']} has digest {b['digest'][:12]}, {then} had "
                f"{str(a.get('digest'))[:12]} ({', '.join(changed)})"
            )
    return out
