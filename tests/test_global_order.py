"""The global order of the training data (``boost_titan.data.order``,
``boost_titan.data.global_loader``), without training processes: each data-parallel
rank's loader is built in this process (its DataLoader workers are real processes).

* the arithmetic against brute force: the packer is the concatenated token stream cut
  into windows, and its position resumes it from any window; the ranks' slices cover
  each global batch once; the holdout's raw document indices;
* the loaders, over a streamed jsonl corpus (every 3rd document held out) and a
  map-style ``save_to_disk`` folder, against the stream packed here: at dp 1 the
  windows are torchtitan's own text dataset's (today's order), at every dp degree and
  worker count the ranks' batches put together are the same windows, and a position
  saved at dp 2 (the same on both ranks) resumes the stream at dp 1, 3 and 4, with or
  without workers, after re-loops of the corpus;
* checkpoints (through DCP, in this process): a one-rank checkpoint of the per-rank
  loaders (before the global order) is converted and continues exactly; what cannot be
  exact is refused in one line: per-rank positions of several ranks or of workers, a
  position over another dataset or changed documents, torchtitan's per-rank loader
  under another dp degree."""

from __future__ import annotations

import itertools
import json
import pickle
import random
import re
import warnings
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT

from boost_titan.checkpoint.data_position import DataPosition, DataResumeError
from boost_titan.data import fingerprint, local_text
from boost_titan.data.global_loader import GlobalOrderLoader
from boost_titan.data.order import (
    Packer,
    Position,
    PositionError,
    rank_windows,
    raw_index_after,
)
from boost_titan.data.sources import FileSource, SavedSource

SEQ = 16  # windows of 17 tokens
WORDS = "the a river stone light model train data city north small old quiet".split()


# ---------------------------------------------------------------------------------------
# Arithmetic


def _cut(stream: list[int], window: int, n: int) -> list[list[int]]:
    return [stream[i * window : (i + 1) * window] for i in range(n)]


def _pack(docs: list[list[int]], window: int, start: Position, count: int):
    """(windows, the position after each) of ``count`` windows packed from ``start``."""
    packer, out, positions = Packer(start, window), [], []
    feed = iter(range(start.doc, len(docs)))
    while len(out) < count:
        while packer.available < window:
            i = next(feed)
            packer.add((0, 0, i + 1), docs[i])
        out.append([t for piece in packer.cut(True) for t in piece])
        positions.append(packer.position())
    return out, positions


def test_packer_is_the_stream_cut_into_windows_and_resumes_anywhere():
    rng = random.Random(0)
    for _ in range(60):
        docs = [[rng.randrange(1000) for _ in range(rng.choice((1, 3, 9, 40)))] for _ in range(30)]
        window = rng.randrange(2, 30)
        stream = [t for d in docs for t in d]
        n = len(stream) // window
        ends = list(itertools.accumulate(len(d) for d in docs))
        windows, positions = _pack(docs, window, Position(), n)
        assert windows == _cut(stream, window, n)
        for k, position in enumerate(positions, 1):
            # canonical: after the last document entirely in windows, tokens into the next
            done = sum(1 for e in ends if e <= k * window)
            offset = k * window - (ends[done - 1] if done else 0)
            assert position == Position(k, 0, 0, done, offset), (k, window)
            again, _ = _pack(docs, window, position, n - k)
            assert again == windows[k:], (k, window)


def test_skipped_windows_advance_as_kept_ones():
    docs = [list(range(i * 10, i * 10 + 7)) for i in range(10)]
    kept, skipped = Packer(Position(), 5), Packer(Position(), 5)
    for i, d in enumerate(docs):
        kept.add((0, 0, i + 1), d)
        skipped.add((0, 0, i + 1), d)
    for _ in range(13):
        kept.cut(True)
        assert skipped.cut(False) is None
        assert kept.position() == skipped.position()


def test_pending_tokens_come_first():
    packer = Packer(Position(0, 0, 0, 2, 0, (7, 8, 9)), 2)
    packer.add((0, 0, 3), [1, 2, 3])
    assert [packer.cut(True) for _ in range(2)] == [[[7, 8]], [[9], [1]]]
    assert packer.position() == Position(2, 0, 0, 2, 1)
    packer = Packer(Position(0, 0, 0, 2, 0, (7, 8, 9)), 2)
    packer.add((0, 0, 3), [1, 2, 3])
    packer.cut(False)
    assert packer.position() == Position(1, 0, 0, 2, 0, (9,))


def test_ranks_slices_cover_each_global_batch_once():
    for dp, local, start, batch in itertools.product((1, 2, 3, 5), (1, 2, 4), (0, 7, 32), (0, 3)):
        windows = [w for r in range(dp) for w in rank_windows(start, batch, r, local, dp)]
        first = start + batch * local * dp
        assert windows == list(range(first, first + local * dp))


def test_raw_index_after_follows_the_holdout_rule():
    for every, held in itertools.product((0, 2, 3, 5), (False, True)):
        if held and not every:
            continue
        kept = [i for i in range(200) if local_text.keeps(i, every, held)]
        for k in range(1, 40):
            assert raw_index_after(k, every, held) == kept[k - 1] + 1, (every, held, k)


def test_position_state_round_trip_and_bad_states():
    p = Position(12, 1, 3, 4, 5, (1, 2))
    assert Position.from_state(pickle.loads(pickle.dumps(p.to_state())), "x") == p
    for bad in (None, [], {**p.to_state(), "version": 0}, {**p.to_state(), "doc": -1},
                {**p.to_state(), "offset": "3"}, {**p.to_state(), "pending": [1.5]}):  # fmt: skip
        with pytest.raises(PositionError) as e:
            Position.from_state(bad, "local_text: dataloader.position")
        assert str(e.value).startswith(
            "local_text: dataloader.position: the saved data position is not one this "
            "boost_titan writes"
        ) and "\n" not in str(e.value)


# ---------------------------------------------------------------------------------------
# Loaders


def _tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(REPO_ROOT / "data" / "boost_corpus" / "tokenizer"))


def _texts(rng: random.Random, n: int, tag: str) -> list[str]:
    return [
        f"{tag}.{i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    """name -> (source, fingerprint, the training documents in order, the raw data):
    "streamed" (4 jsonl files of 5-8 documents, every 3rd held out) and "saved" (a
    save_to_disk folder of 23 documents, text field "body")."""
    from datasets import Dataset

    root = tmp_path_factory.mktemp("order")
    rng = random.Random(1)
    files = []
    for f in range(4):
        docs = _texts(rng, 5 + f, f"f{f}")
        files.append(docs)
        path = root / "files" / f"part-{f}.jsonl"
        path.parent.mkdir(exist_ok=True)
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    corpus = local_text.split_every(local_text.find_corpus(str(root / "files")), 3)[0]
    kept = [d for docs in files for i, d in enumerate(docs) if i % 3 != 2]
    saved = _texts(rng, 23, "s")
    Dataset.from_dict({"body": saved, "n": list(range(23))}).save_to_disk(str(root / "saved"))
    data = Dataset.from_dict({"body": saved})
    prints = fingerprint.fingerprint(corpus)
    return {
        "streamed": (FileSource("local_text", corpus), prints, kept, corpus),
        "saved": (SavedSource("local_text", data, None, "body"), {"documents": 23}, saved, data),
    }


def _reference(docs: list[str], n: int) -> list[list[int]]:
    """The documents pass after pass, BOS + tokens + EOS each, cut into windows."""
    tok, stream = _tokenizer(), []
    for text in itertools.cycle(docs):
        stream += tok.encode(text, add_bos=True, add_eos=True)
        if len(stream) >= n * (SEQ + 1):
            return _cut(stream, SEQ + 1, n)


def _loader(corpus, dp, rank, workers=0, local=2, name="local_text") -> GlobalOrderLoader:
    source, prints, _, _ = corpus
    return GlobalOrderLoader(
        name, source, _tokenizer(), seq_len=SEQ, local_batch_size=local, dp_rank=rank,
        dp_world_size=dp, num_workers=workers, fingerprint=prints,
    )  # fmt: skip


def _windows(batch) -> list[list[int]]:
    inputs, labels = batch[0]["input"], batch[1]
    assert inputs.dtype == labels.dtype == torch.long and inputs.shape == labels.shape
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    return torch.cat([inputs, labels[:, -1:]], dim=1).tolist()


def _global(iterators, n_batches: int) -> list[list[int]]:
    """The ranks' batches put together, global batch after global batch."""
    out = []
    for _ in range(n_batches):
        for it in iterators:
            out += _windows(next(it))
    return out


def _dp1_torchtitan(corpus, n: int) -> list[list[int]]:
    """torchtitan's own HuggingFaceTextDataset at one rank over the same documents."""
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    source, _, _, data = corpus
    ds = HuggingFaceTextDataset.__new__(HuggingFaceTextDataset)
    ds.dataset_name, ds._tokenizer, ds.seq_len, ds.infinite = "x", _tokenizer(), SEQ, True
    ds._sample_idx, ds._token_buffer = 0, []
    if isinstance(source, FileSource):
        ds._data, ds._text_processor = local_text.stream(data), lambda s: s["text"]
    else:
        ds._data, ds._text_processor = data, lambda s: s["body"]
    it = iter(ds)
    return [torch.cat([x["input"], y[-1:]]).tolist() for x, y in itertools.islice(it, n)]


@pytest.mark.parametrize("kind", ["streamed", "saved"])
def test_every_dp_degree_and_worker_count_reads_the_same_windows(corpora, kind):
    corpus = corpora[kind]
    reference = _reference(corpus[2], 72)  # ~3 passes
    # dp 1, no workers: torchtitan's order; a stream's first pass only (from its second
    # pass on, datasets' set_epoch shuffles the files' order: the global order reads
    # them in path order every pass)
    tok = _tokenizer()
    first_pass = sum(len(tok.encode(d, add_bos=True, add_eos=True)) for d in corpus[2])
    n = 72 if kind == "saved" else first_pass // (SEQ + 1)
    assert _dp1_torchtitan(corpus, n) == reference[:n]
    for dp, workers, local in ((1, 0, 2), (1, 2, 3), (2, 0, 2), (3, 2, 2), (4, 0, 1)):
        its = [iter(_loader(corpus, dp, r, workers, local)) for r in range(dp)]
        n = 72 // (dp * local)
        assert _global(its, n) == reference[: n * dp * local], (dp, workers, local)


@pytest.mark.parametrize("kind", ["streamed", "saved"])
def test_a_position_saved_at_dp2_resumes_at_dp_1_3_4(corpora, kind):
    corpus = corpora[kind]
    reference = _reference(corpus[2], 120)
    for k in (3, 13):  # 12 / 52 windows: before and after re-loops of the corpus
        loaders = [_loader(corpus, 2, r) for r in range(2)]
        _global([iter(loader) for loader in loaders], k)
        states = [loader.state_dict() for loader in loaders]
        assert states[0] == states[1]  # one position for every rank
        saved = pickle.loads(states[0]["position"])
        assert saved["windows"] == 4 * k
        # the same position as one rank reaching that window: canonical
        one = _loader(corpus, 1, 0, local=4)
        _global([iter(one)], k)
        assert pickle.loads(one.state_dict()["position"]) == {
            **saved,
            "dp_world_size": 1,
            "local_batch_size": 4,
        }
        for dp, workers, local in ((1, 2, 2), (3, 0, 2), (4, 2, 1)):
            resumed = [_loader(corpus, dp, r, workers, local) for r in range(dp)]
            for loader in resumed:
                loader.load_state_dict(pickle.loads(pickle.dumps(states[0])))
            n = 24 // (dp * local)
            got = _global([iter(loader) for loader in resumed], n)
            assert got == reference[4 * k : 4 * k + n * dp * local], (kind, k, dp, workers)
        if k == 13 and kind == "streamed":
            assert saved["epoch"] >= 1  # saved after a re-loop


def test_a_position_over_other_data_is_refused(corpora):
    loader = _loader(corpora["saved"], 2, 0)
    _global([iter(loader)], 2)
    state = loader.state_dict()
    other = _loader(corpora["saved"], 1, 0, name="boost_corpus")
    with pytest.raises(DataResumeError) as e:
        other.load_state_dict(state)
    assert str(e.value) == (
        "boost_corpus: the checkpoint's data position was saved over dataset 'local_text', "
        "this run reads 'boost_corpus': resume with the same dataset, or keep the model, "
        "optimizer and step and restart the data from its first document with "
        "--checkpoint.exclude_from_loading dataloader"
    )
    source, _, docs, data = corpora["saved"]
    fewer = (SavedSource("local_text", data.select(range(20)), None, "body"), {"documents": 20},
             docs, data)  # fmt: skip
    with pytest.raises(DataResumeError, match=r"saved over 23 documents, .* holds 20 now"):
        _loader(fewer, 1, 0).load_state_dict(state)
    streamed = _loader(corpora["streamed"], 2, 0)
    state = streamed.state_dict()
    corpus = corpora["streamed"][3]
    changed = {**fingerprint.fingerprint(corpus), "holdout_every": 4}
    with pytest.raises(DataResumeError, match="dataset_holdout_every was 3 at the checkpoint"):
        _loader((FileSource("local_text", corpus), changed, [], corpus), 1, 0).load_state_dict(
            state
        )


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        import os

        return (os.system, (self.command,))


def test_a_crafted_position_runs_nothing(corpora, tmp_path):
    """The position item is unpickled with no global allowed (as every data loader
    state): a pickle that would run a command is refused naming the item."""
    marker = tmp_path / "PWNED"
    loader = _loader(corpora["saved"], 2, 0)
    with pytest.raises(BaseException) as e:
        loader.load_state_dict({"position": pickle.dumps(_RunsCommand(f"touch {marker}"))})
    assert "its data loader state dataloader.position refers to posix.system" in str(e.value)
    assert not marker.exists()


# ---------------------------------------------------------------------------------------
# Checkpoints through DCP (one process)


class _Dims:
    world_size, dp_shard, dp_replicate, cp, tp, pp, ep = 4, 4, 1, 1, 1, 1, 1


def _dcp_save(folder: Path, state: dict) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        dcp.save(state, checkpoint_id=str(folder))


def _dcp_load(folder: Path, loader) -> None:
    """What the checkpoint manager's dcp_load does: adapt, then DCP."""
    import torch.distributed.checkpoint as dcp

    state = DataPosition.for_run(loader, _Dims).adapt({"dataloader": loader}, folder, False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        dcp.load(state, checkpoint_id=str(folder))


def _legacy_loader(corpus, dp: int, rank: int, workers: int = 0):
    """The per-rank loader of the boost_titan before the global order: torchtitan's
    text dataset over this rank's shard, in torchtitan's ParallelAwareDataloader."""
    from torchtitan.components.dataloader import ParallelAwareDataloader

    from boost_titan.data.loader import LocalTextDataset

    source, _, _, data = corpus
    if isinstance(source, FileSource):
        ds = LocalTextDataset("local_text", data, _tokenizer(), SEQ, rank, dp, True, workers)
    else:
        from datasets.distributed import split_dataset_by_node
        from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

        ds = HuggingFaceTextDataset.__new__(HuggingFaceTextDataset)
        ds.dataset_name, ds._tokenizer, ds.seq_len, ds.infinite = "x", _tokenizer(), SEQ, True
        ds._sample_idx, ds._token_buffer = 0, []
        ds._data, ds._text_processor = split_dataset_by_node(data, rank, dp), lambda s: s["body"]
    return ParallelAwareDataloader(
        ds, dp_rank=rank, dp_world_size=dp, batch_size=2, num_workers=workers
    )


@pytest.mark.parametrize("kind", ["streamed", "saved"])
def test_a_one_rank_checkpoint_of_the_per_rank_loader_continues_exactly(corpora, kind, tmp_path):
    corpus = corpora[kind]
    reference = _reference(corpus[2], 70)
    old = _legacy_loader(corpus, 1, 0)
    it = iter(old)
    for _ in range(11):  # 22 windows: a streamed corpus' first pass, the saved one's second
        next(it)
    _dcp_save(tmp_path / "step-11", {"dataloader": old})
    for dp, workers in ((1, 0), (2, 2)):
        loaders = [_loader(corpus, dp, r, workers) for r in range(dp)]
        for loader in loaders:
            _dcp_load(tmp_path / "step-11", loader)
            assert loader.position.pending  # the old buffer, then the documents
        got = _global([iter(loader) for loader in loaders], 8 // dp)
        assert got == reference[22:38], (kind, dp)
        assert loaders[0].state_dict() == loaders[-1].state_dict()


def test_what_cannot_be_exact_is_refused_in_one_line(corpora, tmp_path):
    corpus = corpora["saved"]
    old = [_legacy_loader(corpus, 2, r) for r in range(2)]
    state = {"dataloader": {k: v for loader in old for k, v in loader.state_dict().items()}}
    _dcp_save(tmp_path / "two", state)
    with pytest.raises(DataResumeError) as e:
        _dcp_load(tmp_path / "two", _loader(corpus, 2, 0))
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'two'} holds the data positions of 2 data-parallel ranks, "
        "saved by an older boost_titan whose loader gave each rank its own shard: they do not "
        "continue the global order this boost_titan reads (the same windows at any "
        "data-parallel degree); resume it with the boost_titan that saved it, or restart the "
        "data from its first document with --checkpoint.exclude_from_loading dataloader "
        "(model, optimizer, LR schedule and step resume)"
    )
    streamed = corpora["streamed"]
    later = _legacy_loader(streamed, 1, 0)
    it = iter(later)
    for _ in range(40):  # 80 windows: the third pass, datasets shuffled the files
        next(it)
    _dcp_save(tmp_path / "later", {"dataloader": later})
    with pytest.raises(DataResumeError) as e:
        _dcp_load(tmp_path / "later", _loader(streamed, 1, 0))
    assert re.search(
        r"cannot continue this run's order \(it was saved after [2-9] passes over a streamed "
        r"corpus, and datasets shuffles the files of every pass after the first, the global "
        r"order reads them in path order\); keep the model",
        str(e.value),
    ), str(e.value)
    workers = _legacy_loader(streamed, 1, 0, workers=2)
    next(iter(workers))
    _dcp_save(tmp_path / "workers", {"dataloader": workers})
    workers._iterator._shutdown_workers()  # (else the interpreter's exit waits ~10 s)
    with pytest.raises(DataResumeError) as e:
        _dcp_load(tmp_path / "workers", _loader(streamed, 1, 0))
    assert str(e.value) == (
        f"checkpoint {tmp_path / 'workers'}: its data position was saved by the per-rank data "
        "loader of an older boost_titan and cannot continue this run's order (DataLoader "
        "workers read their own files (another order than this one's)); keep the model, "
        "optimizer and step and restart the data from its first document with "
        "--checkpoint.exclude_from_loading dataloader"
    )
    # torchtitan's per-rank loader (a dataset boost_titan does not read itself)
    with pytest.raises(DataResumeError) as e:
        _dcp_load(tmp_path / "two", _legacy_loader(corpus, 4, 0))
    assert str(e.value).startswith(
        f"checkpoint {tmp_path / 'two'} was saved with data-parallel degree 2 and this run's "
        "data-parallel degree is 4 (4 processes: dp_shard 4): dataset 'x' is read by "
        "torchtitan's per-rank loader"
    )
    glob = _loader(corpus, 2, 0)
    _dcp_save(tmp_path / "global", {"dataloader": glob})
    with pytest.raises(DataResumeError, match=r"holds one data position in boost_titan's global"):
        _dcp_load(tmp_path / "global", _legacy_loader(corpus, 2, 0))
