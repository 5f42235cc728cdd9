"""Tokenized corpora and their order (``boost_titan.data.tokenize`` / ``seal`` /
``indexed`` / ``tokenized`` / ``order`` / ``window_loader``), without training
processes: loaders of every data-parallel rank are built in this process.

* the arithmetic against brute force: the blend's slots are Megatron's greedy rule and
  its token shares are within 1% of the weights over 100k windows; the shuffle visits
  every window once per pass, is the same under its seed and differs between seeds
  and passes;
* ``data tokenize``: each document is the tokenizer's own ``encode(text, BOS, EOS)``;
  the same corpus (digest for digest) from 1 or 2 workers and from 2 shards merged; a
  killed run's finished parts are kept; bad input is one line and writes nothing;
* the Megatron format both ways against megatron-core itself (one subprocess);
* the loaders: ranks at dp 1, 2, 4 (with and without DataLoader workers) read the same
  global batches, a position saved at dp 2 resumes at dp 1, 3 and 4, a rank reads its
  own windows' bytes only (the same at every dp), a changed corpus, seed, seq_len or
  tokenizer is refused in one line, validation runs the same number of batches on
  every rank; two gloo ranks that see different corpora both stop on one line."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO_ROOT

from boost_titan.data import indexed, local_text, text_sources
from boost_titan.data.local_text import CorpusError
from boost_titan.data.order import Blend, BlendError, Order, pass_key, permute
from boost_titan.data.text_sources import source_of
from boost_titan.data.tokenize import tokenize
from boost_titan.data.tokenized import MANIFEST, WindowReader, open_corpus
from boost_titan.data.window_loader import WindowLoader

TOKENIZER = str(REPO_ROOT / "data" / "boost_corpus" / "tokenizer")
WORDS = "the a river stone light model train data city north small old quiet".split()


def _write_corpus(folder: Path, files: int, docs: int, seed: int = 0) -> Path:
    folder.mkdir(parents=True)
    rng = random.Random(seed)
    for f in range(files):
        lines = []
        for i in range(docs):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 80)))
            lines.append(json.dumps({"text": f"doc {f}.{i}: {words}"}))
        (folder / f"part-{f}.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def _tokenized(tmp: Path, name: str, files=3, docs=40, seed=0, **kw):
    raw = _write_corpus(tmp / f"{name}_raw", files, docs, seed)
    out = tmp / name
    tokenize(source_of(str(raw)), TOKENIZER, str(out), workers=1, quiet=True, **kw)
    return raw, open_corpus(str(out))


@pytest.fixture(scope="module")
def tok():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(TOKENIZER)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tokenized")
    return tmp, {n: _tokenized(tmp, n, seed=s) for n, s in (("a", 0), ("b", 1))}


# ---------------------------------------------------------------------------------------
# Arithmetic


def test_blend_is_megatrons_greedy_rule_and_keeps_its_shares():
    for weights in (["0.7", "0.3"], ["3", "1"], ["0.5", "0.3", "0.2"], ["0.123457", "1", "2.5"]):
        w = [Fraction(x) for x in weights]
        blend = Blend(w)
        n = 100_000
        corpus, within = blend.locate(np.arange(n))
        shares = np.bincount(corpus, minlength=len(w)) / n
        exact = np.array([float(x / sum(w)) for x in w])
        assert np.all(np.abs(shares - exact) <= 0.01 * exact), (weights, shares, exact)
        # brute force: Megatron's BlendedDataset loop over floats, and the running counts
        counts = np.zeros(len(w), np.int64)
        for i in range(3 * blend.period if blend.period < 1000 else 2000):
            errors = np.array(blend.parts) / blend.period * (i + 1) - counts
            k = int(np.argmax(errors))
            assert corpus[i] == k and within[i] == counts[k], (weights, i)
            counts[k] += 1
    for bad in ("0", "-1", "x", "1/0"):
        with pytest.raises(BlendError, match="weight"):
            from boost_titan.data.order import parse_weight

            parse_weight(bad, "test")


def test_shuffle_visits_every_window_once_per_pass_and_is_seeded():
    for n in (1, 2, 3, 17, 1000, 65_537):
        for key in (pass_key(0, 0, 0), pass_key(7, 1, 3)):
            perm = permute(np.arange(n), n, key)
            assert sorted(perm.tolist()) == list(range(n)), (n, key)
    n = 10_000
    a = permute(np.arange(n), n, pass_key(0, 0, 0))
    assert np.array_equal(a, permute(np.arange(n), n, pass_key(0, 0, 0)))  # stable
    for other in (pass_key(1, 0, 0), pass_key(0, 1, 0), pass_key(0, 0, 1)):
        b = permute(np.arange(n), n, other)
        assert np.mean(a == b) < 0.01  # another seed, corpus or pass: another order
    assert abs(np.corrcoef(np.arange(n), a)[0, 1]) < 0.05  # not the corpus order
    order = Order([5, 3], Blend([Fraction(1), Fraction(1)]), seed=0, shuffle=True)
    corpus, epoch, window = order.lookup(np.arange(40))
    for k, n_k in ((0, 5), (1, 3)):
        for e in range(3):
            sel = (corpus == k) & (epoch == e)
            assert sorted(window[sel].tolist()) == list(range(n_k)), (k, e)


# ---------------------------------------------------------------------------------------
# data tokenize


def test_each_document_is_the_tokenizers_encoding(corpora, tok):
    _, (raw, corpus) = corpora[0], corpora[1]["a"]
    texts = [t for f in sorted(raw.glob("*.jsonl")) for t in local_text.read_documents(f, "text")]
    index = indexed.read_index(corpus.parts[0].prefix + ".idx")
    assert index.sequences == corpus.documents == len(texts) == 120
    stream = np.fromfile(corpus.parts[0].prefix + ".bin", dtype=np.uint16)
    offsets = np.concatenate([[0], np.cumsum(index.lengths)])
    for i, text in enumerate(texts):
        assert stream[offsets[i] : offsets[i + 1]].tolist() == tok.encode(
            text, add_bos=True, add_eos=True
        )
    reader = WindowReader(corpus, 17)
    assert reader.read(3).tolist() == stream[51:68].tolist()
    assert reader.bytes_read == 17 * 2 and reader.reads == 1


def test_workers_shards_and_a_killed_run_make_the_same_corpus(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(text_sources, "UNIT_BYTES", 4000)  # several parts from small files
    raw = _write_corpus(tmp_path / "raw", 6, 30)
    source = source_of(str(raw))
    one = tokenize(source, TOKENIZER, str(tmp_path / "one"), workers=1, quiet=True)
    assert len(one["parts"]) >= 3
    two = tokenize(source, TOKENIZER, str(tmp_path / "two"), workers=2, quiet=True)
    assert two["digest"] == one["digest"]
    shards = tmp_path / "shards"
    assert tokenize(source, TOKENIZER, str(shards), 1, (0, 2), quiet=True) is None
    assert not (shards / MANIFEST).exists()  # half a corpus is never a corpus
    with pytest.raises(CorpusError, match="parts are not done"):
        tokenize(source, TOKENIZER, str(shards), merge_only=True, quiet=True)
    finished = {p: (shards / f"{p}.bin").stat().st_mtime_ns for p in ("part-00000",)}
    (shards / "part-00001.bin.tmp.999").write_bytes(b"cut short")  # a killed writer's file
    tokenize(source, TOKENIZER, str(shards), 1, (1, 2), quiet=True)
    merged = tokenize(source, TOKENIZER, str(shards), merge_only=True, quiet=True)
    assert merged["digest"] == one["digest"]
    assert (shards / "part-00000.bin").stat().st_mtime_ns == finished["part-00000"]
    with pytest.raises(CorpusError, match="another source or tokenizer"):
        tokenize(
            source_of(str(_write_corpus(tmp_path / "other", 1, 3))),
            TOKENIZER,
            str(shards),
            quiet=True,
        )


def test_bad_input_is_one_line_and_writes_nothing(tmp_path, corpora):
    from boost_titan.data.seal import seal

    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.jsonl").write_text("")
    with pytest.raises(CorpusError, match="holds no documents"):
        tokenize(source_of(str(empty)), TOKENIZER, str(tmp_path / "e_out"), quiet=True)
    assert not (tmp_path / "e_out").exists()
    # Megatron files: truncated .bin, an .idx of another version, ids past the vocabulary
    prefix = str(tmp_path / "m")
    writer = indexed.IndexWriter(prefix + ".bin", np.uint16)
    for doc in ([5, 6, 7, 1], [8, 1], [9000, 1]):
        writer.add(np.asarray(doc))
    writer.finish(prefix + ".idx")
    with pytest.raises(CorpusError, match="outside the tokenizer's vocabulary 0..8191"):
        seal([prefix], TOKENIZER, str(tmp_path / "s1"))
    data = Path(prefix + ".bin").read_bytes()
    Path(prefix + ".bin").write_bytes(data[:-2])
    with pytest.raises(CorpusError, match="is 14 bytes; its index says 8 tokens"):
        seal([prefix], TOKENIZER, str(tmp_path / "s2"))
    idx = bytearray(Path(prefix + ".idx").read_bytes())
    idx[9] = 2
    Path(prefix + ".idx").write_bytes(bytes(idx))
    with pytest.raises(CorpusError, match="version 2; this reader reads version 1"):
        seal([prefix], TOKENIZER, str(tmp_path / "s3"))
    idx[9] = 1
    Path(prefix + ".idx").write_bytes(bytes(idx[:-8]))
    with pytest.raises(CorpusError, match="truncated or damaged"):
        seal([prefix], TOKENIZER, str(tmp_path / "s4"))
    assert not any((tmp_path / f"s{i}").exists() for i in range(1, 5))
    # a corpus.json edited by hand, and a part that changed size
    _, corpus = corpora[1]["a"]
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in Path(corpus.path).iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((copy / MANIFEST).read_text())
    manifest["tokens"] += 1
    (copy / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorpusError, match="does not match its own digest"):
        open_corpus(str(copy))
    (copy / MANIFEST).write_text((Path(corpus.path) / MANIFEST).read_text())
    with open(copy / "part-00000.bin", "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(CorpusError, match="changed since the corpus was tokenized"):
        WindowReader(open_corpus(str(copy)), 17).read(0)


def test_the_cli_tokenizes_and_refuses_in_one_line(tmp_path, capsys):
    from boost_titan.data.cli import main as data_main

    raw = _write_corpus(tmp_path / "raw", 2, 5)
    out = tmp_path / "out"
    assert (
        data_main(
            [
                "tokenize",
                "--from",
                str(raw),
                "--tokenizer",
                TOKENIZER,
                "--out",
                str(out),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    assert "10 documents" in capsys.readouterr().out
    for argv, line in (
        (["--shard", "2/2"], "--shard '2/2': I must be in 0..N-1"),
        (["--shard", "x"], "--shard 'x' is not I/N"),
        (["--workers", "0"], "--workers 0 must be >= 1"),
    ):
        with pytest.raises(SystemExit) as stop:  # the one refusal line, exit 1
            data_main(["tokenize", "--from", str(raw), "--tokenizer", TOKENIZER,
                       "--out", str(tmp_path / "bad"), *argv])  # fmt: skip
        assert stop.value.code == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and line in err, err
    assert not (tmp_path / "bad").exists()


MEGATRON = r"""
import sys, warnings, numpy as np, torch
warnings.simplefilter("ignore")
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
ours, theirs = sys.argv[1], sys.argv[2]
d = IndexedDataset(ours)  # ours, read by Megatron
print(len(d), [d[i].tolist() for i in range(len(d))][:2], d.document_indices.tolist()[:3])
b = IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)  # Megatron's, read by us
for doc in ([0, 5, 6, 7, 1], [0, 8, 1], [0, 11, 12, 13, 14, 15, 1]):
    b.add_document(torch.tensor(doc), [len(doc)])
b.finalize(theirs + ".idx")
"""


def test_megatron_reads_ours_and_we_read_megatrons(tmp_path, corpora):
    from boost_titan.data.seal import seal

    _, corpus = corpora[1]["a"]
    proc = subprocess.run(
        [sys.executable, "-c", MEGATRON, corpus.parts[0].prefix, str(tmp_path / "theirs")],
        capture_output=True, text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    index = indexed.read_index(corpus.parts[0].prefix + ".idx")
    stream = np.fromfile(corpus.parts[0].prefix + ".bin", np.uint16)
    expect = [
        stream[: index.lengths[0]].tolist(),
        stream[index.lengths[0] : index.lengths[:2].sum()].tolist(),
    ]
    assert proc.stdout.strip() == f"{index.sequences} {expect} [0, 1, 2]"
    manifest = seal([str(tmp_path / "theirs")], TOKENIZER, str(tmp_path / "sealed"))
    assert manifest["documents"] == 3 and manifest["tokens"] == 15
    sealed = open_corpus(str(tmp_path / "sealed"))
    reader = WindowReader(sealed, 5)
    assert [reader.read(w).tolist() for w in range(3)] == [
        [0, 5, 6, 7, 1], [0, 8, 1, 0, 11], [12, 13, 14, 15, 1],
    ]  # fmt: skip


# ---------------------------------------------------------------------------------------
# Loaders


def _loader(corpora, dp, rank, local=2, seq=16, **kw):
    weights = kw.pop("weights", [Fraction(1)] * len(corpora))
    return WindowLoader("test", corpora, weights, seq_len=seq, local_batch_size=local,
                        dp_rank=rank, dp_world_size=dp, **kw)  # fmt: skip


def _global_batches(corpora, dp, steps, start_state=None, workers=0, local=None):
    """[global batch][window] token lists, the ranks' slices put together."""
    local = local or 8 // dp
    per_rank = []
    for r in range(dp):
        loader = _loader(corpora, dp, r, local=local, num_workers=workers,
                         weights=[Fraction(7), Fraction(3)])  # fmt: skip
        if start_state is not None:
            loader.load_state_dict(start_state)
        it = iter(loader)
        per_rank.append([next(it)[0]["input"].tolist() for _ in range(steps)])
        state = loader.state_dict()
    return [sum((per_rank[r][s] for r in range(dp)), []) for s in range(steps)], state


def test_every_dp_degree_reads_the_same_global_batches_and_resumes(corpora):
    _, found = corpora
    both = [found["a"][1], found["b"][1]]
    reference, state = _global_batches(both, 1, 12)
    assert len({tuple(w) for b in reference for w in b}) == 12 * 8  # distinct windows
    for dp, workers in ((2, 0), (4, 2)):
        got, dp_state = _global_batches(both, dp, 12, workers=workers)
        assert got == reference, dp
        assert pickle.loads(dp_state["position"])["samples"] == 96
    _, at6 = _global_batches(both, 2, 6)
    for dp in (1, 3, 4):
        local = 8 // dp if 8 % dp == 0 else 1
        steps = 6 * 8 // (local * dp)
        got, _ = _global_batches(both, dp, steps, pickle.loads(pickle.dumps(at6)), local=local)
        flat = [w for b in got for w in b]
        assert flat == [w for b in reference[6:] for w in b][: len(flat)], dp


def test_a_rank_reads_its_windows_only_at_any_dp(corpora):
    _, found = corpora
    corpus = found["a"][1]
    reads = []
    for dp in (1, 8, 64, 1024):
        loader = _loader([corpus], dp, dp - 1, local=2, seq=8)
        it = iter(loader)
        for _ in range(5):
            next(it)
        reads.append(sum(r.bytes_read for r in loader.readers))
    assert reads == [5 * 2 * 9 * 2] * 4  # 5 steps x 2 windows x 9 tokens x 2 bytes


def test_a_changed_corpus_seed_seq_len_or_tokenizer_is_refused(corpora, tmp_path):
    from boost_titan.checkpoint.data_position import DataResumeError
    from boost_titan.data.loader import check_tokenizer
    from boost_titan.data.tokenizer import train_tokenizer, write_tokenizer

    tmp, found = corpora
    raw, corpus = found["a"]
    loader = _loader([corpus], 2, 0)
    next(iter(loader))
    state = loader.state_dict()
    again = tmp_path / "again"
    for f in raw.iterdir():  # the same files, one document more
        (tmp_path / "raw2").mkdir(exist_ok=True)
        (tmp_path / "raw2" / f.name).write_text(f.read_text())
    with open(tmp_path / "raw2" / "part-0.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more document"}) + "\n")
    tokenize(source_of(str(tmp_path / "raw2")), TOKENIZER, str(again), workers=1, quiet=True)
    changed = open_corpus(str(again))
    cases = [
        (_loader([changed], 2, 0), "documents 120 -> 121"),
        (_loader([corpus], 2, 0, seed=1), "[training] dataset_seed was 0, now 1"),
        (_loader([corpus], 2, 0, seq=32), "seq_len was 16, now 32"),
        (_loader([corpus], 2, 0, shuffle=False), "[training] dataset_shuffle was True, now False"),
    ]
    for other, line in cases:
        with pytest.raises(DataResumeError) as e:
            other.load_state_dict(state)
        assert line in str(e.value) and "\n" not in str(e.value), str(e.value)
    old = {"position": pickle.dumps({"version": 1, "windows": 8})}
    with pytest.raises(DataResumeError, match="older boost_titan's loader"):
        _loader([corpus], 2, 0).load_state_dict(old)
    other_tok = tmp_path / "tok"
    texts = [" ".join(random.Random(i).choice(WORDS) for _ in range(50)) for i in range(50)]
    write_tokenizer(train_tokenizer(texts, 512), other_tok)
    with pytest.raises(CorpusError, match="was tokenized with the tokenizer at") as e:
        check_tokenizer([corpus], str(other_tok), "local_text")
    assert "\n" not in str(e.value)
    check_tokenizer([corpus], TOKENIZER, "local_text")


def test_validation_runs_the_same_batches_on_every_rank(corpora):
    _, found = corpora
    corpus = found["b"][1]
    windows = corpus.windows(17)
    for dp in (1, 2, 3, 4):
        counts = []
        for r in range(dp):
            loader = _loader(
                [corpus], dp, r, local=2, infinite=False, validation=True, shuffle=False
            )
            batches = list(loader)
            counts.append(len(batches))
            again = list(loader)  # every pass from the first window
            assert [b[0]["input"].tolist() for b in again] == [
                b[0]["input"].tolist() for b in batches
            ]
        assert counts == [windows // (2 * dp)] * dp, (dp, counts)
    with pytest.raises(CorpusError, match="fewer than one global batch"):
        _loader([corpus], windows, 0, local=2, infinite=False, validation=True)


AGREE = r"""
import os, sys
import torch.distributed as dist
out = open(os.path.join(sys.argv[1], f"rank{os.environ['RANK']}.txt"), "w")  # one file a rank
from boost_titan.data.local_text import CorpusError
from boost_titan.data.loader import agree
dist.init_process_group("gloo")
rank = dist.get_rank()
view = {"seq_len": 16, "seed": 0, "shuffle": True, "weights": ["1"],
        "corpora": [{"path": "/c", "digest": "ab" * 16 if rank == 0 else "cd" * 16,
                     "tokens": 100 + rank, "documents": 5, "tokenizer": "t", "source": "/raw"}]}
try:
    agree(view, "local_text")
except CorpusError as e:
    out.write(f"rank {rank}: {e}\n")
view = CorpusError("local_text: dataset_path '/x' does not exist") if rank == 1 else view
try:
    agree(view, "local_text")
except CorpusError as e:
    out.write(f"rank {rank}: {e}\n")
out.close()
dist.destroy_process_group()
"""


def test_ranks_that_see_different_corpora_stop_in_one_line(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", str(script), str(tmp_path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = sorted(
        line for r in (0, 1) for line in (tmp_path / f"rank{r}.txt").read_text().splitlines()
    )
    assert len(lines) == 4, proc.stdout
    differ = (
        "local_text: rank 1 sees other data than rank 0 (the corpus /c has digest "
        "cdcdcdcdcdcd, rank 0's had abababababab (tokens 100 -> 101); 1 of 2 ranks differ "
        "from rank 0): every rank must read the same corpus"
    )
    missing = "local_text: dataset_path '/x' does not exist"
    assert len(lines) == 4, lines  # each rank stops on one line, twice
    assert lines[0] == f"rank 0: local_text: rank 1 cannot read the data ({missing})"
    assert lines[1].startswith(f"rank 0: {differ}") and lines[3].startswith(f"rank 1: {differ}")
    assert lines[2] == f"rank 1: {missing}"  # the rank that cannot read says why


# ---------------------------------------------------------------------------------------
# Checkpoints through DCP (one process)


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class _Dims:
    world_size, dp_shard, dp_replicate, cp, tp, pp, ep = 4, 4, 1, 1, 1, 1, 1


def _dcp(folder: Path, state: dict, load_into=None) -> None:
    """DCP save of ``state``, or what the checkpoint manager's dcp_load does for
    ``load_into``: adapt, then DCP."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from boost_titan.checkpoint.data_position import DataPosition

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        if load_into is None:
            dcp.save(state, checkpoint_id=str(folder))
        else:
            adapted = DataPosition.for_run(load_into, _Dims).adapt(
                {"dataloader": load_into}, folder, False
            )
            dcp.load(adapted, checkpoint_id=str(folder))


def _per_rank_loader(dp: int, rank: int, tok):
    """torchtitan's per-rank text loader (what a dataset boost_titan does not read
    itself gets, and what older boost_titan releases saved)."""
    from datasets import Dataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    data = Dataset.from_dict({"text": [f"document {i} " + "river " * i for i in range(40)]})
    ds = HuggingFaceTextDataset.__new__(HuggingFaceTextDataset)
    ds.dataset_name, ds._tokenizer, ds.seq_len, ds.infinite = "x", tok, 16, True
    ds._sample_idx, ds._token_buffer = 0, []
    from datasets.distributed import split_dataset_by_node

    ds._data, ds._text_processor = split_dataset_by_node(data, rank, dp), lambda s: s["text"]
    return ParallelAwareDataloader(ds, dp_rank=rank, dp_world_size=dp, batch_size=2)


def test_positions_through_dcp_and_what_is_refused(corpora, tmp_path, tok):
    from boost_titan.checkpoint.data_position import DataResumeError

    _, found = corpora
    both = [found["a"][1], found["b"][1]]
    weights = [Fraction(7), Fraction(3)]
    saver = _loader(both, 2, 1, weights=weights)
    it = iter(saver)
    for _ in range(3):
        next(it)
    _dcp(tmp_path / "ours", {"dataloader": saver})
    resumed = _loader(both, 4, 3, local=1, weights=weights)
    _dcp(tmp_path / "ours", None, resumed)
    assert resumed.samples == 3 * 4
    # a crafted position pickle runs nothing (no global allowed)
    marker = tmp_path / "PWNED"
    with pytest.raises(BaseException) as e:
        resumed.load_state_dict({"position": pickle.dumps(_RunsCommand(f"touch {marker}"))})
    assert "its data loader state dataloader.position refers to posix.system" in str(e.value)
    assert not marker.exists()
    # per-rank positions of older releases, and torchtitan's loader at another dp
    old = [_per_rank_loader(2, r, tok) for r in range(2)]
    _dcp(tmp_path / "two", {"dataloader": {k: v for o in old for k, v in o.state_dict().items()}})
    with pytest.raises(DataResumeError) as e:
        _dcp(tmp_path / "two", None, _loader(both, 2, 0, weights=weights))
    assert str(e.value).startswith(
        f"checkpoint {tmp_path / 'two'} holds the data positions of 2 data-parallel rank(s), "
        "saved by an older boost_titan whose loader gave each rank its own shard"
    )
    with pytest.raises(DataResumeError) as e:
        _dcp(tmp_path / "two", None, _per_rank_loader(4, 0, tok))
    assert str(e.value).startswith(
        f"checkpoint {tmp_path / 'two'} was saved with data-parallel degree 2 and this run's "
        "data-parallel degree is 4 (4 processes: dp_shard 4): dataset 'x' is read by "
        "torchtitan's per-rank loader"
    )
    with pytest.raises(DataResumeError, match=r"holds one data position in boost_titan's global"):
        _dcp(tmp_path / "ours", None, _per_rank_loader(2, 0, tok))


# ---------------------------------------------------------------------------------------
# What a user owns is never written over or removed; what is read is checked as read


def _guard(seconds: int = 20):
    """A blocking call (an open of a FIFO, an unbounded Fraction) as a failure, not a hang."""
    import signal

    def stop(*_):
        raise TimeoutError(f"still blocked after {seconds} s")

    signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)


def _megatron(prefix: Path, docs: int, seed: int = 0, top: int = 8000) -> list[np.ndarray]:
    """A Megatron prefix of ``docs`` documents of random ids below ``top``."""
    rng = np.random.default_rng(seed)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    writer = indexed.IndexWriter(str(prefix) + ".bin", np.uint16)
    out = [rng.integers(2, top, int(rng.integers(200, 2000))) for _ in range(docs)]
    for doc in out:
        writer.add(doc)
    writer.finish(str(prefix) + ".idx")
    return out


def test_force_and_out_remove_and_overwrite_only_our_own_files(tmp_path, monkeypatch):
    """Issue 56 item 1: a user's files in --out are never removed or written over:
    refused in one line naming the first of them in name order, with or without
    --force; --force removes what our own records name, nothing else."""
    raw = _write_corpus(tmp_path / "raw", 3, 5)
    out = tmp_path / "out"
    out.mkdir()
    (out / "part-notes.txt").write_text("mine")
    (out / "part-00000.jsonl").write_text('{"text": "mine"}\n')
    for force in (True, False):
        with pytest.raises(CorpusError) as e:
            tokenize(source_of(str(raw)), TOKENIZER, str(out), workers=1, force=force, quiet=True)
        assert str(e.value) == (
            f"data tokenize --out {out} holds 'part-00000.jsonl' (and 1 more), which is not a "
            "file of a corpus boost_titan wrote: nothing of yours is written over or removed; "
            "give a new or empty folder, or one holding only a corpus this command wrote"
        )
        assert sorted(p.name for p in out.iterdir()) == ["part-00000.jsonl", "part-notes.txt"]
    # a corpus of ours of 3 parts replaced with --force by one of 1 part: the old parts go
    monkeypatch.setattr(text_sources, "UNIT_BYTES", 1500)
    ours = tmp_path / "ours"
    first = tokenize(source_of(str(raw)), TOKENIZER, str(ours), workers=1, quiet=True)
    assert len(first["parts"]) == 3
    monkeypatch.setattr(text_sources, "UNIT_BYTES", 64 << 20)
    other = _write_corpus(tmp_path / "other", 1, 4, seed=3)
    (ours / "notes.txt").write_text("mine")
    with pytest.raises(CorpusError, match=r"holds 'notes.txt', which is not a file of a corpus"):
        tokenize(source_of(str(other)), TOKENIZER, str(ours), workers=1, force=True, quiet=True)
    assert open_corpus(str(ours)).digest == first["digest"]  # untouched
    (ours / "notes.txt").unlink()
    (ours / "part-00001.bin.tmp.4242").write_bytes(b"a killed writer's")
    second = tokenize(source_of(str(other)), TOKENIZER, str(ours), workers=1, force=True,
                      quiet=True)  # fmt: skip
    assert len(second["parts"]) == 1
    assert sorted(p.name for p in ours.iterdir()) == [
        "corpus.json", "part-00000.bin", "part-00000.blocks", "part-00000.idx",
        "part-00000.json", "part-00001.bin.tmp.4242",
    ]  # fmt: skip


def test_out_inside_from_or_from_inside_out_is_refused(tmp_path):
    """Issue 56 item 2: --out equal to, inside or holding --from (symbolic links resolved)
    is one line before anything is written; so is a seal whose --out holds its input."""
    from boost_titan.data.seal import seal

    raw = _write_corpus(tmp_path / "raw", 2, 5)
    (tmp_path / "link").symlink_to(raw)
    before = sorted(p.name for p in raw.iterdir())
    for out, where in ((raw, "is"), (raw / "tok", "is inside"), (tmp_path / "link" / "tok",
                       "is inside"), (tmp_path, "holds")):  # fmt: skip
        with pytest.raises(CorpusError) as e:
            tokenize(source_of(str(raw)), TOKENIZER, str(out), workers=1, force=True, quiet=True)
        assert str(e.value).startswith(f"data tokenize --out {out} {where} --from {raw} "), e
        assert sorted(p.name for p in raw.iterdir()) == before
    assert not (raw / "tok").exists()
    _megatron(tmp_path / "m" / "web", 3)
    with pytest.raises(CorpusError, match=r"data seal --out .*/m holds the input .*/m/web.idx"):
        seal([str(tmp_path / "m" / "web")], TOKENIZER, str(tmp_path / "m"))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["web.bin", "web.idx"]


def test_a_part_is_checked_block_by_block_as_it_is_read(tmp_path):
    """Issue 56 item 3: a byte changed in a sealed part (ids still in the vocabulary) is
    refused at the first read of its block, naming the part and the block's bytes, and
    not before; blocks are checked once; ids above the corpus' largest, a model's
    vocabulary below it and a version-1 corpus (no block digests) are one line each."""
    from boost_titan.data import part_blocks
    from boost_titan.data.seal import seal
    from boost_titan.data.tokenized import manifest_digest

    docs = _megatron(tmp_path / "web", 120)
    stream = np.concatenate(docs)
    assert stream.nbytes > 3 * part_blocks.BLOCK  # blocks 0..3 at least
    seal([str(tmp_path / "web")], TOKENIZER, str(tmp_path / "sealed"))
    corpus = open_corpus(str(tmp_path / "sealed"))
    reader = WindowReader(corpus, 1000)  # 2,000 bytes a window
    assert reader.read(0).tolist() == stream[:1000].tolist()
    assert reader.bytes_checked == part_blocks.BLOCK
    reader.read(1)  # the same block: not read whole again
    assert reader.bytes_checked == part_blocks.BLOCK and reader.bytes_read == 4000
    bin_path = tmp_path / "web.bin"
    data = bytearray(bin_path.read_bytes())
    at = 2 * part_blocks.BLOCK + 101  # block 2; the id stays in the vocabulary
    data[at] ^= 1
    bin_path.write_bytes(bytes(data))
    fresh = WindowReader(corpus, 1000)
    assert fresh.read(0).tolist() == stream[:1000].tolist()  # block 0: still as sealed
    window = (at // 2) // 1000
    with pytest.raises(CorpusError) as e:
        fresh.read(window)
    assert str(e.value) == (
        f"tokenized corpus {corpus.path}: {tmp_path / 'web'}.bin: its block 2 (bytes "
        f"131072..196607) does not match the digest corpus.json records for it: the file "
        "was damaged or edited since the corpus was made (make the corpus again)"
    )
    # ids above the corpus' largest, with digests forged to match: refused as read
    data[at] ^= 1
    data[at - 1 : at + 1] = np.array([65535], np.uint16).tobytes()
    bin_path.write_bytes(bytes(data))
    hasher = part_blocks.BlockHasher()
    hasher.update(bytes(data))
    (tmp_path / "sealed" / "part-00000.blocks").write_bytes(hasher.finish())
    manifest = json.loads((tmp_path / "sealed" / MANIFEST).read_text())
    import xxhash

    manifest["parts"][0]["blocks"]["digest"] = xxhash.xxh3_128_hexdigest(hasher.finish())
    manifest["digest"] = manifest_digest(manifest)
    (tmp_path / "sealed" / MANIFEST).write_text(json.dumps(manifest))
    forged = open_corpus(str(tmp_path / "sealed"))
    with pytest.raises(CorpusError) as e:
        WindowReader(forged, 1000).read(window)
    top = forged.manifest["max_token"]
    assert str(e.value) == (
        f"tokenized corpus {corpus.path}: {tmp_path / 'web'}.bin: byte {at - 1} holds token "
        f"id 65535, outside 0..{top} (the corpus' largest id, corpus.json): the part was "
        "edited since the corpus was made"
    )
    with pytest.raises(CorpusError, match=rf"holds token id {top} and the model's vocabulary"):
        _loader([forged], 1, 0, vocab_size=top)
    manifest["version"] = 1
    manifest["digest"] = manifest_digest(manifest)
    (tmp_path / "sealed" / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(CorpusError) as e:
        open_corpus(str(tmp_path / "sealed"))
    assert str(e.value).endswith(
        "corpus.json has version 1 (written before the digests per block that let training "
        "check each part as it reads it); this boost_titan reads version 2: seal it again: "
        "`boost-titan data seal` with the same prefixes"
    )


def test_fifos_and_folders_as_parts_are_refused_without_blocking(tmp_path, corpora):
    """Issue 56 items 4 and 10: a FIFO as a corpus part, or as a Megatron .idx/.bin given
    to seal, and a folder as a .bin, are one line saying what they are (never an open
    that waits for a writer, never "does not exist")."""
    from boost_titan.data.seal import seal

    _, corpus = corpora[1]["a"]
    copy = tmp_path / "copy"
    shutil.copytree(corpus.path, copy)
    (copy / "part-00000.bin").unlink()
    os.mkfifo(copy / "part-00000.bin")
    _megatron(tmp_path / "web", 3)
    os.rename(tmp_path / "web.bin", tmp_path / "kept.bin")
    try:
        _guard()
        with pytest.raises(CorpusError) as e:
            WindowReader(open_corpus(str(copy)), 17).read(0)
        assert str(e.value) == (
            f"tokenized corpus {copy}: {copy / 'part-00000.bin'} is a FIFO, not a regular file"
        )
        os.mkfifo(tmp_path / "web.bin")
        with pytest.raises(CorpusError, match=r"web.bin is a FIFO, not a regular file$"):
            seal([str(tmp_path / "web")], TOKENIZER, str(tmp_path / "s1"))
        os.unlink(tmp_path / "web.bin")
        os.mkdir(tmp_path / "web.bin")
        with pytest.raises(CorpusError, match=r"web.bin is a directory, not a regular file$"):
            seal([str(tmp_path / "web")], TOKENIZER, str(tmp_path / "s2"))
        os.rename(tmp_path / "web.idx", tmp_path / "kept.idx")
        os.mkfifo(tmp_path / "web.idx")
        with pytest.raises(CorpusError, match=r"web.idx is a FIFO, not a regular file$"):
            seal([str(tmp_path / "web")], TOKENIZER, str(tmp_path / "s3"))
    finally:
        import signal

        signal.alarm(0)
    assert not any((tmp_path / f"s{i}").exists() for i in (1, 2, 3))


def test_a_blend_weight_is_bounded_before_it_is_made_exact():
    """Issue 56 item 9: ``1e100000000`` (Fraction would build a 332-million-bit integer
    first) is refused at once, in one line naming the value and the range."""
    from boost_titan.data.loader import parse_blend

    try:
        _guard()
        for weight, why in (("1e100000000", "is outside 1e-06..1e+06, the range of a blend "
                             "weight"), ("1e-100000000", "is outside 1e-06..1e+06"),
                            ("inf", "is not a number of at most 32 characters"),
                            ("1" * 40, "is not a number of at most 32 characters")):  # fmt: skip
            with pytest.raises(BlendError) as e:
                parse_blend([f"{weight}:/data/web"])
            assert str(e.value).startswith(
                f"[training] dataset_blend entry '{weight}:/data/web': weight '{weight}' {why}"
            ), str(e.value)
    finally:
        import signal

        signal.alarm(0)
    assert [w for w, _ in parse_blend(["1e6:/a", "1e-6:/b", "1/3:/c"])] == [
        Fraction(10**6), Fraction(1, 10**6), Fraction(1, 3),
    ]  # fmt: skip
