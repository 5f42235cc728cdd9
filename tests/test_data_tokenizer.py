"""``boost-titan data tokenizer``: a byte-level BPE trained on the user's own
files, streamed (boost_titan.data.user_tokenizer, over training's reader
boost_titan.data.local_text)."""

import json
import random
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest

from boost_titan.data import tokenizer, user_tokenizer
from boost_titan.data.cli import main

VOCAB = 600
ROUND_TRIP = [
    "Hello, world!  Ünïcödé — tabs\tand\n\nnewlines  ",
    "日本語 🙂 Ελληνικά",
    "",
    " ",
    "def f(x):\n    return {'a': [1, 2]}\n",
]


def _docs(n: int, seed: int) -> list[str]:
    """Deterministic English-like documents: 400 words, Zipf-distributed."""
    rng = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkjqxz"
    words = ["".join(rng.choices(letters, k=rng.randint(2, 8))) for _ in range(400)]
    weights = [1 / (i + 1) for i in range(len(words))]
    return [" ".join(rng.choices(words, weights, k=rng.randint(20, 60))) + "." for _ in range(n)]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Three jsonl files of 100 documents each, text in a ``content`` field."""
    root = tmp_path_factory.mktemp("user_corpus")
    docs = _docs(300, seed=1)
    for f in range(3):
        with open(root / f"part{f}.jsonl", "w") as fh:
            for i, doc in enumerate(docs[f * 100 : (f + 1) * 100]):
                fh.write(json.dumps({"id": i, "content": doc}) + "\n")
    return SimpleNamespace(root=root, docs=docs)


@pytest.fixture(scope="module")
def tok_dir(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "tokenizer"
    argv = ["tokenizer", "--from", str(corpus.root), "--text-field", "content"]
    assert main([*argv, "--vocab-size", str(VOCAB), "--out", str(out)]) == 0
    return out


def test_folder_specials_round_trip(tok_dir, corpus, capsys):
    from tokenizers import Tokenizer
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    assert sorted(p.name for p in tok_dir.iterdir()) == [
        "boost_tokenizer.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    raw = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert raw.get_vocab_size() == VOCAB
    assert raw.token_to_id(tokenizer.BOS_TOKEN) == 0 and raw.token_to_id(tokenizer.EOS_TOKEN) == 1
    hf = HuggingFaceTokenizer(str(tok_dir))
    assert (hf.bos_id, hf.eos_id) == (0, 1)
    for text in ROUND_TRIP + corpus.docs[:5]:
        ids = hf.encode(text)
        assert hf.decode(ids) == text
        assert hf.encode(text, add_bos=True, add_eos=True) == [0, *ids, 1]
    # the merges were learnt from this corpus: its 20 most frequent words are one token each
    counts = Counter(w for d in corpus.docs for w in d.rstrip(".").split())
    for word, _ in counts.most_common(20):
        assert len(raw.encode(" " + word).ids) == 1, word
    assert len(raw.encode(" zqxjkv").ids) > 1  # a word it never saw
    info = json.loads((tok_dir / "boost_tokenizer.json").read_text())
    assert info["read"]["docs"] == 300 and info["files"] == 3 and info["vocab_size"] == VOCAB


def test_streamed_equals_list_training(tok_dir, corpus):
    """Fed one document at a time from the files, the trainer learns exactly the
    tokenizer the embedded corpus' build gets from a list of the same texts."""
    from tokenizers import Tokenizer

    reference = tokenizer.train_tokenizer(list(corpus.docs), VOCAB)
    streamed = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    assert streamed.get_vocab() == reference.get_vocab()
    for doc in corpus.docs[:20]:
        assert streamed.encode(doc).ids == reference.encode(doc).ids


def test_loads_through_the_trainers_function(tok_dir):
    """The trainer builds its tokenizer with the TrainSpec's build_tokenizer_fn (torchtitan's
    build_hf_tokenizer) and checks its size against the flavor's vocab_size."""
    from torchtitan.protocols.train_spec import get_train_spec

    from boost_titan.models.args import _check_tokenizer_vocab
    from boost_titan.train.specs import register_all

    register_all()  # (importing the module registers nothing: the entry points call it)
    spec = get_train_spec("cola_llama2")
    job = SimpleNamespace(model=SimpleNamespace(hf_assets_path=str(tok_dir)))
    tok = spec.build_tokenizer_fn(job)
    assert tok.get_vocab_size() == VOCAB and (tok.bos_id, tok.eos_id) == (0, 1)
    _check_tokenizer_vocab(str(tok_dir), 8192)  # debugmodel's vocab: fits
    with pytest.raises(ValueError, match="has 600 tokens but the model's vocab_size is 599"):
        _check_tokenizer_vocab(str(tok_dir), 599)


def test_short_training_run(tok_dir, corpus, tmp_path):
    """Two steps of the debug model on the user's data with the user's tokenizer, and a
    validation pass (through boost_titan's validator) on every 4th document, held out."""
    from helpers import run_training

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"text": d}) + "\n" for d in corpus.docs))
    run = run_training(
        "debug_llama2.toml",
        1,
        tmp_path / "run",
        "--model.hf_assets_path",
        str(tok_dir),
        "--training.dataset",
        "local_text",
        "--training.dataset_path",
        str(data),
        "--training.steps",
        "2",
        "--training.dataset_holdout_every",
        "4",
        "--validation.dataset",
        "local_text_holdout",
        "--validation.steps",
        "1",
        "--checkpoint.no-enable",
    )
    losses = run.losses()
    assert run.val_loss, "no validation loss logged"
    assert len(losses) == 2
    # a fresh model predicts ~uniformly over the flavor's 8192 rows: loss ~ ln 8192 = 9.01
    assert 8.0 < losses[0] < 10.0


def test_formats_and_sampling(tmp_path):
    """The four formats give the same documents; a sample is spread over the files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = _docs(12, seed=2)
    fmt = tmp_path / "fmt"
    fmt.mkdir()
    (fmt / "a.jsonl").write_text("".join(json.dumps({"t": d}) + "\n" for d in docs[:3]))
    (fmt / "b.json").write_text(json.dumps([{"t": d} for d in docs[3:6]]))
    pq.write_table(pa.table({"t": docs[6:9], "n": [1, 2, 3]}), fmt / "c.parquet")
    for i, d in enumerate(docs[9:]):
        (fmt / f"d{i}.txt").write_text(d)
    (fmt / "README.md").write_text("not read")
    files = user_tokenizer.find_files(fmt)
    assert [f.name for f in files] == [
        "a.jsonl",
        "b.json",
        "c.parquet",
        "d0.txt",
        "d1.txt",
        "d2.txt",
    ]
    stats = user_tokenizer.ReadStats()
    assert list(user_tokenizer.iter_documents(files, "t", stats)) == docs
    assert (stats.docs, stats.files) == (12, 6)
    assert stats.bytes == sum(len(d.encode()) for d in docs)

    # 4 docs over 2 files of 3: 2 from each, from each file's start
    two = files[:2]
    stats = user_tokenizer.ReadStats()
    assert list(user_tokenizer.iter_documents(two, "t", stats, max_docs=4)) == docs[:2] + docs[3:5]
    # a byte budget of 1.5 documents per file: each file stops at its second document
    budget = len(docs[0].encode()) + len(docs[3].encode())
    got = list(
        user_tokenizer.iter_documents(two, "t", user_tokenizer.ReadStats(), max_bytes=budget)
    )
    assert got[0] == docs[0] and docs[3] in got and len(got) <= 4


def _error(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main(["tokenizer", *argv])
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("boost-titan data tokenizer: error: ")
    return err[-1]


def test_error_lines(corpus, tmp_path, capsys):
    out = str(tmp_path / "out")
    src = ["--from", str(corpus.root)]
    assert "'/nonexistent/x' does not exist" in _error(
        capsys, ["--from", "/nonexistent/x", "--vocab-size", "600", "--out", out]
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.md").write_text("x")
    assert "holds no .jsonl/.json/.txt/.parquet files (found ['.md'])" in _error(
        capsys, ["--from", str(empty), "--vocab-size", "600", "--out", out]
    )
    line = _error(capsys, [*src, "--vocab-size", "600", "--out", out])
    assert "part0.jsonl line 1 has no text field 'text' (fields: ['content', 'id'])" in line
    assert "--vocab-size 300 is too small: at least 512" in _error(
        capsys, [*src, "--text-field", "content", "--vocab-size", "300", "--out", out]
    )
    # 400 distinct words of <= 8 letters cannot make 20000 tokens
    line = _error(capsys, [*src, "--text-field", "content", "--vocab-size", "20000", "--out", out])
    assert "(300 docs, " in line and "fewer than --vocab-size 20000" in line
    assert not Path(out).exists()  # nothing written by a failed run
    Path(out).mkdir()
    (Path(out) / "keep.txt").write_text("x")
    assert "is not empty (['keep.txt']); pass --force" in _error(
        capsys, [*src, "--text-field", "content", "--vocab-size", "600", "--out", out]
    )
