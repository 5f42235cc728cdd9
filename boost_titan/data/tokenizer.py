"""The corpus tokenizer: byte-level BPE, BOS/EOS as ids 0/1, trained on the embedded
corpus' train split (``build``) or on a user's files (``boost-titan data
tokenizer``), and the folder both write (what ``[model] hf_assets_path`` reads)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from boost_titan.data.corpus.sources import CorpusBuildError

DEFAULT_VOCAB_SIZE = 8192
MIN_VOCAB_SIZE = 512
BOS_TOKEN = "<|begin_of_text|>"
EOS_TOKEN = "<|end_of_text|>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN)  # ids 0 and 1


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, length: int | None = None, show_progress: bool = False
):
    """Byte-level BPE (GPT-2 style) trained on ``texts``; ids 0/1 are BOS/EOS.

    ``texts`` may be any iterator: the trainer consumes it once, keeping word counts, not
    the texts (``length``, when known, only sizes the progress bar)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    if length is None and isinstance(texts, list | tuple):
        length = len(texts)
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return tok


def tokenizer_config() -> dict[str, Any]:
    return {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
    }


def write_tokenizer(tok, tok_dir: Path) -> None:
    """The files torchtitan's ``HuggingFaceTokenizer`` reads: ``tokenizer.json`` and
    ``tokenizer_config.json`` (BOS/EOS names, no implicit BOS/EOS)."""
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(), indent=2) + "\n")


def check_tokenizer(tok_dir: Path, vocab_size: int) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    problems = []
    if tok.get_vocab_size() != vocab_size:
        problems.append(
            f"vocab size {tok.get_vocab_size()} != {vocab_size} (corpus too small for this vocab?)"
        )
    if tok.token_to_id(BOS_TOKEN) != 0 or tok.token_to_id(EOS_TOKEN) != 1:
        problems.append("special token ids are not BOS=0, EOS=1")
    sample = "Hello, world!  Ünïcödé \u2014 tabs\tand\n\nnewlines  "
    if tok.decode(tok.encode(sample).ids) != sample:
        problems.append("round trip failed")
    if problems:
        raise CorpusBuildError("trained tokenizer is invalid: " + "; ".join(problems))
