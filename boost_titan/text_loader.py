"""Data loaders for ``local_text`` / ``local_text_holdout`` (training and validation);
torchtitan's own loader for every other dataset.

Which reading is used, stated on every rank in one log line at start
(:func:`describe_share`):

* **map-style** for a ``save_to_disk`` folder (already Arrow on disk, memory-mapped, no
  copy): each data-parallel rank reads a contiguous range of documents
  (``datasets.distributed.split_dataset_by_node`` on a ``Dataset``);
* **streamed** for files (``boost_titan.local_text.stream``): one shard per file. When
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
over nothing would hang the run).
"""

from __future__ import annotations

from dataclasses import asdict
from operator import itemgetter

from torchtitan.hf_datasets.text_datasets import (
    HuggingFaceTextDataset,
    build_text_dataloader,
)
from torchtitan.hf_datasets.text_datasets import (
    build_text_validation_dataloader as _torchtitan_validation_dataloader,
)
from torchtitan.tools.logging import logger

from boost_titan import local_text
from boost_titan.dataloader_workers import check_workers
from boost_titan.local_text import HOLDOUT_DATASET, LOCAL_DATASETS, Corpus


def _ordinal(n: int) -> str:
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def _names(files) -> str:
    shown = ", ".join(f.rsplit("/", 1)[-1] for f in files[:3])
    return shown + (f", ... ({len(files)} in all)" if len(files) > 3 else "")


def describe_share(corpus: Corpus, name: str, n_docs: int | None, rank: int, world: int) -> str:
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
        return f"{head}: {what}, one data-parallel rank: rank 0 reads every file"
    if n % world == 0:
        mine = list(corpus.files[rank::world])
        return (
            f"{head}: {what}, sharded by file over {world} data-parallel ranks ({files} "
            f"divide by {world}): rank {rank} reads {len(mine)} files ({_names(mine)})"
        )
    return (
        f"{head}: {what}, sharded by sample over {world} data-parallel ranks ({files} "
        f"{'does' if n == 1 else 'do'} not divide by {world}): rank {rank} reads "
        f"{'the' if n == 1 else 'all'} {files} and keeps every {_ordinal(world)} document "
        f"from the {_ordinal(rank + 1)}"
    )


class LocalTextDataset(HuggingFaceTextDataset):
    """torchtitan's text dataset over a local corpus, with the streamed position's epoch
    restored on resume and an empty share refused."""

    def __init__(self, name, corpus, tokenizer, seq_len, dp_rank, dp_world_size, infinite):
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
            corpus, name, None if corpus.streamed else len(data), dp_rank, dp_world_size
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

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        if "data" in state_dict:  # streamed: datasets resumes only within the saved epoch
            self._data.set_epoch(state_dict["data"]["epoch"])


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


def _build(section, dp_world_size, dp_rank, tokenizer, job_config, infinite):
    from torchtitan.components.dataloader import ParallelAwareDataloader

    s = getattr(job_config, section)
    dataset = LocalTextDataset(
        s.dataset,
        corpus_for(job_config, section),
        tokenizer,
        s.seq_len,
        dp_rank,
        dp_world_size,
        infinite,
    )
    return ParallelAwareDataloader(
        dataset,
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        **{**asdict(s.dataloader), "batch_size": s.local_batch_size},
    )


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """The TrainSpec's ``build_dataloader_fn`` (DataLoader workers over a map-style
    dataset refused: :mod:`boost_titan.dataloader_workers`)."""
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
