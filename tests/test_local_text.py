"""Your own corpus (``dataset = "local_text"``): read from its files with no copy in the
datasets cache, tokenized once into boost_titan's cache (``boost_titan.data.cache``)
and trained on in the order of ``boost_titan.data.order`` (its resume at other dp
degrees: test_tokenized_data.py and test_layout_resume.py), resumed bitwise at dp 2,
its text field and the start-up refusals, and validation on held-out files.

Every corpus here is generated in ``tmp_path`` (a few KB). Without processes: what the
readers read (against the documents written), the holdouts, a resume over changed
files refused, a copy elsewhere resumed, the config-check errors. Real runs (3
launches, 2 gloo ranks, FSDP2, 4 steps, a checkpoint at step 2): a folder corpus with
two files of unequal size held out for validation (a whole pass on each rank: the same
number of batches on both), resumed from step 2 and compared bitwise with the
uninterrupted run (re-loops of the corpus on both sides of the checkpoint), and a
one-file corpus with every 4th document held out."""

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


def test_a_saved_dataset_is_tokenized_row_by_row(tmp_path):
    from datasets import Dataset

    from boost_titan.data.cache import ensure
    from boost_titan.data.text_sources import SavedText

    Dataset.from_dict({"body": _docs(4, 2)}).save_to_disk(str(tmp_path / "body"))
    body = find_corpus(str(tmp_path / "body"), "body")
    check_corpus(body)
    assert not body.streamed and body.kind == "saved"
    corpus = ensure(SavedText(body.path, "body"), TOKENIZER, str(tmp_path / "cache"), quiet=True)
    stream = _stream(corpus)
    assert stream == _tokens(_docs(4, 2))
    with pytest.raises(
        CorpusError, match=r"body \(every row\) has no text field 'text' \(fields: \['body'\]\)"
    ):
        check_corpus(find_corpus(str(tmp_path / "body")))


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
# Tokenized once, resumed over changed files


def _tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(TOKENIZER)


def _tokens(docs: list[str]) -> list[int]:
    tok = _tokenizer()
    return [t for d in docs for t in tok.encode(d, add_bos=True, add_eos=True)]


def _stream(corpus) -> list[int]:
    import numpy as np

    return np.concatenate(
        [np.fromfile(p.prefix + ".bin", corpus.dtype) for p in corpus.parts]
    ).tolist()


def _take(it, n: int) -> list:
    return [next(it)[1].tolist() for _ in range(n)]


def _training_loader(corpus, cache: Path, world=1, tokenizer=TOKENIZER):
    """The training loader of rank 0 of ``world`` over ``corpus`` (tokenized into
    ``cache``), local batch 2, windows of 17 tokens."""
    from fractions import Fraction

    from boost_titan.data.cache import ensure
    from boost_titan.data.text_sources import FileText
    from boost_titan.data.window_loader import WindowLoader

    tokenized = ensure(FileText(corpus), str(tokenizer), str(cache), quiet=True)
    return WindowLoader("local_text", [tokenized], [Fraction(1)], seq_len=16,
                        local_batch_size=2, dp_rank=0, dp_world_size=world)  # fmt: skip


def test_the_same_files_through_a_link_reuse_the_cache(tmp_path, monkeypatch):
    """Issue 56 item 16: the cache key is where the files really are (links resolved),
    their sizes and times: a corpus reached through a symbolic link (a folder or one
    file) is the cached one, tokenized by nobody; an edit is another key."""
    from boost_titan.data import cache
    from boost_titan.data.text_sources import FileText

    root = tmp_path / "c"
    for i in range(2):
        _write(root / f"p{i}.jsonl", "jsonl", _docs(90 + i, 3, words=12))
    (tmp_path / "link").symlink_to(root)
    (tmp_path / "one.jsonl").symlink_to(root / "p0.jsonl")
    made = {
        name: cache.ensure(FileText(find_corpus(str(root / name))), TOKENIZER,
                           str(tmp_path / "cache"), quiet=True).path
        for name in ("", "p0.jsonl")
    }  # fmt: skip

    def no_work(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(cache, "tokenize", no_work)
    for link, real in (("link", ""), ("one.jsonl", "p0.jsonl")):
        again = cache.ensure(FileText(find_corpus(str(tmp_path / link))), TOKENIZER,
                             str(tmp_path / "cache"), quiet=True)  # fmt: skip
        assert again.path == made[real]
    with open(root / "p1.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    with pytest.raises(AssertionError, match="tokenized again"):
        cache.ensure(FileText(find_corpus(str(tmp_path / "link"))), TOKENIZER,
                     str(tmp_path / "cache"), quiet=True)  # fmt: skip


def test_resume_over_changed_files_is_refused_in_one_line(tmp_path):
    """A saved position records the corpus' digest (of its tokens, documents, files and
    holdout, not of where they are); a resume over other files stops with one line
    naming the change (a SystemExit: no traceback per rank). The same files copied
    elsewhere (new path, new mtimes: tokenized again) resume exactly, at another
    data-parallel degree too."""
    from boost_titan.checkpoint.data_position import DataResumeError

    cache = tmp_path / "cache"
    root = tmp_path / "c"
    for i in range(4):
        _write(root / f"p{i}.jsonl", "jsonl", _docs(70 + i, 3, words=12))
    corpus = find_corpus(str(root))
    tokenized = _training_loader(corpus, cache).corpora[0]
    assert _stream(tokenized) == _tokens([d for i in range(4) for d in _docs(70 + i, 3, words=12)])
    reference = _take(iter(_training_loader(corpus, cache)), 12)
    loader = _training_loader(corpus, cache, world=2)
    _take(iter(loader), 5)  # 20 windows (dp 2): rank 0's batches 0, 2, ...
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    assert pickle.loads(state["position"])["corpora"][0]["digest"] == tokenized.digest

    def resume(folder, state, *, every=0):
        c = find_corpus(str(folder))
        c = split_every(c, every)[0] if every else c
        loader = _training_loader(c, cache)
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
        assert isinstance(e.value, SystemExit) and "\n" not in str(e.value)
        return str(e.value)

    def grow(folder):
        with open(folder / "p2.jsonl", "a") as f:
            f.write(json.dumps({"text": "one more"}) + "\n")

    line = changed(grow)
    assert line.startswith(
        "local_text: the checkpoint's data position was saved over other data: the corpus "
    ), line
    assert "(tokens 203 -> 207, documents 12 -> 13, tokenized from " in line, line
    assert line.endswith(
        "resume with the same data, or keep the model, optimizer and step and restart the "
        "data from its first window with --checkpoint.exclude_from_loading dataloader"
    )
    assert "documents 12 -> 14" in changed(lambda f: _write(f / "p4.jsonl", "jsonl", _docs(9, 2)))
    assert "documents 12 -> 9" in changed(lambda f: (f / "p3.jsonl").unlink())
    assert "same counts: its files or their contents changed" in changed(
        lambda f: (f / "p1.jsonl").rename(f / "q1.jsonl")  # another name: other files
    )
    assert "documents 12 -> 8" in changed(lambda f: 3)  # dataset_holdout_every 3
    # the same files with another tokenizer ([model] hf_assets_path swapped): refused
    from boost_titan.data.tokenizer import train_tokenizer, write_tokenizer

    other = tmp_path / "other_tokenizer"
    write_tokenizer(train_tokenizer(_docs(7, 40), 600), other)
    swapped = _training_loader(corpus, cache, tokenizer=other)
    with pytest.raises(DataResumeError) as e:
        swapped.load_state_dict(pickle.loads(pickle.dumps(state)))
    before, after = tokenized.tokenizer["digest"], swapped.corpora[0].tokenizer["digest"]
    assert f"(tokenizer {before!r} -> {after!r}, tokens 203 -> " in str(e.value), str(e.value)


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
        _write(good / f"p{i}.jsonl", "jsonl", _docs(40 + i, 12))
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
    _write(some_empty / "a.jsonl", "jsonl", _docs(1, 12))
    (some_empty / "b.jsonl").write_text("")
    _check("--training.dataset_path", str(some_empty), "--validation.no-enable")  # passed over
    mixed = tmp_path / "mixed"
    _write(mixed / "a.jsonl", "jsonl", _docs(1, 2))
    _write(mixed / "b.parquet", "parquet", _docs(2, 2))
    nothing = tmp_path / "nothing"
    nothing.mkdir()
    (nothing / "notes.csv").write_text("a,b\n")
    field = _write(tmp_path / "field.jsonl", "jsonl", _docs(1, 12), field="body")
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"text": \n{"text": "ok"}\n')
    # one file, 2 DataLoader workers: the workers read batches of windows in turn
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
    for i in range(3):  # 3 training files + 2 held out, of unequal size
        _write(folder / f"part-{i:03d}.jsonl", "jsonl", _docs(100 + i, 6, words=70))
    _write(folder / "part-003.jsonl", "jsonl", _docs(103, 6, words=70))
    _write(folder / "part-004.jsonl", "jsonl", _docs(104, 40, words=70))
    one = _write(root / "one.jsonl", "jsonl", _docs(200, 22, words=70))
    by_file = _full_and_resumed(
        root, "by_file",
        "--training.dataset", "local_text", "--training.dataset_path", str(folder),
        "--training.dataset_holdout_files", "2",
        "--validation.dataset", "local_text_holdout", "--validation.steps", "-1",
        "--validation.freq", "2",
    )  # fmt: skip
    by_sample = run_training(  # every 4th document held out
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
    """What each rank says it reads, and a whole validation pass over two held-out files
    of unequal size at dp 2: the same number of batches on both ranks (a rank with more
    batches would wait in a collective the other never enters)."""
    folder, one, (full, _), sample_full = runs
    order = (
        "; shuffled windows (seed 0) of 257 tokens; a global batch is 8 windows (4 per rank x "
        "2 ranks) and rank {} reads windows {} of each, nothing else"
    )
    out = full.output
    head = re.compile(
        r"local_text: \S+: (\d+) documents, \d+ tokens \(uint16, 1 part, digest \w+\), "
        rf"tokenized from json files {re.escape(repr(str(folder)))}"
    )
    assert head.search(out) and head.search(out)[1] == "18", out[-3000:]
    for rank, windows in ((0, "0..3"), (1, "4..7")):
        assert order.format(rank, windows) in out
    val = re.search(
        rf"local_text_holdout: \S+: 46 documents, \d+ tokens .*tokenized from json files "
        rf"{re.escape(repr(str(folder)))}; windows in corpus order of 257 tokens; .*; a "
        r"validation pass is (\d+) batches on every rank \((\d+) windows left out\)",
        out,
    )
    assert val and int(val[1]) >= 1, out[-3000:]
    assert sorted(full.val_loss[0]) == sorted(full.val_loss[1]) == [1, 2, 4]
    out = sample_full.output
    assert "local_text: " in out and "tokenized from json files " + repr(str(one)) in out
    assert "local_text_holdout: " in out and "5 documents" in out  # 22 // 4 held out
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
    more = json.dumps({"text": "one more document"}) + "\n"
    with open(changed / "part-001.jsonl", "a") as f:
        f.write(more)
    data = (
        "--training.dataset", "local_text", "--training.dataset_path", str(changed),
        "--training.dataset_holdout_files", "2", "--validation.no-enable",
    )  # fmt: skip
    step2 = full.dump_folder / "checkpoint" / "step-2"
    shutil.copytree(step2, tmp_path / "refused" / "checkpoint" / "step-2")
    refused = run_training(CONFIG, 2, tmp_path / "refused", *RUN, *data, expect_failure=True)
    line = "documents 18 -> 19"
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
    assert _dataloader_position(tmp_path / "restarted" / "checkpoint" / "step-4")["samples"] == 16


def _dataloader_position(step_dir: Path) -> dict:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from boost_titan.checkpoint import safe_metadata

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        items = _load_state_dict_from_keys({"dataloader.position"}, checkpoint_id=str(step_dir))
    return safe_metadata.dataloader_state(items["dataloader"]["position"], "position")
