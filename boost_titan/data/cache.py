"""Raw text a run names (``boost_corpus``, ``local_text``, a saved or registered dataset)
tokenized once into a cache, so that training has one reader: the tokenized corpus'
(``boost_titan.data.window_loader``).

The cache folder of a source is ``ROOT/<key>``, the key a digest of the source's
identity (where its files really are, symbolic links resolved, their sizes and
modification times, or a saved dataset's resolved folder and fingerprint; the holdout
rule and text field), the tokenizer's and the corpus format's version: another file,
edit, tokenizer or version is another folder, never a stale hit, and the same files
reached through a link are the same folder (no second tokenization). The same files
under another mount point are another key (tokenized once more): a key without the
path would have to trust sizes and times alone (two splits cut in the same second to
the same sizes would share one), or inode numbers, which differ between the nodes of a
cluster that share one cache. ``ROOT`` is ``[training]
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

from boost_titan.data.files import real
from boost_titan.data.local_text import CorpusError
from boost_titan.data.text_sources import FileText
from boost_titan.data.tokenize import tokenize, tokenizer_identity
from boost_titan.data.tokenized import (
    MANIFEST,
    VERSION,
    TokenizedCorpus,
    digest_of,
    open_corpus,
)

ENV_CACHE = "BOOST_TITAN_DATA_CACHE"


def cache_root(configured: str = "") -> str:
    return os.path.expanduser(
        configured or os.environ.get(ENV_CACHE) or "~/.cache/boost_titan/tokenized"
    )


def cache_key(source, tokenizer_dir: str) -> str:
    """The cache folder's name of ``source`` tokenized with ``tokenizer_dir`` (module
    docstring): where the files really are (symbolic links resolved), their sizes and
    modification times, the tokenizer's digest and the corpus format's version."""
    identity = source.identity()
    if isinstance(source, FileText):  # an edit in place at the same size is another key
        root = real(source.corpus.path)
        identity["files"] = [
            [os.path.relpath(real(f), root), st.st_size, st.st_mtime_ns]
            for f, st in ((f, os.stat(f)) for f in source.corpus.files)
        ]
    if os.path.exists(identity.get("path", "")):
        identity["path"] = real(identity["path"])
    tok = tokenizer_identity(tokenizer_dir)["digest"]
    return digest_of({"source": identity, "tokenizer": tok, "version": VERSION})[:20]


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
