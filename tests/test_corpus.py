"""Tests for the embedded corpus + tokenizer (boost_titan.data)."""

import dataclasses
import json
import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from boost_titan.data import tokenizer
from boost_titan.data.corpus import build, clean, fetch, loaders, manifest, sources, split

REPO_ROOT = Path(__file__).resolve().parents[1]
CACHE_DIR = REPO_ROOT / "data" / ".downloads"

ROUND_TRIP_TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Fellow-Citizens of the Senate and House of Representatives:",
    "naïve café — Übergrößenträger, 日本語のテキスト, emoji 🙂🚀, Ελληνικά, עברית",
    "  leading spaces\ttabs\t\tand\n\n\nmany\r\nnewlines   \n\n  trailing  ",
    "",
    " ",
    "\n",
    "x" * 1000 + " " * 17 + "\u00a0\u2009\u3000",
    "def f(x):\n    return {'a': [1, 2, 3]}  # code-ish\n",
]


def _manifest(path):
    return json.loads((path / manifest.MANIFEST_NAME).read_text())


def test_manifest_layout(corpus_dir):
    m = _manifest(corpus_dir)
    assert m["format_version"] == manifest.FORMAT_VERSION
    assert m["vocab_size"] == tokenizer.DEFAULT_VOCAB_SIZE == 8192
    assert set(m["sources"]) == set(sources.SOURCES)
    for name, src in sources.SOURCES.items():
        s = m["sources"][name]
        assert s["pin"] == src.pin()
        assert s["docs"] == s["train_docs"] + s["val_docs"] > 0
        assert s["bytes"] > 500_000
    assert m["train"]["docs"] == sum(s["train_docs"] for s in m["sources"].values())
    assert m["validation"]["docs"] == sum(s["val_docs"] for s in m["sources"].values())
    assert m["train"]["bytes"] > 25_000_000
    assert 3.0 < m["validation"]["bytes_per_token"] < 5.0
    assert set(m["content_hashes"]) == {"train_texts", "validation_texts", "tokenizer_json"}
    assert m["content_hashes"]["tokenizer_json"] == fetch.sha256_file(
        corpus_dir / "tokenizer" / "tokenizer.json"
    )
    assert "_built_now" not in m
    assert manifest.corpus_is_ready(corpus_dir)
    assert manifest.corpus_is_ready(corpus_dir, tokenizer.DEFAULT_VOCAB_SIZE)
    assert not manifest.corpus_is_ready(corpus_dir, 4096)


def test_tokenizer_round_trip(corpus_dir):
    from tokenizers import Tokenizer
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tok_dir = corpus_dir / "tokenizer"
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    hf = HuggingFaceTokenizer(str(tok_dir))
    assert hf.bos_id == 0 and hf.eos_id == 1
    assert raw.token_to_id(tokenizer.BOS_TOKEN) == 0 and raw.token_to_id(tokenizer.EOS_TOKEN) == 1
    assert hf.get_vocab_size() == raw.get_vocab_size() == tokenizer.DEFAULT_VOCAB_SIZE

    for text in ROUND_TRIP_TEXTS:
        ids = raw.encode(text).ids
        assert raw.decode(ids) == text
        assert hf.decode(hf.encode(text)) == text
        assert hf.encode(text) == ids  # no implicit BOS/EOS
        wrapped = hf.encode(text, add_bos=True, add_eos=True)
        assert wrapped == [0, *ids, 1]
        assert all(0 <= i < tokenizer.DEFAULT_VOCAB_SIZE for i in wrapped)

    # common corpus words are single tokens
    assert len(raw.encode("And God said, Let there be light: and there was light.").ids) <= 16


def test_split_is_by_whole_documents(corpus_dir):
    import datasets

    train = datasets.load_from_disk(str(corpus_dir / "train"))
    val = datasets.load_from_disk(str(corpus_dir / "validation"))
    for ds in (train, val):
        assert ds.column_names == ["text", "source", "doc_id"]
        keys = list(zip(ds["source"], ds["doc_id"]))
        assert keys == sorted(keys)
        assert len(set(keys)) == len(keys)
        assert all(t and t == t.strip() for t in ds["text"])
    m = _manifest(corpus_dir)
    assert len(train) == m["train"]["docs"] and len(val) == m["validation"]["docs"]

    assert not set(train["doc_id"]) & set(val["doc_id"])
    assert not set(zip(train["source"], train["doc_id"])) & set(zip(val["source"], val["doc_id"]))
    val_sources = set(val["source"])
    for name, s in m["sources"].items():
        if s["docs"] >= split.MIN_DOCS_FOR_FORCED_VAL:
            assert name in val_sources, name
            assert s["val_docs"] >= 1
    assert 0.005 < len(val) / (len(train) + len(val)) < 0.05


def test_second_call_does_no_work(corpus_dir, monkeypatch, caplog):
    def boom(*args, **kwargs):
        raise AssertionError("build work done on an up-to-date corpus")

    for module, name in (
        (fetch, "fetch_artifact"),
        (fetch, "download_artifact"),
        (tokenizer, "train_tokenizer"),
        (loaders, "load_source"),
        (build, "_build_into"),
    ):
        monkeypatch.setattr(module, name, boom)
    caplog.set_level(logging.INFO, logger=build.logger.name)
    m = build.build_corpus(corpus_dir)  # (any build work raises: the patches above)
    assert m["_built_now"] is False
    assert m["content_hashes"] == _manifest(corpus_dir)["content_hashes"]
    assert "corpus up to date" in caplog.text


def test_build_is_deterministic(corpus_dir, tmp_path):
    out = tmp_path / "corpus"
    m = build.build_corpus(out, force=True, cache_dir=CACHE_DIR)
    assert m["_built_now"] is True
    ref = _manifest(corpus_dir)
    assert m["content_hashes"] == ref["content_hashes"]
    assert (out / "tokenizer" / "tokenizer.json").read_bytes() == (
        corpus_dir / "tokenizer" / "tokenizer.json"
    ).read_bytes()
    assert _manifest(out)["content_hashes"] == ref["content_hashes"]
    assert (
        sorted(p.name for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name) == []
    )


def test_sha256_mismatch_raises_and_leaves_nothing(corpus_dir, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    for src in sources.SOURCES.values():
        shutil.copyfile(CACHE_DIR / src.filename, cache / src.filename)
    name = "kjv"
    bad = "0" * 64
    monkeypatch.setitem(
        sources.SOURCES, name, dataclasses.replace(sources.SOURCES[name], sha256=bad)
    )

    def no_download(*args, **kwargs):
        raise AssertionError("cached artifact should be verified, not re-downloaded")

    monkeypatch.setattr(fetch, "download_artifact", no_download)
    out = tmp_path / "out"
    with pytest.raises(sources.CorpusBuildError) as excinfo:
        build.build_corpus(out, cache_dir=cache)
    msg = str(excinfo.value)
    assert sources.SOURCES[name].filename in msg
    assert bad in msg
    assert fetch.sha256_file(cache / sources.SOURCES[name].filename) in msg
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.tmp-")] == []


def test_cli_info(corpus_dir):
    proc = subprocess.run(
        [sys.executable, "-m", "boost_titan.cli", "data", "info", "--out", str(corpus_dir)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "bytes/token" in proc.stdout and "kjv" in proc.stdout


def test_brown_detokenize():
    tagged = (
        "``/`` Only/rb a/at handful/nn ''/'' ,/, the/at jury/nn said/vbd ;/. ;/. "
        "(/( see/vb 1-1/2/cd )/) it's/pps+bez done/vbn ?/. ?/."
    )
    assert (
        loaders.brown_detokenize(tagged)
        == '"Only a handful", the jury said; (see 1-1/2) it\'s done?'
    )


def test_clean_text():
    raw = "\ufeffTitle  \r\n\r\n\r\n\r\n\r\nBody\x07 text\t \rend\n\n\n\n\n\n"
    assert clean.clean_text(raw) == "Title\n\n\nBody text\nend"
    gut = (
        "junk\n*** START OF THE PROJECT GUTENBERG EBOOK X ***\nreal text\n"
        "*** END OF THE PROJECT GUTENBERG EBOOK X ***\nlicense"
    )
    assert clean.clean_text(gut) == "real text"


def test_split_rule_is_deterministic():
    docs = [clean.Doc("s", f"d{i:03d}", "t") for i in range(200)]
    train, val = split.split_documents(docs)
    train2, val2 = split.split_documents(list(reversed(docs)))
    assert [d.doc_id for d in val] == [d.doc_id for d in val2] and len(train) == len(train2)
    assert 1 <= len(val) <= 12
    few = [clean.Doc("few", f"d{i}", "t") for i in range(10)]
    assert len(split.split_documents(few)[1]) >= 1
