"""Data loaders for ``local_text`` / ``local_text_holdout`` (training and validation);
torchtitan's own loader for every other dataset.

Which reading is used, stated on every rank in one log line at start
(:func:`describe_share`):

* **map-style** for a ``save_to_disk`` folder (already Arrow on disk, memory-mapped, no
  copy): each data-parallel rank reads a contiguous range of documents
  (``datasets.distributed.split_dataset_by_node`` on a ``Dataset``);
* **streamed** for files (``boost_titan.data.local_text.stream``): one shard per file. When
  the file count divides by the data-parallel degree the ranks share **by file** (rank
  r reads files r, r + dp, r + 2 dp, ... in path order); otherwise **by sample** (every
  rank reads every file and keeps every dp-th document, from its r-th). That is datasets'
  ``split_dataset_by_node`` rule for an ``IterableDataset``; the log line says which.

Exact resume: a streamed position is (epoch, file, documents read in it) plus the
tokens read but not yet trained on. torchtitan's text dataset re-loops an endless
stream by bumping the ``IterableDataset``'s epoch, and datasets only applies a loaded
position when the dataset's epoch equals the saved one; torchtitan's
``load_state_dict`` does not restore the epoch, so a checkpoint saved after the first
re-loop (epoch >= 1) resumed from the corpus' start. :class:`LocalTextDataset` restores
it. It also stops, in one line, a rank whose share holds no document (an endless loop
over nothing would hang the run). Each saved position records the files it is over
(:mod:`boost_titan.data.fingerprint`): a resume over changed files is refused.

DataLoader workers (``[training.dataloader] num_workers``): datasets gives each worker
whole files of the rank's share; :class:`LocalTextDataset` keeps the pass counter per
process and saves a copy of its token buffer, without which the workers' order and
resume depended on timing; :class:`LocalTextDataloader` checks a saved position in the
main process (a worker's refusal would be a traceback); :func:`check_stream_workers`
refuses more workers than a rank has files.
"""

from __future__ import annotations

from dataclasses import asdict
from operator import itemgetter

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataset,
    build_text_dataloader,
)
from torchtitan.hf_datasets.text_datasets import (
    build_text_validation_dataloader as _torchtitan_validation_dataloader,
)
from torchtitan.tools.logging import logger

from boost_titan.data import fingerprint
from boost_titan.data import local_text
from boost_titan.data.local_text import HOLDOUT_DATASET, LOCAL_DATASETS, Corpus
from boost_titan.data.workers import check_workers


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _names(files) -> str:
    shown = ", ".join(f.rsplit("/", 1)[-1] for f in files[:3])
    return shown + (f", ... ({len(files)} in all)" if len(files) > 3 else "")


def describe_share(
    corpus: Corpus, name: str, n_docs: int | None, rank: int, world: int, workers: int = 0
) -> str:
    """The one log line of a local corpus: files, format, streamed or map-style, the
    sharding rule and this rank's share."""
    head = f"{name}: {corpus.path}"
    if not corpus.streamed:
        div, mod = divmod(n_docs, world)
        start = div * rank + min(rank, mod)
        end = start + div + (1 if rank < mod else 0)
        return (
            f"{head}: a save_to_disk folder of {n_docs} documents (text field "
            f"{corpus.text_field!r}), map-style (memory-mapped Arrow, no copy), sharded by "
            f"document range over {world} data-parallel ranks: rank {rank} reads documents "
            f"{start}..{end - 1}"
        )
    n = len(corpus.files)
    plural = "s" if n > 1 else ""
    files = f"{n} file{plural}"
    held = f", {corpus.held_out} more held out for validation" if corpus.held_out else ""
    if corpus.holdout_every:
        nth = _ordinal(corpus.holdout_every)
        held = (
            f", only every {nth} document of each file: held out for validation"
            if corpus.held
            else f", every {nth} document of each file held out for validation"
        )
    what = (
        f"{n} {corpus.suffixes()} file{plural} ({corpus.kind}, text field "
        f"{corpus.text_field!r}{held}), streamed (read as training consumes them, no cache copy)"
    )
    if world == 1:
        share = f"{head}: {what}, one data-parallel rank: rank 0 reads every file"
    elif n % world == 0:
        mine = list(corpus.files[rank::world])
        share = (
            f"{head}: {what}, sharded by file over {world} data-parallel ranks ({files} "
            f"divide by {world}): rank {rank} reads {len(mine)} files ({_names(mine)})"
        )
    else:
        share = (
            f"{head}: {what}, sharded by sample over {world} data-parallel ranks ({files} "
            f"{'does' if n == 1 else 'do'} not divide by {world}): rank {rank} reads "
            f"{'the' if n == 1 else 'all'} {files} and keeps every {_ordinal(world)} document "
            f"from the {_ordinal(rank + 1)}"
        )
    if workers:  # datasets' split among a rank's DataLoader workers
        keeps = (
            f", each keeping every {_ordinal(world)} document of its own files from the "
            f"{_ordinal(rank + 1)}"
            if world > 1 and n % world
            else ""
        )
        share += (
            f", in {workers} DataLoader workers (worker w reads the rank's files w, "
            f"w + {workers}, ...{keeps}; batches from each in turn)"
        )
    return share


def corpus_is_map_style(data) -> bool:
    from datasets import Dataset

    return isinstance(data, Dataset)


class LocalTextDataset(HuggingFaceTextDataset):
    """torchtitan's text dataset over a local corpus, with the streamed position's epoch
    restored on resume and an empty share refused."""

    def __init__(
        self, name, corpus, tokenizer, seq_len, dp_rank, dp_world_size, infinite, workers=0
    ):
        from datasets import load_from_disk
        from datasets.distributed import split_dataset_by_node

        # torchtitan's __init__ resolves the dataset through its registry by path; the
        # attributes it sets are set here from the corpus instead.
        data = local_text.stream(corpus) if corpus.streamed else load_from_disk(corpus.path)
        self.dataset_name = name
        self._data = split_dataset_by_node(data, dp_rank, dp_world_size)
        self._tokenizer = tokenizer
        self.seq_len = seq_len
        self.infinite = infinite
        # a stream yields {"text": ...} whatever the field; a saved dataset has its columns
        self._text_processor = itemgetter("text" if corpus.streamed else corpus.text_field)
        self._sample_idx = 0
        self._token_buffer: list[int] = []
        self._empty_passes = 0
        self._corpus_path = corpus.path
        # the files this position is over, saved with it and checked on resume
        self._fingerprint = (
            fingerprint.fingerprint(corpus, dp_world_size) if corpus.streamed else None
        )
        self._share = describe_share(
            corpus,
            name,
            None if corpus.streamed else len(data),
            dp_rank,
            dp_world_size,
            workers if corpus.streamed else 0,  # (map-style with workers: refused)
        )
        logger.info(self._share)

    def _get_data_iter(self):
        # torchtitan's endless loop asks for a new pass whenever one ends: a share with
        # no document would spin there forever. One empty pass is legitimate (a resume
        # saved at the end of the share); two in a row mean the share is empty.
        found = False
        for sample in super()._get_data_iter():
            found = True
            yield sample
        self._empty_passes = 0 if found else self._empty_passes + 1
        if self._empty_passes >= 2:
            raise local_text.CorpusError(
                f"{self.dataset_name}: this data-parallel rank's share of the corpus holds "
                f"no document ({self._share}); use fewer data-parallel ranks or more documents"
            )

    def __iter__(self):
        self._own_epoch()
        yield from super().__iter__()

    def _own_epoch(self, epoch: int | None = None) -> None:
        """Give this process its own pass counter. datasets keeps an IterableDataset's
        epoch in a shared-memory tensor that every DataLoader worker forked from this
        dataset shares: each worker's re-loop (torchtitan's ``set_epoch(epoch + 1)``)
        would bump the others' epoch, which picks the file order of their next pass
        (datasets shuffles the files by epoch) and keys their resume, so the batches
        depended on the workers' timing and a resume was not exact."""
        if not corpus_is_map_style(self._data):
            self._data._epoch = int(self._data._epoch if epoch is None else epoch)

    def state_dict(self):
        state = super().state_dict()
        # torchtitan returns its live token buffer, which __iter__ extends in place: a
        # DataLoader worker's state is pickled by its queue's feeder thread while the
        # worker goes on reading, so the saved buffer could hold later tokens.
        state["token_buffer"] = list(state["token_buffer"])
        if self._fingerprint is not None:
            state[fingerprint.KEY] = self._fingerprint
        return state

    def check_fingerprint(self, state_dict) -> None:
        """Refuse (one line) a saved streamed position over other files than these."""
        if self._fingerprint is not None:
            fingerprint.check(
                state_dict.get(fingerprint.KEY),
                self._fingerprint,
                self.dataset_name,
                self._corpus_path,
            )

    def load_state_dict(self, state_dict):
        self.check_fingerprint(state_dict)
        super().load_state_dict(state_dict)
        if "data" in state_dict:  # streamed: datasets resumes only within the saved epoch
            self._own_epoch(state_dict["data"]["epoch"])


# ---------------------------------------------------------------------------------------
# Which files each loader reads: the one rule the config check and the loaders share


def corpus_for(job_config, section: str) -> Corpus:
    """The corpus ``[section]`` (training / validation) reads, holdout applied: training
    keeps all but the last ``dataset_holdout_files`` files, ``local_text_holdout`` reads
    exactly those."""
    training = job_config.training
    s = getattr(job_config, section)
    field = training.dataset_text_field
    files, every = training.dataset_holdout_files, training.dataset_holdout_every
    holdout = section == "training" and (files or every)
    if s.dataset != HOLDOUT_DATASET and not holdout:
        return local_text.find_corpus(s.dataset_path, field)
    corpus = local_text.find_corpus(training.dataset_path, field)
    if files and every:
        raise local_text.CorpusError(
            f"local_text: dataset_holdout_files = {files} and dataset_holdout_every = {every}: "
            "hold out files or every N-th document, not both (the other 0)"
        )
    if not files and not every:
        raise local_text.CorpusError(
            f"local_text: [validation] dataset = {HOLDOUT_DATASET!r} reads what [training] "
            "holds out, and neither dataset_holdout_files nor dataset_holdout_every is set"
        )
    split = (
        local_text.split_every(corpus, every) if every else local_text.split_holdout(corpus, files)
    )
    return split[1 if s.dataset == HOLDOUT_DATASET else 0]


def files_per_rank(corpus: Corpus, dp_world_size: int) -> int:
    """Files each rank's stream holds: a share of them by file, all of them by sample."""
    n = len(corpus.files)
    return n // dp_world_size if n % dp_world_size == 0 else n


def check_stream_workers(corpus: Corpus, dp_world_size: int, num_workers: int, section: str):
    """An endless stream needs a file per DataLoader worker: datasets gives each
    worker whole files (worker w of a rank reads its files w, w + num_workers, ...)
    and a worker with none would yield nothing forever."""
    per_rank = files_per_rank(corpus, dp_world_size)
    if corpus.streamed and 0 < per_rank < num_workers:
        raise local_text.CorpusError(
            f"[{section}.dataloader] num_workers = {num_workers}: each data-parallel rank "
            f"({dp_world_size} in all) streams {per_rank} of the {len(corpus.files)} "
            f"files of {corpus.path!r} and a DataLoader worker reads "
            f"whole files, so {num_workers - per_rank} worker(s) per rank would have "
            f"none; set num_workers <= {per_rank}, or split the corpus into more files"
        )


def _worker_count(state) -> int:
    return len(state["_snapshot"]["_worker_snapshots"]) if "_snapshot" in state else 0


def _dataset_states(state) -> list:
    if "_snapshot" in state:
        return [w.get("dataset_state") for w in state["_snapshot"]["_worker_snapshots"].values()]
    return [state.get("dataset_state")]


class LocalTextDataloader(ParallelAwareDataloader):
    """torchtitan's loader over :class:`LocalTextDataset`, checking a saved position in
    this process before it is handed on: with DataLoader workers each worker loads its
    own part, and a refusal raised there would end the worker with a traceback instead
    of the run with one line."""

    def load_state_dict(self, state_dict) -> None:
        from boost_titan.checkpoint import safe_metadata
        from boost_titan.checkpoint.data_position import DataResumeError

        blob = state_dict.get(self._rank_id) if state_dict else None
        if isinstance(blob, (bytes, bytearray)):
            state = safe_metadata.dataloader_state(blob, self._rank_id)
            saved = _worker_count(state)
            if saved != self.num_workers:  # torchdata: a bare AssertionError
                raise DataResumeError(
                    f"{self.dataset.dataset_name}: the checkpoint's data position was saved "
                    f"with [training.dataloader] num_workers = {saved} (one position per "
                    f"worker), this run has num_workers = {self.num_workers}; resume with "
                    f"num_workers = {saved}, or {fingerprint.RESTART}"
                )
            for dataset_state in _dataset_states(state):
                if dataset_state is not None:
                    self.dataset.check_fingerprint(dataset_state)
        super().load_state_dict(state_dict)


def _build(section, dp_world_size, dp_rank, tokenizer, job_config, infinite):
    s = getattr(job_config, section)
    corpus = corpus_for(job_config, section)
    if infinite:
        check_stream_workers(corpus, dp_world_size, s.dataloader.num_workers, section)
    dataset = LocalTextDataset(
        s.dataset,
        corpus,
        tokenizer,
        s.seq_len,
        dp_rank,
        dp_world_size,
        infinite,
        s.dataloader.num_workers,
    )
    return LocalTextDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **{**asdict(s.dataloader), "batch_size": s.local_batch_size},
    )


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """The TrainSpec's ``build_dataloader_fn`` (DataLoader workers over a map-style
    dataset refused: :mod:`boost_titan.data.workers`)."""
    if job_config.training.dataset not in LOCAL_DATASETS:
        loader = build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    else:
        loader = _build("training", dp_world_size, dp_rank, tokenizer, job_config, infinite)
    check_workers(loader, "training", job_config.training.dataset)
    return loader


def build_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=False):
    """torchtitan's Validator builds its loader by this name (see :func:`install`)."""
    if job_config.validation.dataset not in LOCAL_DATASETS:
        return _torchtitan_validation_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=infinite,
        )
    return _build("validation", dp_world_size, dp_rank, tokenizer, job_config, infinite)


def install() -> None:
    """torchtitan's ``Validator.__init__`` calls ``build_text_validation_dataloader``
    from its own module (no TrainSpec hook): point that name at ours, which hands every
    other dataset back to torchtitan's."""
    import torchtitan.components.validate as validate

    validate.build_text_validation_dataloader = build_validation_dataloader
