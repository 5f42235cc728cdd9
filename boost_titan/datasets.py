"""Datasets registered with torchtitan's text loader (``[training] dataset = ...``).

boost_corpus      the embedded English corpus, train split
boost_corpus_val  its validation split (``[validation] dataset``)
local_text        your own data: ``dataset_path`` = a .jsonl/.json/.txt/.parquet
                  file, a folder of them, a ``save_to_disk`` folder, or a local
                  Hugging Face dataset folder; every sample needs a ``text`` field
                  (.txt files: one document per file)
"""

from __future__ import annotations

import os
from pathlib import Path

from torchtitan.hf_datasets import DatasetConfig
from torchtitan.hf_datasets.text_datasets import DATASETS

_BUILD_HINT = "build it with `python -m boost_titan.data build` (the README's `make data`)"
_FORMATS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet"}


def _corpus_split(split: str) -> str:
    from boost_titan.data.manifest import default_corpus_dir

    return str(default_corpus_dir() / split)


def _load_saved(path: str):
    from datasets import load_from_disk

    if not os.path.isdir(path):
        raise FileNotFoundError(f"corpus split not found at {path!r}; {_BUILD_HINT}")
    return load_from_disk(path)


def _load_local(path: str):
    from datasets import load_dataset, load_from_disk

    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"local_text: dataset_path {path!r} does not exist")
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "state.json").exists()):
        return load_from_disk(path)
    files = [p] if p.is_file() else sorted(f for f in p.rglob("*") if f.suffix in _FORMATS)
    kinds = {_FORMATS.get(f.suffix) for f in files}
    if p.is_dir() and not files:
        return load_dataset(path, split="train")  # a local Hugging Face dataset folder
    if None in kinds or len(kinds) != 1:
        raise ValueError(
            f"local_text: {path!r} must hold files of one kind among "
            f"{sorted(_FORMATS)}; found suffixes {sorted({f.suffix for f in files})}"
        )
    kind = kinds.pop()
    extra = {"sample_by": "document"} if kind == "text" else {}
    return load_dataset(kind, data_files=[str(f) for f in files], split="train", **extra)


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
