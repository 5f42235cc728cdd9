"""Raw text a run names (``boost_corpus``, ``local_text``, a saved or registered dataset)
tokenized once into a cache, so that training has one reader: the tokenized corpus'
(``boost_titan.data.window_loader``).

The cache folder of a source is ``ROOT/<key>``, the key a digest of the source's
identity (paths, sizes and modification times of its files, or a saved dataset's
fingerprint; the holdout rule and text field) and the tokenizer's: another file, edit
or tokenizer is another folder, never a stale hit. ``ROOT`` is ``[training]
dataset_cache``, else ``$BOOST_TITAN_DATA_CACHE``, else ``~/.cache/boost_titan/tokenized``;
the embedded corpus' splits live in ``data/boost_corpus/tokenized`` (``make data`` fills
it). The first process to need a corpus tokenizes it (every core, a progress line)
under an exclusive ``flock`` of ``ROOT/<key>.lock``; the others wait on the lock and
then open what it wrote (the lock is the kernel's: a killed process never leaves it
held, and ``data tokenize`` resumes the parts it finished). A cached corpus that no
longer opens (damaged, or written by another version) is made again. A corpus too large to
tokenize at launch is tokenized beforehand with ``boost-titan data tokenize`` and read
with ``[training] dataset = "tokenized"``.
"""

from __future__ import annotations

import fcntl
import os
import shutil

from torchtitan.tools.logging import logger

from boost_titan.data.local_text import CorpusError
from boost_titan.data.text_sources import FileText
from boost_titan.data.tokenize import tokenize, tokenizer_identity
from boost_titan.data.tokenized import MANIFEST, TokenizedCorpus, digest_of, open_corpus

ENV_CACHE = "BOOST_TITAN_DATA_CACHE"


def cache_root(configured: str = "") -> str:
    return os.path.expanduser(
        configured or os.environ.get(ENV_CACHE) or "~/.cache/boost_titan/tokenized"
    )


def cache_key(source, tokenizer_dir: str) -> str:
    identity = source.identity()
    if isinstance(source, FileText):  # an edit in place at the same size is another key
        identity["mtimes"] = [os.stat(f).st_mtime_ns for f in source.corpus.files]
    tok = tokenizer_identity(tokenizer_dir)["digest"]
    return digest_of({"source": identity, "tokenizer": tok})[:20]


def ensure(source, tokenizer_dir: str, root: str, quiet: bool = False) -> TokenizedCorpus:
    """The tokenized corpus of ``source`` in the cache at ``root``, tokenized first if
    no process has yet (module docstring)."""
    key = cache_key(source, tokenizer_dir)
    out = os.path.join(root, key)
    if os.path.isfile(os.path.join(out, MANIFEST)):
        try:
            return open_corpus(out)
        except CorpusError:
            pass  # damaged, or written by another version: made again below
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, key + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when this process ends, however
        try:
            return open_corpus(out)  # another process made it while this one waited
        except CorpusError as e:
            if os.path.isfile(os.path.join(out, MANIFEST)):
                logger.warning(f"cached corpus {out} cannot be read ({e}); tokenizing it again")
                shutil.rmtree(out)
        tokenize(source, tokenizer_dir, out, quiet=quiet)
    return open_corpus(out)
