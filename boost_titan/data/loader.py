"""Which loader reads ``[training] dataset`` and ``[validation] dataset``.

**Training** (:func:`build_dataloader`): the global order (``boost_titan.data.order``,
``boost_titan.data.global_loader``) for every dataset boost_titan reads itself:
``boost_corpus``, ``local_text`` (a ``save_to_disk`` folder read map-style, or files
streamed by ``boost_titan.data.sources``) and any registered dataset whose loader returns
a map-style ``datasets.Dataset``. Every data-parallel rank reads the whole corpus in
order and trains on its slice of each global batch; the position is one for all ranks
and resumes at any dp degree. A Hugging Face streaming dataset of torchtitan's registry
(``c4``) keeps torchtitan's per-rank loader (its position resumes only at its own dp
degree, ``boost_titan.checkpoint.data_position``). One log line per rank at start says
which reading it uses.

**Validation** (:func:`build_validation_dataloader`): a finite pass, each rank over its
own share of the documents (never checkpointed, so no order to keep across layouts):

* **map-style** for a ``save_to_disk`` folder (memory-mapped, no copy): each
  data-parallel rank reads a contiguous range of documents
  (``datasets.distributed.split_dataset_by_node`` on a ``Dataset``);
* **streamed** for files (``boost_titan.data.local_text.stream``): one shard per file.
  When the file count divides by the data-parallel degree the ranks share **by file**
  (rank r reads files r, r + dp, r + 2 dp, ... in path order); otherwise **by sample**
  (every rank reads every file and keeps every dp-th document, from its r-th). That is
  datasets' ``split_dataset_by_node`` rule for an ``IterableDataset``; the log line
  (:func:`describe_share`) says which. With DataLoader workers, datasets gives each
  worker whole files of the rank's share.

Every other validation dataset is torchtitan's loader.
"""

from __future__ import annotations

from dataclasses import asdict
from operator import itemgetter

from torchtitan.components.dataloader import ParallelAwareDataloader
from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataset,
    _validate_dataset,
    build_text_dataloader,
)
from torchtitan.hf_datasets.text_datasets import (
    build_text_validation_dataloader as _torchtitan_validation_dataloader,
)
from torchtitan.tools.logging import logger

from boost_titan.data import fingerprint
from boost_titan.data import local_text
from boost_titan.data.global_loader import GlobalOrderLoader
from boost_titan.data.local_text import HOLDOUT_DATASET, LOCAL_DATASETS, Corpus
from boost_titan.data.sources import FileSource, SavedSource
from boost_titan.data.workers import check_workers


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _names(files) -> str:
    shown = ", ".join(f.rsplit("/", 1)[-1] for f in files[:3])
    return shown + (f", ... ({len(files)} in all)" if len(files) > 3 else "")


def corpus_summary(corpus: Corpus, name: str, n_docs: int | None) -> str:
    """``name: path: what it is`` (files, format, streamed or map-style)."""
    head = f"{name}: {corpus.path}"
    if not corpus.streamed:
        return (
            f"{head}: a save_to_disk folder of {n_docs} documents (text field "
            f"{corpus.text_field!r}), map-style (memory-mapped Arrow, no copy)"
        )
    n = len(corpus.files)
    plural = "s" if n > 1 else ""
    held = f", {corpus.held_out} more held out for validation" if corpus.held_out else ""
    if corpus.holdout_every:
        nth = _ordinal(corpus.holdout_every)
        held = (
            f", only every {nth} document of each file: held out for validation"
            if corpus.held
            else f", every {nth} document of each file held out for validation"
        )
    return (
        f"{head}: {n} {corpus.suffixes()} file{plural} ({corpus.kind}, text field "
        f"{corpus.text_field!r}{held}), streamed (read as training consumes them, no cache copy)"
    )


def describe_share(
    corpus: Corpus, name: str, n_docs: int | None, rank: int, world: int, workers: int = 0
) -> str:
    """The one log line of a validation loader over a local corpus: what it is, the
    sharding rule and this rank's share."""
    what = corpus_summary(corpus, name, n_docs)
    if not corpus.streamed:
        div, mod = divmod(n_docs, world)
        start = div * rank + min(rank, mod)
        end = start + div + (1 if rank < mod else 0)
        return (
            f"{what}, sharded by document range over {world} data-parallel ranks: rank "
            f"{rank} reads documents {start}..{end - 1}"
        )
    n = len(corpus.files)
    files = f"{n} file{'s' if n > 1 else ''}"
    if world == 1:
        share = f"{what}, one data-parallel rank: rank 0 reads every file"
    elif n % world == 0:
        mine = list(corpus.files[rank::world])
        share = (
            f"{what}, sharded by file over {world} data-parallel ranks ({files} "
            f"divide by {world}): rank {rank} reads {len(mine)} files ({_names(mine)})"
        )
    else:
        share = (
            f"{what}, sharded by sample over {world} data-parallel ranks ({files} "
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
    """torchtitan's text dataset over this rank's share of a local corpus (validation),
    with an empty share refused and the pass counter kept per process."""

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

    def _own_epoch(self) -> None:
        """Give this process its own pass counter (validation with ``steps`` set loops
        endlessly). datasets keeps an IterableDataset's epoch in a shared-memory tensor
        that every DataLoader worker forked from this dataset shares: each worker's
        re-loop (torchtitan's ``set_epoch(epoch + 1)``) would bump the others' epoch,
        which picks the file order of their next pass, so the batches depended on the
        workers' timing."""
        if not corpus_is_map_style(self._data):
            self._data._epoch = int(self._data._epoch)


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


# ---------------------------------------------------------------------------------------
# Training


def _training_source(job_config):
    """(source, fingerprint, what) of the training dataset in the global order, or None
    for a dataset torchtitan's per-rank loader reads (a streaming ``IterableDataset``)."""
    from datasets import Dataset, load_from_disk

    t = job_config.training
    name = t.dataset
    if name in LOCAL_DATASETS:
        corpus = corpus_for(job_config, "training")
        if corpus.streamed:
            what = corpus_summary(corpus, name, None)
            return FileSource(name, corpus), fingerprint.fingerprint(corpus), what
        data = load_from_disk(corpus.path)
        source = SavedSource(name, data, None, corpus.text_field)
        return source, {"documents": len(data)}, corpus_summary(corpus, name, len(data))
    path, load, text_of = _validate_dataset(name.lower(), t.dataset_path)
    data = load(path)
    if not isinstance(data, Dataset):
        return None
    what = f"{name}: {path}: a saved dataset of {len(data)} documents, map-style"
    return SavedSource(name, data, text_of, "text"), {"documents": len(data)}, what


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """The TrainSpec's ``build_dataloader_fn``: the global order where boost_titan reads
    the dataset, torchtitan's per-rank loader otherwise (DataLoader workers over a
    map-style dataset refused there: :mod:`boost_titan.data.workers`)."""
    found = _training_source(job_config)
    if found is None:
        loader = build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
        check_workers(loader, "training", job_config.training.dataset)
        return loader
    source, prints, what = found
    t = job_config.training
    loader = GlobalOrderLoader(
        t.dataset,
        source,
        tokenizer,
        seq_len=t.seq_len,
        local_batch_size=t.local_batch_size,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        infinite=infinite,
        fingerprint=prints,
        where=what,
        **asdict(t.dataloader),
    )
    logger.info(loader.describe())
    return loader


# ---------------------------------------------------------------------------------------
# Validation


def build_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=False):
    """torchtitan's Validator builds its loader by this name (see :func:`install`)."""
    v = job_config.validation
    if v.dataset not in LOCAL_DATASETS:
        return _torchtitan_validation_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=infinite,
        )
    corpus = corpus_for(job_config, "validation")
    dataset = LocalTextDataset(
        v.dataset,
        corpus,
        tokenizer,
        v.seq_len,
        dp_rank,
        dp_world_size,
        infinite,
        v.dataloader.num_workers,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **{**asdict(v.dataloader), "batch_size": v.local_batch_size},
    )


def install() -> None:
    """torchtitan's ``Validator.__init__`` calls ``build_text_validation_dataloader``
    from its own module (no TrainSpec hook): point that name at ours, which hands every
    other dataset back to torchtitan's."""
    import torchtitan.components.validate as validate

    validate.build_text_validation_dataloader = build_validation_dataloader
