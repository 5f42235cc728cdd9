from pathlib import Path

import pytest

from boost_titan import cpu_runtime

# CPU shims before any test module imports torchtitan (which fixes its device at import):
# collection order must not decide whether in-process tests run
cpu_runtime.activate()

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The embedded corpus at <repo>/data/boost_corpus, built once (default vocab) if needed."""
    from boost_titan.data import build_corpus

    out = REPO_ROOT / "data" / "boost_corpus"
    build_corpus(out)
    return out
