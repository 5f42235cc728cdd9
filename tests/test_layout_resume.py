"""Resuming a checkpoint under another layout (``boost_titan.checkpoint.data_position``), on
real gloo
ranks, from one BTP TP2 run (data-parallel degree 1, 3 steps, checkpoints at steps 2
and 3):

* TP2 -> TP2 x FSDP2 (dp 1 -> 2), the issue's reproduction: refused in one line naming
  both layouts and the ways forward, before anything is loaded; DCP's ``Missing key``
  error is gone;
* the same with ``[boost] data_resume = "reshard"``: step, LR schedule and model resume;
  new rank 0 continues the saved rank's stream token for token (its data position
  after step 3 is the uninterrupted TP2 run's), new rank 1 starts its shard, and the
  logged counts match an independent count of the corpus's shards;
* dp 2 -> 1 (that run's step 3 resumed as TP2) with "reshard": documents read again,
  skipped and dropped tokens as counted here, the new position as tokenized here;
* ``--checkpoint.exclude_from_loading dataloader`` (named in the refusal): trains,
  the data restarts from its first document;
* same dp degree, other layout (TP2 -> 1 process): resumes exactly as before.

The arithmetic itself (shards as ``datasets`` cuts them, repeated / skipped counts) is
checked without processes against brute-force sets."""

from __future__ import annotations

import functools
import pickle
import random
import re
import shutil
import warnings
from pathlib import Path

import pytest
from helpers import run_training

from boost_titan.checkpoint.data_position import (
    DataResumeError,
    _check_reshardable,
    contiguous_shards,
    plan_reshard,
)

TP2 = "debug_cola_btp_tp2.toml"
TP2_FSDP2 = "debug_cola_btp_tp2_fsdp2.toml"
BATCH, SEQ = 4, 256  # base/debug.toml's local_batch_size and seq_len
COMMON = ("--checkpoint.enable", "--validation.no-enable")
STEPS_3 = (*COMMON, "--training.steps", "3")


# ---------------------------------------------------------------------------------------
# The arithmetic, no processes


def test_contiguous_shards_are_datasets_own():
    from datasets import Dataset

    for n in (9, 13, 4697):  # datasets refuses more shards than rows
        ds = Dataset.from_dict({"i": list(range(n))})
        for degree in (1, 2, 3, 4, 8):
            ours = contiguous_shards(n, degree)
            for rank, (start, end) in enumerate(ours):
                shard = ds.shard(num_shards=degree, index=rank, contiguous=True)
                assert shard["i"] == list(range(start, end)), (n, degree, rank)


@functools.cache
def _datasets_shards(n: int, degree: int) -> list[list[int]]:
    """The documents of each rank, as datasets' Dataset.shard cuts them."""
    from datasets import Dataset

    ds = Dataset.from_dict({"i": list(range(n))})
    return [ds.shard(num_shards=degree, index=r, contiguous=True)["i"] for r in range(degree)]


def _brute_force(n, positions, new_degree):
    """(documents each new rank skips, read again, skipped), by sets of documents."""
    consumed = {
        d for shard, pos in zip(_datasets_shards(n, len(positions)), positions) for d in shard[:pos]
    }
    new = _datasets_shards(n, new_degree)
    skips = [len(consumed & set(shard)) for shard in new]
    behind = {d for shard, k in zip(new, skips) for d in shard[:k]}
    ahead = {d for shard, k in zip(new, skips) for d in shard[k:]}
    return skips, len(consumed & ahead), len(behind - consumed)


def test_reshard_plan_counts_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        old, new = rng.randrange(1, 6), rng.randrange(1, 6)
        n = rng.randrange(max(old, new), 24)
        positions = [rng.randrange(0, e - s + 1) for s, e in contiguous_shards(n, old)]
        buffered = [rng.randrange(0, 300) for _ in range(old)]
        plan = plan_reshard(n, positions, buffered, new)
        skips, repeated, skipped = _brute_force(n, positions, new)
        assert plan.positions == skips and sum(skips) == sum(positions)  # total kept
        assert (plan.repeated, plan.skipped) == (repeated, skipped), (n, positions, new)
        assert repeated == skipped  # the total is kept: what is read again, is skipped
        assert plan.dropped_tokens == sum(
            b for r, b in enumerate(buffered) if r not in set(plan.handover.values())
        )


def test_reshard_plan_is_exact_where_shards_line_up():
    # dp 1 -> 2, and 2 -> 4 (every old shard boundary is a new one): nothing is read
    # again or skipped, every buffer continues on the new rank that reads on
    plan = plan_reshard(4697, [3], [1178], 2)
    assert plan.positions == [3, 0] and plan.handover == {0: 0}
    assert (plan.repeated, plan.skipped, plan.dropped_tokens) == (0, 0, 0)
    plan = plan_reshard(4697, [3, 5], [10, 20], 4)
    assert plan.positions == [3, 0, 5, 0] and plan.handover == {0: 0, 2: 1}
    assert (plan.repeated, plan.skipped, plan.dropped_tokens) == (0, 0, 0)
    # 3 -> 9 on 13 documents: old boundary 5 falls inside new shard [4, 6) (sizes
    # 2,2,2,2,1,...): document 4 (rank 0's last, unread) is skipped, 5 read again
    plan = plan_reshard(13, [2, 1, 0], [0, 0, 0], 9)
    assert plan.positions == [2, 0, 1, 0, 0, 0, 0, 0, 0]
    assert (plan.repeated, plan.skipped) == (1, 1)
    # dp 2 -> 1: rank 1's 5 documents are read again, 5 of rank 0's unread ones skipped
    plan = plan_reshard(4697, [3, 5], [10, 20], 1)
    assert plan.positions == [8] and plan.handover == {}
    assert (plan.repeated, plan.skipped, plan.dropped_tokens) == (5, 5, 30)


def test_reshard_plan_refuses_a_position_past_its_shard():
    with pytest.raises(
        DataResumeError,
        match=r"saved data-parallel rank 1 had read 9 documents of a shard that holds 5 of the 10",
    ):
        plan_reshard(10, [0, 9], [0, 0], 1)


def test_reshard_refuses_a_streamed_dataset():
    from datasets import Dataset

    class Loader:
        num_workers = 0

        class dataset:  # noqa: N801  (torchtitan's HuggingFaceTextDataset, streamed)
            dataset_name = "c4"
            _sample_idx = 0
            _data = Dataset.from_dict({"text": ["a", "b"]}).to_iterable_dataset()

    with pytest.raises(DataResumeError, match=r"dataset 'c4' is streamed \(IterableDataset\)"):
        _check_reshardable(Loader, "ckpt/step-2")


# ---------------------------------------------------------------------------------------
# Real runs


def _items(step_dir: Path) -> dict:
    """The checkpoint's data loader states (unpickled), LR scheduler and step."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from boost_titan.checkpoint import safe_metadata

    meta = safe_metadata.loads((step_dir / ".metadata").read_bytes(), str(step_dir))
    keys = {
        k
        for k, v in meta.state_dict_metadata.items()
        if isinstance(v, BytesStorageMetadata)
        and k.split(".")[0] in ("dataloader", "lr_scheduler", "train_state")
    }
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        items = _load_state_dict_from_keys(keys, checkpoint_id=str(step_dir))
    loader = items["dataloader"]
    items["positions"] = {
        int(k.removeprefix("dp_rank_")): pickle.loads(v)["dataset_state"]
        for k, v in loader.items()
        if k != "world_size"
    }
    return items


def _resume_folder(root: Path, name: str, step_dir: Path) -> Path:
    dump = root / name
    shutil.copytree(step_dir, dump / "checkpoint" / step_dir.name)
    return dump


@pytest.fixture(scope="module")
def corpus(corpus_dir):
    """The training split's documents and the tokenizer the runs use."""
    from datasets import load_from_disk
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    docs = load_from_disk(str(corpus_dir / "train"))["text"]
    return docs, HuggingFaceTokenizer(str(corpus_dir / "tokenizer"))


def _after_one_step(corpus, first_doc: int, buffer: list[int]) -> tuple[int, list[int]]:
    """(documents read, token buffer) after one step of BATCH sequences of SEQ + 1
    tokens packed from ``buffer`` then the documents from ``first_doc`` on, as
    torchtitan's text dataset packs them (bos + tokens + eos per document)."""
    docs, tokenizer = corpus
    buf, read, sequences = list(buffer), 0, 0
    for text in docs[first_doc:]:
        buf.extend(tokenizer.encode(text, add_bos=True, add_eos=True))
        read += 1
        while len(buf) >= SEQ + 1:
            buf, sequences = buf[SEQ + 1 :], sequences + 1
            if sequences == BATCH:
                return read, buf
    raise AssertionError("corpus too short")


def _assert_same_stream(corpus, shard_start: int, a: dict, b: dict) -> None:
    """Two saved positions in one shard read on the same tokens. A position is the
    token buffer followed by the documents from ``sample_idx`` on; a resumed loader
    reads one document before it yields from its buffer (torchtitan's loop), so the
    same stream may be saved with one more document moved into the buffer."""
    docs, tokenizer = corpus
    if a["sample_idx"] > b["sample_idx"]:
        a, b = b, a
    buffer = list(a["token_buffer"])
    for text in docs[shard_start + a["sample_idx"] : shard_start + b["sample_idx"]]:
        buffer.extend(tokenizer.encode(text, add_bos=True, add_eos=True))
    assert buffer == b["token_buffer"], (a["sample_idx"], b["sample_idx"])


@pytest.fixture(scope="module")
def tp2_run(seed_checkpoint, tmp_path_factory):
    """BTP TP2 (dp 1) from the shared seed checkpoint: 3 steps, checkpoints at 2 and 3."""
    root = tmp_path_factory.mktemp("layout")
    run = run_training(
        TP2,
        2,
        root / "tp2",
        *STEPS_3,
        "--checkpoint.initial_load_path",
        str(seed_checkpoint("debug_cola.toml")),
        "--checkpoint.interval",
        "2",
    )
    return root, run


@pytest.mark.slow
def test_dp_change_is_refused_in_one_line(tp2_run):
    root, full = tp2_run
    step2 = full.dump_folder / "checkpoint" / "step-2"
    dump = _resume_folder(root, "refused", step2)
    run = run_training(TP2_FSDP2, 4, dump, *STEPS_3, expect_failure=True)
    folder = dump / "checkpoint" / "step-2"
    head = (
        f"checkpoint {folder} was saved with data-parallel degree 1 (2 processes wrote it) "
        "and this run's data-parallel degree is 2 (4 processes: dp_shard 2, tp 2): "
    )
    # each rank ends on the line itself (a SystemExit: no traceback)
    lines = re.findall(rf"^\[rank(\d)\]:({re.escape(head)}.*)$", run.output, re.M)
    assert sorted(rank for rank, _ in lines) == ["0", "1", "2", "3"], run.output[-4000:]
    line = lines[0]
    assert "Traceback" not in run.output
    for way in (
        "resume with data-parallel degree 1",
        '[boost] data_resume = "reshard" (--boost.data_resume reshard)',
        "--checkpoint.exclude_from_loading dataloader",
    ):
        assert way in line[1]
    assert "Missing key in checkpoint state_dict" not in run.output
    assert not run.loss  # refused before the first step
    assert sorted(p.name for p in (dump / "checkpoint").iterdir()) == ["step-2"]


@pytest.fixture(scope="module")
def resharded_up(tp2_run):
    """TP2 step 2 resumed as TP2 x FSDP2 (dp 1 -> 2) with data_resume = "reshard"."""
    root, full = tp2_run
    dump = _resume_folder(root, "up", full.dump_folder / "checkpoint" / "step-2")
    run = run_training(TP2_FSDP2, 4, dump, *STEPS_3, "--boost.data_resume", "reshard")
    return dump, run


_COUNTS = re.compile(
    r"data position resharded \(\[boost\] data_resume = \"reshard\"\), data-parallel degree "
    r"(\d+) -> (\d+), checkpoint (\S+): the saved ranks had consumed (\d+) of (\d+) documents;"
    r".*; (\d+) documents consumed before will be read again, (\d+) never-read documents are "
    r"skipped, (\d+) buffered tokens are dropped"
)


@pytest.mark.slow
def test_reshard_up_resumes_and_continues_the_stream(tp2_run, resharded_up, corpus):
    _, full = tp2_run
    dump, run = resharded_up
    saved = _items(full.dump_folder / "checkpoint" / "step-2")["positions"]
    n_docs = len(corpus[0])
    m = _COUNTS.search(run.output)
    assert m, run.output[-4000:]
    consumed = saved[0]["sample_idx"]
    assert m.groups() == (
        "1", "2", str(dump / "checkpoint" / "step-2"), str(consumed), str(n_docs), "0", "0", "0"
    )  # fmt: skip
    assert sorted(run.loss[0]) == [3]  # the step resumed

    after = _items(dump / "checkpoint" / "step-3")
    reference = _items(full.dump_folder / "checkpoint" / "step-3")
    assert after["train_state"]["step"] == 3
    # the LR schedule resumed: same epoch and rate as the uninterrupted run's
    for key in ("last_epoch", "_last_lr"):
        assert after["lr_scheduler"][key] == reference["lr_scheduler"][key], key
    # new rank 0 read on exactly where the saved rank stopped: after step 3 it stands
    # where the uninterrupted TP2 run stands, token for token
    _assert_same_stream(corpus, 0, after["positions"][0], reference["positions"][0])
    # new rank 1 started its shard (the second half of the corpus) at its first document
    second_half = contiguous_shards(n_docs, 2)[1][0]
    read, buffer = _after_one_step(corpus, second_half, [])
    assert after["positions"][1] == {"sample_idx": read, "token_buffer": buffer}


@pytest.mark.slow
def test_reshard_down_counts_what_is_repeated_and_skipped(tp2_run, resharded_up, corpus):
    root, _ = tp2_run
    up_dump, _ = resharded_up
    step3 = up_dump / "checkpoint" / "step-3"
    saved = _items(step3)["positions"]
    dump = _resume_folder(root, "down", step3)
    run = run_training(
        TP2, 2, dump, *COMMON, "--training.steps", "4", "--boost.data_resume", "reshard"
    )
    # independent count, by sets of documents of the two saved shards
    n_docs = len(corpus[0])
    halves = contiguous_shards(n_docs, 2)
    consumed = {
        d
        for (start, _), r in zip(halves, (0, 1))
        for d in range(start, start + saved[r]["sample_idx"])
    }
    position = len(consumed)  # the single new shard skips every consumed document
    repeated = len(consumed - set(range(position)))
    skipped = len(set(range(position)) - consumed)
    dropped = sum(len(s["token_buffer"]) for s in saved.values())
    assert repeated > 0  # rank 1's documents lie past rank 0's: this case costs something
    m = _COUNTS.search(run.output)
    assert m, run.output[-4000:]
    assert m.groups() == (
        "2", "1", str(dump / "checkpoint" / "step-3"), str(position), str(n_docs),
        str(repeated), str(skipped), str(dropped),
    )  # fmt: skip
    assert sorted(run.loss[0]) == [4]
    read, buffer = _after_one_step(corpus, position, [])
    after = _items(dump / "checkpoint" / "step-4")["positions"]
    assert after == {0: {"sample_idx": position + read, "token_buffer": buffer}}


@pytest.mark.slow
def test_excluding_the_data_loader_restarts_the_data(tp2_run, corpus):
    root, full = tp2_run
    dump = _resume_folder(root, "exclude", full.dump_folder / "checkpoint" / "step-2")
    run = run_training(
        TP2_FSDP2, 4, dump, *STEPS_3, "--checkpoint.exclude_from_loading", "dataloader"
    )
    assert sorted(run.loss[0]) == [3]
    after = _items(dump / "checkpoint" / "step-3")["positions"]
    for rank, (start, _) in enumerate(contiguous_shards(len(corpus[0]), 2)):
        read, buffer = _after_one_step(corpus, start, [])
        assert after[rank] == {"sample_idx": read, "token_buffer": buffer}


@pytest.mark.slow
def test_same_dp_degree_other_layout_resumes_exactly(tp2_run, corpus):
    root, full = tp2_run
    dump = _resume_folder(root, "one", full.dump_folder / "checkpoint" / "step-2")
    run = run_training("debug_cola.toml", 1, dump, *STEPS_3)
    assert "data position resharded" not in run.output
    assert sorted(run.loss[0]) == [3]
    # the same batch on the same weights: TP2's loss up to the reduction order
    assert abs(run.loss[0][3] - full.loss[0][3]) <= 2e-4 * full.loss[0][3]
    after = _items(dump / "checkpoint" / "step-3")
    reference = _items(full.dump_folder / "checkpoint" / "step-3")
    assert sorted(after["positions"]) == [0]
    _assert_same_stream(corpus, 0, after["positions"][0], reference["positions"][0])
