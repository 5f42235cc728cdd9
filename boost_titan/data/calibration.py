"""Calibration tokens for the activation-aware fit of ``boost-titan checkpoint
from-dense`` (:func:`calibration_tokens`), from

- the embedded corpus' *training* split by default (where training finds it:
  ``$BOOST_TITAN_DATA`` or ``./data/boost_corpus``; validation never sees them), or any
  ``save_to_disk`` folder (documents in a seeded random order), or a ``.jsonl`` /
  ``.json`` / ``.txt`` / ``.parquet`` file or folder read by training's reader
  (field ``text``): at most one sequence's worth of tokens from each document (so the
  sample spreads over the corpus), concatenated with the tokenizer's EOS between
  documents and cut into sequences;
- ``random``: uniform random token ids (no tokenizer, no data; for tests and for a
  model whose text you do not have).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from boost_titan.data import local_text
from boost_titan.data.corpus.manifest import default_corpus_dir

RANDOM = "random"


class CalibrationError(ValueError):
    """Calibration data or tokenizer that cannot be used: one line."""


def default_corpus() -> Path:
    """The embedded corpus' training split, where training finds it."""
    return default_corpus_dir() / "train"


def _documents(path: Path, gen: torch.Generator) -> Iterator[str]:
    """The documents of ``path``: a ``save_to_disk`` folder's in a seeded random order
    (memory-mapped, read one at a time); a corpus file or folder's in path order,
    through training's reader (:func:`local_text.read_documents`: the same files and
    documents as ``[training] dataset = "local_text"``, field ``text``)."""
    if local_text.is_saved_dataset(str(path)):
        import datasets

        ds = datasets.load_from_disk(str(path))
        if isinstance(ds, datasets.DatasetDict):
            ds = ds["train"] if "train" in ds else next(iter(ds.values()))
        if "text" not in ds.column_names:
            raise CalibrationError(f"calibration data {str(path)!r} has no 'text' column")
        for k in torch.randperm(len(ds), generator=gen).tolist():
            yield ds[k]["text"]
        return
    try:
        corpus = local_text.find_corpus(str(path))
        for file in corpus.files:
            yield from local_text.read_documents(file, "text")
    except local_text.CorpusError as e:
        raise CalibrationError(f"calibration data: {e}") from None


def load_tokenizer(folder: Path):
    """(tokenizers.Tokenizer of ``folder/tokenizer.json``, its EOS id or None)."""
    from tokenizers import Tokenizer

    path = folder / "tokenizer.json"
    if not path.is_file():
        raise CalibrationError(
            f"no tokenizer for the calibration text: {str(path)!r} does not exist (the dense "
            "folder's tokenizer.json, else [model] hf_assets_path; or --calib-data random)"
        )
    tok = Tokenizer.from_file(str(path))
    eos = None
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        token = json.loads(cfg.read_text()).get("eos_token")
        if isinstance(token, dict):
            token = token.get("content")
        if isinstance(token, str):
            eos = tok.token_to_id(token)
    return tok, eos


def calibration_tokens(
    data: str | None,
    tokenizer_dir: Path | None,
    n_seq: int,
    seq_len: int,
    vocab_size: int,
    seed: int = 0,
) -> torch.Tensor:
    """``[n_seq, seq_len]`` token ids (module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    if data == RANDOM:
        return torch.randint(0, vocab_size, (n_seq, seq_len), generator=gen)
    path = Path(data) if data else default_corpus()
    if not path.exists():
        hint = " (build it: boost-titan data build)" if not data else ""
        raise CalibrationError(f"calibration data {str(path)!r} does not exist{hint}")
    if tokenizer_dir is None:
        raise CalibrationError("no tokenizer for the calibration text (or --calib-data random)")
    tok, eos = load_tokenizer(tokenizer_dir)
    need = n_seq * seq_len
    ids: list[int] = []
    for doc in _documents(path, gen):
        text = doc[: seq_len * 16]  # enough characters for seq_len tokens
        if not text.strip():
            continue
        ids += tok.encode(text, add_special_tokens=False).ids[:seq_len]
        if eos is not None:
            ids.append(eos)
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise CalibrationError(
            f"calibration data {str(path)!r} gives {len(ids)} tokens; {n_seq} x {seq_len} "
            "are needed (fewer --calib-sequences, a shorter --calib-seq-len or more text)"
        )
    out = torch.tensor(ids[:need]).view(n_seq, seq_len)
    if int(out.max()) >= vocab_size:
        raise CalibrationError(
            f"the tokenizer in {str(tokenizer_dir)!r} gives token id {int(out.max())}, beyond "
            f"the model's vocab_size {vocab_size}"
        )
    return out
