"""Embedded English corpus and byte-level BPE tokenizer (see :mod:`boost_titan.data.corpus`)."""

from boost_titan.data.corpus import (  # noqa: F401
    DEFAULT_VOCAB_SIZE,
    SOURCES,
    CorpusBuildError,
    build_corpus,
    corpus_is_ready,
    default_corpus_dir,
    read_manifest,
)
