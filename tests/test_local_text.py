"""Your own corpus (``dataset = "local_text"``): streamed from its files with no cache
copy, read in the global order for training (every rank reads every file:
``boost_titan.data.order``, its resume at other dp degrees in test_global_order.py and
test_layout_resume.py) and sharded over data-parallel ranks by file or by sample for
validation, resumed bitwise at dp 2, its text field and the start-up refusals, and
validation on held-out files.

Every corpus here is generated in ``tmp_path`` (a few KB). Without processes: what the
loaders read (against the documents written), the validation sharding, the holdouts,
a resume over changed files refused, the config-check errors. Real runs (3 launches, 2
gloo ranks, FSDP2, 4 steps, a checkpoint at step 2): a folder corpus with one file held
out for validation, resumed from step 2 and compared bitwise with the uninterrupted run
(re-loops of the corpus on both sides of the checkpoint), and a one-file corpus with
every 4th document held out, validated by sample."""

from __future__ import annotations

import json
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import REPO_ROOT, run_training

from boost_titan.data import local_text
from boost_titan.data.local_text import (
    CorpusError,
    check_corpus,
    find_corpus,
    split_every,
    split_holdout,
)

TOKENIZER = str(REPO_ROOT / "data" / "boost_corpus" / "tokenizer")
WORDS = (
    "the a river stone light model train data city north small old quiet green market "
    "window paper letter music winter summer garden bridge road morning evening"
).split()


def _docs(seed: int, n: int, words: int = 60) -> list[str]:
    rng = random.Random(seed)
    return [
        f"doc {seed}.{i}: "
        + " ".join(rng.choice(WORDS) for _ in range(rng.randint(words // 2, words)))
        for i in range(n)
    ]


def _write(path: Path, kind: str, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "jsonl":
        path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    elif kind == "json":  # a top-level array
        path.write_text(json.dumps([{field: d} for d in docs]))
    elif kind == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({field: docs}), path)
    elif kind == "txt":
        assert len(docs) == 1
        path.write_text(docs[0])
    return path


def _read(corpus) -> list[str]:
    return [d["text"] for d in local_text.stream(corpus)]


# ---------------------------------------------------------------------------------------
# Streaming: every format, no copy in the datasets cache


def test_every_format_streams_its_documents_without_a_cache_copy(tmp_path, monkeypatch):
    import datasets

    cache = tmp_path / "hf_cache"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    a, b = _docs(1, 5), _docs(2, 4)
    cases = {
        "jsonl": (_write(tmp_path / "c.jsonl", "jsonl", a), a),
        "json": (_write(tmp_path / "c.json", "json", a), a),
        "parquet": (_write(tmp_path / "c.parquet", "parquet", a), a),
        "txt": (_write(tmp_path / "c.txt", "txt", a[:1]), a[:1]),
    }
    # a folder: recursive, path order, hidden files skipped
    _write(tmp_path / "folder" / "b" / "x.jsonl", "jsonl", b)
    _write(tmp_path / "folder" / "a.jsonl", "jsonl", a)
    _write(tmp_path / "folder" / ".hidden" / "y.jsonl", "jsonl", ["never read"])
    (tmp_path / "folder" / "README").write_text("not a corpus file")
    txt = [_write(tmp_path / "txts" / f"{i}.txt", "txt", [d]) for i, d in enumerate(b)]
    cases["folder"] = (tmp_path / "folder", a + b)
    cases["txt folder"] = (tmp_path / "txts", b)
    for name, (path, expected) in cases.items():
        corpus = find_corpus(str(path))
        check_corpus(corpus)
        assert corpus.streamed, name
        assert _read(corpus) == expected, name
    assert find_corpus(str(tmp_path / "txts")).files == tuple(map(str, txt))
    arrow = [p for p in cache.rglob("*") if p.suffix == ".arrow"]
    assert arrow == [], arrow
    # the reference: what local_text did before (load_dataset without streaming) writes
    # an Arrow copy of the corpus into the same cache
    datasets.load_dataset("json", data_files=[str(tmp_path / "c.jsonl")], split="train")
    assert [p for p in cache.rglob("*") if p.suffix == ".arrow"]


def test_a_json_array_is_streamed_element_by_element(tmp_path, monkeypatch):
    """A corpus that is one top-level JSON array is read one element at a time: the same
    documents as ``json.load`` (elements, numbers and UTF-8 split across the reader's
    chunks), the first ones yielded before a bad element far into the file is reached
    (a whole-file parse would fail before yielding any), and every malformed array one
    line naming the file."""
    monkeypatch.setattr(local_text, "_ARRAY_CHUNK", 7)  # elements span many chunks
    docs = _docs(5, 40) + ["é∑ unicode", ""]
    path = tmp_path / "a.json"
    items = [{"text": d, "n": 12345678901, "x": [1.5, {"y": None}]} for d in docs]
    for sep in (",", ", \n", "\n,\n  "):
        path.write_text(
            " \n[" + sep.join(json.dumps(x, ensure_ascii=False) for x in items) + " ]\n"
        )
        assert list(local_text.read_documents(path, "text")) == [
            x["text"] for x in json.loads(path.read_text())
        ]
    path.write_text("[" + ",".join(json.dumps({"text": d}) for d in docs[:3]) + ', {"text": ]')
    reader = local_text.read_documents(path, "text")
    assert [next(reader) for _ in range(3)] == docs[:3]
    with pytest.raises(
        CorpusError, match=rf"^local_text: {re.escape(str(path))} is not valid JSON"
    ):
        next(reader)
    for bad, why in (
        ("[", "Expecting value"),
        ('[{"text": "a"} {"text": "b"}]', "expected ',' or ']' after item"),
        ('[{"text": "a"},]', "Expecting value"),
        ('[{"text": "a"}', "expected ',' or ']' after item, found the end of the file"),
        ('[{"text": "a"}] x', "more after the array's closing ']'"),
    ):
        path.write_text(bad)
        with pytest.raises(CorpusError, match=re.escape(why)):
            list(local_text.read_documents(path, "text"))
    for empty in ("[]", " [ \n ] "):
        path.write_text(empty)
        assert list(local_text.read_documents(path, "text")) == []


def test_training_and_the_tokenizer_read_files_alike(tmp_path):
    """One reader: the tokenizer command finds the files training finds (hidden files
    and folders skipped) and reads the documents training reads (an empty .txt holds
    none)."""
    from boost_titan.data import user_tokenizer

    root = tmp_path / "corpus"
    _write(root / "a.jsonl", "jsonl", _docs(1, 3))
    _write(root / "b" / "c.jsonl", "jsonl", _docs(2, 2))
    _write(root / ".cache" / "d.jsonl", "jsonl", _docs(3, 2))  # a tool's folder
    _write(root / ".e.jsonl", "jsonl", _docs(4, 1))  # an editor's file
    (root / "empty.jsonl").write_text("\n")
    corpus = find_corpus(str(root))
    assert [Path(f).name for f in corpus.files] == ["a.jsonl", "c.jsonl", "empty.jsonl"]
    assert user_tokenizer.find_files(root) == [Path(f) for f in corpus.files]
    stats = user_tokenizer.ReadStats()
    docs = list(user_tokenizer.iter_documents([Path(f) for f in corpus.files], "text", stats))
    assert docs == _read(corpus) == _docs(1, 3) + _docs(2, 2)
    txt = tmp_path / "txt"
    _write(txt / "a.txt", "txt", ["one document"])
    (txt / "b.txt").write_text("")
    files = user_tokenizer.find_files(txt)
    assert list(user_tokenizer.iter_documents(files, "text", user_tokenizer.ReadStats())) == [
        "one document"
    ]
    assert list(local_text.documents([str(f) for f in files], "text", "text")) == [
        {"text": "one document"}
    ]


def test_a_saved_dataset_stays_map_style(tmp_path):
    from datasets import Dataset

    Dataset.from_dict({"text": _docs(3, 5)}).save_to_disk(str(tmp_path / "saved"))
    Dataset.from_dict({"body": _docs(4, 2)}).save_to_disk(str(tmp_path / "body"))
    body = find_corpus(str(tmp_path / "body"), "body")
    check_corpus(body)
    first = next(iter(_dataset(body, 0, world=1, seq_len=4)))[0]["input"].tolist()
    assert first == _tokenizer().encode(_docs(4, 2)[0], add_bos=True, add_eos=True)[:4]
    with pytest.raises(
        CorpusError, match=r"body \(every row\) has no text field 'text' \(fields: \['body'\]\)"
    ):
        check_corpus(find_corpus(str(tmp_path / "body")))
    corpus = find_corpus(str(tmp_path / "saved"))
    check_corpus(corpus)
    assert not corpus.streamed and corpus.kind == "saved"
    from datasets import Dataset as MapStyle

    from boost_titan.data.loader import describe_share

    assert describe_share(corpus, "local_text", 5, 1, 2) == (
        f"local_text: {tmp_path / 'saved'}: a save_to_disk folder of 5 documents (text field "
        "'text'), map-style (memory-mapped Arrow, no copy), sharded by document range over 2 "
        "data-parallel ranks: rank 1 reads documents 3..4"
    )
    ds = _dataset(corpus, 1)
    assert isinstance(ds._data, MapStyle) and ds._data["text"] == _docs(3, 5)[3:]
    assert next(iter(ds))[0]["input"].shape == (16,)


def test_text_field(tmp_path):
    docs = _docs(4, 3)
    path = _write(tmp_path / "c.jsonl", "jsonl", docs, field="content")
    assert _read(find_corpus(str(path), "content")) == docs
    with pytest.raises(CorpusError) as e:
        check_corpus(find_corpus(str(path)))
    assert str(e.value) == (
        f"local_text: {path} line 1 has no text field 'text' (fields: ['content', 'id']); "
        "set [training] dataset_text_field to the field holding the document text "
        "(--text-field for `boost-titan data tokenizer`)"
    )
    # a later document without it stops the stream with the same line
    path.write_text(path.read_text() + json.dumps({"body": "x"}) + "\n")
    with pytest.raises(CorpusError, match=rf"^local_text: {re.escape(str(path))} line 4 has no "):
        _read(find_corpus(str(path), "content"))
    pq = _write(tmp_path / "c.parquet", "parquet", docs, field="body")
    with pytest.raises(
        CorpusError, match=r"c.parquet row 0 has no text field 'text' \(fields: \['body'\]\)"
    ):
        check_corpus(find_corpus(str(pq)))


# ---------------------------------------------------------------------------------------
# Sharding over data-parallel ranks, the log line, exact resume after re-loops


def _tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(TOKENIZER)


def _dataset(corpus, rank, world=2, seq_len=16):
    from boost_titan.data.loader import LocalTextDataset

    return LocalTextDataset("local_text", corpus, _tokenizer(), seq_len, rank, world, True)


def _share(corpus, rank, world=2) -> list[str]:
    from datasets.distributed import split_dataset_by_node

    return [d["text"] for d in split_dataset_by_node(local_text.stream(corpus), rank, world)]


def test_sharding_by_file_or_by_sample(tmp_path):
    from boost_titan.data.loader import describe_share

    per_file = [_docs(10 + i, 3) for i in range(4)]
    for i, docs in enumerate(per_file):
        _write(tmp_path / "four" / f"p{i}.jsonl", "jsonl", docs)
    four = find_corpus(str(tmp_path / "four"))
    # by file: rank r reads files r, r + 2
    assert _share(four, 0) == per_file[0] + per_file[2]
    assert _share(four, 1) == per_file[1] + per_file[3]
    assert describe_share(four, "local_text", None, 1, 2) == (
        f"local_text: {tmp_path / 'four'}: 4 .jsonl files (json, text field 'text'), streamed "
        "(read as training consumes them, no cache copy), sharded by file over 2 "
        f"data-parallel ranks (4 files divide by 2): rank 1 reads 2 files (p1.jsonl, p3.jsonl)"
    )
    # by sample: 3 files over 2 ranks, every rank reads all and keeps every 2nd document
    three = find_corpus(str(tmp_path / "four"))
    three = local_text.Corpus(three.path, three.kind, three.files[:3])
    every = [d for f in per_file[:3] for d in f]
    assert _share(three, 0) == every[0::2] and _share(three, 1) == every[1::2]
    assert describe_share(three, "local_text", None, 0, 2).endswith(
        "sharded by sample over 2 data-parallel ranks (3 files do not divide by 2): rank 0 "
        "reads all 3 files and keeps every 2nd document from the 1st"
    )


def _tokens(docs: list[str]) -> list[int]:
    tok = _tokenizer()
    return [t for d in docs for t in tok.encode(d, add_bos=True, add_eos=True)]


def _packed_batches(docs: list[str], seq_len: int, batch: int) -> list[list[list[int]]]:
    """torchtitan's packing, written out: documents' tokens (BOS/EOS) concatenated and
    cut into seq_len + 1 windows; the labels (window[1:]) in batches of ``batch``."""
    tokens, n = _tokens(docs), seq_len + 1
    labels = [tokens[i : i + n][1:] for i in range(0, len(tokens) - n + 1, n)]
    return [labels[i : i + batch] for i in range(0, len(labels), batch)]


def _loader(corpus, rank, world, workers, infinite=True, seq_len=16):
    """The validation loader of ``boost_titan.data.loader`` (a rank's share)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from boost_titan.data.loader import LocalTextDataset

    tok = _tokenizer()
    ds = LocalTextDataset("local_text", corpus, tok, seq_len, rank, world, infinite, workers)
    return ParallelAwareDataloader(
        ds, dp_rank=rank, dp_world_size=world, batch_size=2, num_workers=workers
    )


def _take(it, n: int) -> list:
    return [next(it)[1].tolist() for _ in range(n)]


def _workers_corpora(tmp_path):
    """(corpus, dp world, the documents of each file): by file (4 files over 2 ranks:
    one file per worker), by sample (3 files over 2 ranks: files 0, 2 and 1 per
    worker), one rank (2 files per worker)."""
    per_file = [_docs(60 + i, 3 + i, words=12) for i in range(4)]
    for i, docs in enumerate(per_file):
        _write(tmp_path / "w" / f"p{i}.jsonl", "jsonl", docs)
    four = find_corpus(str(tmp_path / "w"))
    three = local_text.Corpus(four.path, four.kind, four.files[:3])
    return [(four, 2, per_file), (three, 2, per_file[:3]), (four, 1, per_file)]


def test_validation_workers_read_each_document_once(tmp_path):
    """[validation.dataloader] num_workers = 2 over the stream (each rank its share):
    (a) one pass (infinite = False) is each worker's files read once, round-robin by
    batch, against the packing written out here from the documents (each worker reads
    files w, w + 2, ... of its rank's files; by sample it keeps every dp-th document of
    its own stream); (c) the same endless loader (validation with ``steps`` set) twice
    gives the same batches, re-loops included. Before LocalTextDataset kept its epoch
    per process, (c) failed for one rank (the workers shared datasets' epoch)."""
    from boost_titan.data.loader import describe_share

    for corpus, world, per_file in _workers_corpora(tmp_path):
        by_file = len(per_file) % world == 0
        read = []  # every document each worker of each rank reads in one pass
        for rank in range(world):
            files = per_file[rank::world] if by_file else per_file
            streams = []
            for w in range(2):
                docs = [d for f in files[w::2] for d in f]
                docs = docs if by_file else docs[rank::world]
                read += docs
                streams.append(_packed_batches(docs, 16, 2))
            expected = []
            for i in range(max(map(len, streams))):  # round-robin, then the longer one
                expected += [s[i] for s in streams if i < len(s)]
            one_pass = [b[1].tolist() for b in _loader(corpus, rank, world, 2, infinite=False)]
            assert one_pass == expected, (world, rank)
            n = 40  # several passes of each worker's files
            reference = _take(iter(_loader(corpus, rank, world, 2)), n)
            assert _take(iter(_loader(corpus, rank, world, 2)), n) == reference  # (c)
        assert describe_share(corpus, "local_text", None, world - 1, world, 2).endswith(
            {
                (2, True): "rank 1 reads 2 files (p1.jsonl, p3.jsonl), in 2 DataLoader workers "
                "(worker w reads the rank's files w, w + 2, ...; batches from each in turn)",
                (2, False): "rank 1 reads all 3 files and keeps every 2nd document from the "
                "2nd, in 2 DataLoader workers (worker w reads the rank's files w, w + 2, ..., "
                "each keeping every 2nd document of its own files from the 2nd; batches from "
                "each in turn)",
                (1, True): "rank 0 reads every file, in 2 DataLoader workers (worker w reads "
                "the rank's files w, w + 2, ...; batches from each in turn)",
            }[world, by_file]
        )
        # (a) over the data-parallel group: every document once, none missing
        assert sorted(read) == sorted(d for f in per_file for d in f), world


def _training_loader(corpus, world=1):
    """The training loader (the global order) of rank 0 of ``world``, local batch 2."""
    from boost_titan.data.fingerprint import fingerprint
    from boost_titan.data.global_loader import GlobalOrderLoader
    from boost_titan.data.sources import FileSource

    return GlobalOrderLoader(
        "local_text", FileSource("local_text", corpus), _tokenizer(), seq_len=16,
        local_batch_size=2, dp_rank=0, dp_world_size=world, fingerprint=fingerprint(corpus),
    )  # fmt: skip


def test_resume_over_changed_files_is_refused_in_one_line(tmp_path):
    """A saved position records its files (names, sizes) and the holdout; a resume over
    other files stops with one line naming the change (a SystemExit: no traceback per
    rank). The same files copied elsewhere (new path, new mtimes) resume exactly, at
    another data-parallel degree too."""
    from boost_titan.checkpoint.data_position import DataResumeError
    from boost_titan.data.fingerprint import KEY

    root = tmp_path / "c"
    for i in range(4):
        _write(root / f"p{i}.jsonl", "jsonl", _docs(70 + i, 3, words=12))
    corpus = find_corpus(str(root))
    reference = _take(iter(_training_loader(corpus)), 12)
    loader = _training_loader(corpus, world=2)
    _take(iter(loader), 5)  # 20 windows (dp 2): rank 0's batches 0, 2, ...
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    assert pickle.loads(state["position"])[KEY] == {
        "dataset": "local_text",
        "files": [[f"p{i}.jsonl", (root / f"p{i}.jsonl").stat().st_size] for i in range(4)],
        "holdout_every": 0,
    }

    def resume(folder, state, *, every=0):
        c = find_corpus(str(folder))
        c = split_every(c, every)[0] if every else c
        loader = _training_loader(c)
        loader.load_state_dict(pickle.loads(pickle.dumps(state)))
        return _take(iter(loader), 2)

    copy = tmp_path / "copy"  # another path, new mtimes: the same position
    copy.mkdir()
    for f in root.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    assert resume(copy, state) == reference[10:12]

    def changed(edit) -> str:
        folder = tmp_path / f"edit{len(list(tmp_path.iterdir()))}"
        shutil.copytree(root, folder)
        every = edit(folder)  # an int: the new dataset_holdout_every
        with pytest.raises(DataResumeError) as e:
            resume(folder, state, every=every if isinstance(every, int) else 0)
        assert isinstance(e.value, SystemExit)
        return str(e.value)

    size = (root / "p2.jsonl").stat().st_size

    more = json.dumps({"text": "one more"}) + "\n"

    def grow(folder):
        with open(folder / "p2.jsonl", "a") as f:
            f.write(more)

    line = changed(grow)
    folder = tmp_path / "edit2"
    assert line == (
        f"local_text: the checkpoint's data position was saved over other files than "
        f"dataset_path {str(folder)!r} holds now (p2.jsonl was {size} bytes at the "
        f"checkpoint, now {size + len(more)}; 4 training files at the checkpoint, 4 now): "
        "the saved position (file index and documents read in it) would resume at the wrong place; "
        "resume with the same files, or keep the model, optimizer and step and restart the "
        "data from its first document with --checkpoint.exclude_from_loading dataloader"
    )
    assert "1 file(s) added: p4.jsonl;" in changed(
        lambda f: _write(f / "p4.jsonl", "jsonl", _docs(9, 2))
    )
    assert "(1 file(s) gone: p3.jsonl;" in changed(lambda f: (f / "p3.jsonl").unlink())
    assert "(1 file(s) gone: p1.jsonl; 1 file(s) added: q1.jsonl;" in changed(
        lambda f: (f / "p1.jsonl").rename(f / "q1.jsonl")
    )
    assert "[training] dataset_holdout_every was 0 at the checkpoint, now 3;" in changed(
        lambda f: 3
    )


def test_an_empty_share_stops_in_one_line(tmp_path):
    """One document over 2 ranks (by sample): rank 1 has nothing and would loop forever."""
    path = _write(tmp_path / "one.jsonl", "jsonl", _docs(5, 1))
    with pytest.raises(
        CorpusError, match=r"this data-parallel rank's share of the corpus holds no document"
    ):
        next(iter(_dataset(find_corpus(str(path)), 1)))


def test_holdout_files_are_disjoint_from_training(tmp_path):
    docs = [_docs(30 + i, 3) for i in range(5)]
    for i, d in enumerate(docs):
        _write(tmp_path / "c" / f"p{i}.parquet", "parquet", d)
    train, held = split_holdout(find_corpus(str(tmp_path / "c")), 2)
    read_train, read_held = _read(train), _read(held)
    assert read_held == docs[3] + docs[4]
    assert not set(read_train) & set(read_held)
    assert sorted(read_train + read_held) == sorted(d for f in docs for d in f)
    # every 3rd document of each file: the 3rd, 6th, ... (a one-file corpus too)
    train, held = split_every(find_corpus(str(tmp_path / "c")), 3)
    assert train.files == held.files
    read_train, read_held = _read(train), _read(held)
    assert read_held == [d for f in docs for d in f[2::3]]
    assert read_train == [d for f in docs for i, d in enumerate(f) if i % 3 != 2]


# ---------------------------------------------------------------------------------------
# Start-up refusals: one line each, before the model is built (the config check)


def _check(*overrides: str) -> None:
    from boost_titan.train.config_check import check_config, parse_config

    argv = [
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / "debug_llama2.toml"),
        "--training.dataset",
        "local_text",
        *overrides,
    ]
    check_config(parse_config(argv), world_size=1)


def test_startup_refusals(tmp_path):
    good = tmp_path / "good"
    for i in range(3):
        _write(good / f"p{i}.jsonl", "jsonl", _docs(40 + i, 2))
    _check("--training.dataset_path", str(good), "--validation.no-enable")  # accepted
    _check(  # 3 files, 2 DataLoader workers
        "--training.dataset_path", str(good), "--validation.no-enable",
        "--training.dataloader.num_workers", "2",
    )  # fmt: skip
    for holdout in ("--training.dataset_holdout_files", "--training.dataset_holdout_every"):
        _check(  # holdout + validation on it: the same files, disjoint documents
            "--training.dataset_path", str(good), holdout, "2",
            "--validation.dataset", "local_text_holdout",
        )  # fmt: skip
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text("")
    (empty / "b.jsonl").write_text("\n\n")
    some_empty = tmp_path / "some_empty"
    _write(some_empty / "a.jsonl", "jsonl", _docs(1, 2))
    (some_empty / "b.jsonl").write_text("")
    mixed = tmp_path / "mixed"
    _write(mixed / "a.jsonl", "jsonl", _docs(1, 2))
    _write(mixed / "b.parquet", "parquet", _docs(2, 2))
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "notes.csv").write_text("a,b\n")
    field = _write(tmp_path / "field.jsonl", "jsonl", _docs(1, 2), field="body")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": \n{"text": "ok"}\n')
    # one file, 2 DataLoader workers: the workers tokenize chunks of the one stream in
    # turn (a worker read whole files of a rank's shard before the global order: refused)
    _check("--training.dataset_path", str(field), "--training.dataset_text_field", "body",
           "--validation.no-enable", "--training.dataloader.num_workers", "2")  # fmt: skip
    cases = [
        (
            ("--training.dataset_path", str(field), "--validation.no-enable"),
            f"[training] dataset_path = '{field}' (local_text): {field} line 1 has no text "
            "field 'text' (fields: ['body', 'id']); set [training] dataset_text_field to the "
            "field holding the document text (--text-field for `boost-titan data tokenizer`)",
        ),
        (
            ("--training.dataset_path", str(nothing), "--validation.no-enable"),
            f"[training] dataset_path = '{nothing}' (local_text): folder '{nothing}' holds no "
            ".json/.jsonl/.parquet/.txt files (1 other files: .csv); point dataset_path at a "
            "file or folder of one of these formats, or a save_to_disk folder",
        ),
        (
            ("--training.dataset_path", str(empty), "--validation.no-enable"),
            f"[training] dataset_path = '{empty}' (local_text): '{empty}' holds no documents: "
            "its 2 .jsonl file(s) are empty",
        ),
        (
            ("--training.dataset_path", str(some_empty), "--validation.no-enable"),
            f"[training] dataset_path = '{some_empty}' (local_text): 1 of the 2 files of "
            f"'{some_empty}' hold no documents ({some_empty / 'b.jsonl'}); remove them "
            "(sharding is by file: an empty file can leave a rank nothing to read)",
        ),
        (
            ("--training.dataset_path", str(mixed), "--validation.no-enable"),
            f"[training] dataset_path = '{mixed}' (local_text): folder '{mixed}' mixes formats: "
            f"1 json (e.g. {mixed / 'a.jsonl'}); 1 parquet (e.g. {mixed / 'b.parquet'}); keep "
            "one format per corpus",
        ),
        (
            ("--training.dataset_path", str(tmp_path / "missing"), "--validation.no-enable"),
            f"[training] dataset_path = '{tmp_path / 'missing'}' (local_text): dataset_path "
            f"'{tmp_path / 'missing'}' does not exist",
        ),
        (
            ("--training.dataset_path", str(bad_json), "--validation.no-enable"),
            f"[training] dataset_path = '{bad_json}' (local_text): {bad_json} line 1 is not "
            "valid JSON (Expecting value at column 9)",
        ),
        (  # validation reading training's files
            ("--training.dataset_path", str(good), "--validation.dataset", "local_text",
             "--validation.dataset_path", str(good / "p1.jsonl")),
            f"[validation] dataset_path = '{good / 'p1.jsonl'}' reads 1 file(s) training reads "
            f"too ({good / 'p1.jsonl'}): validation would score documents trained on; hold "
            "files out with [training] dataset_holdout_files = N and [validation] dataset = "
            "'local_text_holdout', or point it at other files",
        ),
        (
            ("--training.dataset_path", str(good), "--validation.dataset", "local_text_holdout"),
            "[validation] dataset = 'local_text_holdout' reads what [training] "
            "dataset_holdout_files or dataset_holdout_every holds out of dataset = 'local_text' "
            "(dataset 'local_text', neither set); set dataset_holdout_files = N (the last N "
            "files) or dataset_holdout_every = N (every N-th document of each file)",
        ),
        (
            ("--training.dataset_path", str(good), "--training.dataset_holdout_files", "3",
             "--validation.dataset", "local_text_holdout"),
            f"[training] dataset_path = '{good}' (local_text): dataset_holdout_files "
            f"= 3 must be between 1 and 2: '{good}' holds 3 .jsonl files and training keeps "
            "at least one",
        ),
        (
            ("--training.dataset_path", str(good), "--training.dataset_holdout_every", "1",
             "--validation.no-enable"),
            f"[training] dataset_path = '{good}' (local_text): dataset_holdout_every = 1 must "
            "be >= 2 (every N-th document of each file is held out: 1/N of the corpus)",
        ),
        (
            ("--training.dataset_path", str(good), "--training.dataset_holdout_every", "2",
             "--training.dataset_holdout_files", "1", "--validation.no-enable"),
            f"[training] dataset_path = '{good}' (local_text): dataset_holdout_files = 1 and "
            "dataset_holdout_every = 2: hold out files or every N-th document, not both (the "
            "other 0)",
        ),
    ]  # fmt: skip
    for overrides, message in cases:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            _check(*overrides)
        assert str(e.value) == message


# ---------------------------------------------------------------------------------------
# Real runs at dp 2: resume from step 2 is bitwise the uninterrupted run

CONFIG = "debug_llama2_fsdp2.toml"  # 2 ranks, data_parallel_shard_degree 2
RUN = ("--checkpoint.enable", "--checkpoint.interval", "2", "--training.steps", "4")
TOKENS_PER_STEP = 4 * 257  # base/debug.toml: local_batch_size 4, seq_len 256 (+1 label)
RELOOP = "Dataset local_text is being re-looped"


def _tensors(step_dir: Path) -> dict:
    """Every tensor of a DCP step folder (model and optimizer), loaded whole."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from boost_titan.checkpoint import safe_metadata

    meta = safe_metadata.loads((step_dir / ".metadata").read_bytes(), str(step_dir))
    keys = {k for k, v in meta.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        return _load_state_dict_from_keys(keys, checkpoint_id=str(step_dir))


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix, tree


def _rank_lines(output: str, rank: int) -> list[str]:
    return [
        line.split(":", 1)[1] for line in output.splitlines() if line.startswith(f"[rank{rank}]:")
    ]


def _reloops_by_step(output: str, rank: int) -> list[int]:
    """The step during whose batch each re-loop happened (the loss line follows it)."""
    steps, pending = [], 0
    for line in _rank_lines(output, rank):
        if RELOOP in line and "validat" not in line:
            pending += 1
        elif m := re.search(r"step:\s*(\d+)\s+loss", line):
            steps += [int(m[1])] * pending
            pending = 0
    return steps


def _full_and_resumed(root: Path, name: str, *data: str):
    full = run_training(CONFIG, 2, root / f"{name}_full", *RUN, *data)
    dump = root / f"{name}_resumed"
    shutil.copytree(full.dump_folder / "checkpoint" / "step-2", dump / "checkpoint" / "step-2")
    resumed = run_training(CONFIG, 2, dump, *RUN, *data)
    return full, resumed


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("local_text_runs")
    folder = root / "corpus"
    for i in range(5):  # 4 training files (by file, 2 per rank) + 1 held out
        _write(folder / f"part-{i:03d}.jsonl", "jsonl", _docs(100 + i, 6, words=70))
    one = _write(root / "one.jsonl", "jsonl", _docs(200, 22, words=70))  # by sample
    by_file = _full_and_resumed(
        root, "by_file",
        "--training.dataset", "local_text", "--training.dataset_path", str(folder),
        "--training.dataset_holdout_files", "1",
        "--validation.dataset", "local_text_holdout", "--validation.steps", "1",
        "--validation.freq", "2",
    )  # fmt: skip
    by_sample = run_training(  # every 4th document held out, validated by sample
        CONFIG, 2, root / "by_sample", *RUN,
        "--training.dataset", "local_text", "--training.dataset_path", str(one),
        "--training.dataset_holdout_every", "4",
        "--validation.dataset", "local_text_holdout", "--validation.steps", "1",
        "--validation.freq", "2",
    )  # fmt: skip
    return folder, one, by_file, by_sample


@pytest.mark.slow
def test_dp2_resume_is_bitwise_with_reloops(runs):
    folder, one, by_file, _ = runs
    for full, resumed in (by_file,):
        assert sorted(resumed.loss[0]) == [3, 4]  # resumed from step 2
        for rank in (0, 1):
            assert resumed.loss[rank] == {s: full.loss[rank][s] for s in (3, 4)}
        # re-loops on both sides of the checkpoint (before step 2 ends, then in 3-4)
        reloops = _reloops_by_step(full.output, 0)
        assert any(s <= 2 for s in reloops) and any(s > 2 for s in reloops), reloops
        assert _reloops_by_step(resumed.output, 0), resumed.output[-3000:]
        a = dict(_flat(_tensors(full.dump_folder / "checkpoint" / "step-4")))
        b = dict(_flat(_tensors(resumed.dump_folder / "checkpoint" / "step-4")))
        assert a.keys() == b.keys() and len(a) > 10
        for key in a:
            assert a[key].equal(b[key]), key  # bitwise: weights and optimizer state


@pytest.mark.slow
def test_dp2_log_lines_and_holdout_validation(runs):
    folder, one, (full, _), sample_full = runs
    streamed = "streamed (read as training consumes them, no cache copy)"
    order = (
        "read in one global order: every data-parallel rank reads every document in order "
        "and packs the same windows of 257 tokens; a global batch is 8 windows (4 per rank x "
        "2 ranks) and rank {} trains on windows {} of each"
    )
    head = f"local_text: {folder}: 4 .jsonl files (json, text field 'text', 1 more held out for validation), {streamed}, "  # noqa: E501
    out = full.output
    assert head + order.format(0, "0..3") in out
    assert head + order.format(1, "4..7") in out
    held = f"local_text_holdout: {folder}: 1 .jsonl file (json, text field 'text'), {streamed}, sharded by sample over 2 data-parallel ranks (1 file does not divide by 2): rank {{}} reads the 1 file"  # noqa: E501
    assert held.format(0) in out and held.format(1) in out
    assert "part-004" not in out.split("local_text_holdout:")[0]  # training never names it
    assert sorted(full.val_loss[0]) == [1, 2, 4]  # validation ran on the held-out file
    tail = "sharded by sample over 2 data-parallel ranks (1 file does not divide by 2): rank 0 reads the 1 file and keeps every 2nd document from the 1st"  # noqa: E501
    out = sample_full.output
    every = "every 4th document of each file"
    train = f"local_text: {one}: 1 .jsonl file (json, text field 'text', {every} held out"
    val = f"local_text_holdout: {one}: 1 .jsonl file (json, text field 'text', only {every}:"
    assert f"{train} for validation), {streamed}, {order.format(0, '0..3')}" in out
    assert f"{val} held out for validation), {streamed}, {tail}" in out
    assert sorted(sample_full.val_loss[0]) == [1, 2, 4]


@pytest.mark.slow
def test_dp2_resume_over_changed_files(runs, tmp_path):
    """A real resume over a changed corpus (a document appended to one training file):
    refused in one line at the checkpoint load, before step 3, on both ranks; resumed
    with the refusal's way forward, --checkpoint.exclude_from_loading dataloader
    (model, optimizer and step from the checkpoint, the data from its first document)."""
    folder, _, (full, _), _ = runs
    changed = tmp_path / "corpus"
    shutil.copytree(folder, changed)
    size = (changed / "part-001.jsonl").stat().st_size
    more = json.dumps({"text": "one more document"}) + "\n"
    with open(changed / "part-001.jsonl", "a") as f:
        f.write(more)
    data = (
        "--training.dataset", "local_text", "--training.dataset_path", str(changed),
        "--training.dataset_holdout_files", "1", "--validation.no-enable",
    )  # fmt: skip
    step2 = full.dump_folder / "checkpoint" / "step-2"
    shutil.copytree(step2, tmp_path / "refused" / "checkpoint" / "step-2")
    refused = run_training(CONFIG, 2, tmp_path / "refused", *RUN, *data, expect_failure=True)
    line = f"part-001.jsonl was {size} bytes at the checkpoint, now {size + len(more)};"
    for rank in (0, 1):
        assert any(line in x for x in _rank_lines(refused.output, rank)), refused.output[-3000:]
    assert "Traceback" not in refused.output and not refused.loss
    shutil.copytree(step2, tmp_path / "restarted" / "checkpoint" / "step-2")
    restarted = run_training(
        CONFIG, 2, tmp_path / "restarted", *RUN, *data,
        "--checkpoint.exclude_from_loading", "dataloader",
    )  # fmt: skip
    assert sorted(restarted.loss[0]) == [3, 4]
    # the data restarted at its first window: 2 steps of 8 windows after it, not 4
    assert _dataloader_position(tmp_path / "restarted" / "checkpoint" / "step-4")["windows"] == 16


def _dataloader_position(step_dir: Path) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from boost_titan.checkpoint import safe_metadata

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        items = _load_state_dict_from_keys({"dataloader.position"}, checkpoint_id=str(step_dir))
    return safe_metadata.dataloader_state(items["dataloader"]["position"], "position")
