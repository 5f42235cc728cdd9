"""Refuse DataLoader workers over a map-style dataset: each would read every document.

torchtitan's ``HuggingFaceTextDataset`` iterates its whole (per-rank) dataset in every
DataLoader worker process. A streamed ``datasets.IterableDataset`` splits its files
among the workers itself, but a map-style ``datasets.Dataset`` (``boost_corpus``, a
``save_to_disk`` folder, any loader that converts to Arrow) does not: with
``num_workers = N`` every document is trained on N times per pass, with no error
(measured: 248 batches with 0 workers, 496 with 2; ``tests/test_data_loader_workers.py``).

Where torchtitan's loader reads (validation of ``boost_corpus_val`` or a ``save_to_disk``
folder, training on a dataset of torchtitan's registry). boost_titan's training loader
(``boost_titan.data.global_loader``) gives its workers chunks of one stream in turn and
needs no check.
"""

from __future__ import annotations


class DataloaderWorkersError(ValueError):
    """num_workers > 0 over a dataset whose documents every worker would read."""


def check_workers(dataloader, section: str, dataset_name: str) -> None:
    """Raise if ``dataloader`` (a ``ParallelAwareDataloader`` over torchtitan's
    ``HuggingFaceTextDataset``) has workers and its documents are map-style."""
    from datasets import Dataset

    workers = getattr(dataloader, "num_workers", 0)
    data = getattr(getattr(dataloader, "dataset", None), "_data", None)
    if workers > 0 and isinstance(data, Dataset):
        raise DataloaderWorkersError(
            f"[{section}.dataloader] num_workers = {workers} with dataset {dataset_name!r}, "
            f"a map-style dataset: each of the {workers} workers would read every document "
            f"({workers}x duplicates); set num_workers = 0, or use a streamed dataset "
            f"(an IterableDataset, whose files torch splits among the workers)"
        )
