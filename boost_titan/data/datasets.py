"""Datasets registered with torchtitan's text loader (``[training] dataset = ...``).

boost_corpus        the embedded English corpus, train split
boost_corpus_val    its validation split (``[validation] dataset``)
local_text          your own data: ``dataset_path`` = a .jsonl/.json/.txt/.parquet
                    file, a folder of them (streamed: read as training consumes them,
                    no copy into the Hugging Face cache), or a ``save_to_disk`` folder
                    (map-style, memory-mapped); the text is the field
                    ``[training] dataset_text_field`` (default "text"; .txt files: one
                    document per file)
local_text_holdout  ``[validation]`` only: what ``[training] dataset_holdout_files``
                    (the last N files) or ``dataset_holdout_every`` (every N-th
                    document of each file) holds out of the training corpus

tokenized           a corpus ``boost-titan data tokenize`` / ``data seal`` wrote
                    (``dataset_path``; training: or ``dataset_blend``)

Each is read as a tokenized corpus (raw text is tokenized once into a cache first), in
one order that is the same at every layout (``boost_titan.data.order``); which loader
reads what: ``boost_titan.data.loader``, which logs one line per rank at start. The
files and checks of raw text: ``boost_titan.data.local_text``.
"""

from __future__ import annotations

import os

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

from boost_titan.data import loader, local_text
from boost_titan.data.corpus.manifest import BUILD_HINT as _BUILD_HINT


def _corpus_split(split: str) -> str:
    from boost_titan.data.corpus.manifest import default_corpus_dir

    return str(default_corpus_dir() / split)


def _load_saved(path: str):
    from datasets import load_from_disk

    if not os.path.isdir(path):
        raise FileNotFoundError(f"corpus split not found at {path!r}; {_BUILD_HINT}")
    return load_from_disk(path)


def _load_local(path: str):
    """torchtitan's registry loader, for a plain ``torchtitan.train`` run (boost_titan's
    own runs build local loaders in ``boost_titan.data.loader``): the same corpus, with
    the default text field and no holdout."""
    from datasets import load_from_disk

    corpus = local_text.find_corpus(path)
    return local_text.stream(corpus) if corpus.streamed else load_from_disk(path)


def _holdout_outside_boost(path: str):
    raise ValueError(
        f"dataset {local_text.HOLDOUT_DATASET!r} is read by boost_titan's validation loader "
        "(boost_titan.train / run_train.sh), not by torchtitan's own"
    )


def _tokenized_outside_boost(path: str):
    raise ValueError(
        "dataset 'tokenized' is read by boost_titan's loaders (boost_titan.train / "
        "run_train.sh), not by torchtitan's own"
    )


def _text(sample) -> str:
    return sample["text"]


def register_datasets() -> None:
    DATASETS["boost_corpus"] = DatasetConfig(
        path=_corpus_split("train"), loader=_load_saved, sample_processor=_text
    )
    DATASETS["boost_corpus_val"] = DatasetConfig(
        path=_corpus_split("validation"), loader=_load_saved, sample_processor=_text
    )
    DATASETS["local_text"] = DatasetConfig(path="", loader=_load_local, sample_processor=_text)
    DATASETS[local_text.HOLDOUT_DATASET] = DatasetConfig(
        path="", loader=_holdout_outside_boost, sample_processor=_text
    )
    DATASETS[loader.TOKENIZED] = DatasetConfig(
        path="", loader=_tokenized_outside_boost, sample_processor=_text
    )
    loader.install()
