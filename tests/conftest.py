from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The embedded corpus at <repo>/data/boost_corpus, built once (default vocab) if needed."""
    from boost_titan.data import build_corpus

    out = REPO_ROOT / "data" / "boost_corpus"
    build_corpus(out)
    return out
