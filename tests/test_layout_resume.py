"""Resuming a checkpoint under another layout: the same global order of windows
(``boost_titan.data.order``), on real gloo ranks.

Two uninterrupted FSDP2 runs at data-parallel degree 2 (CoLA debug model, 8 steps, a
checkpoint at step 4, ``global_batch_size`` 8 windows of 257 tokens), each resumed from
its step 4 under other layouts:

* the embedded corpus (map-style, ``boost_corpus``), no DataLoader workers: resumed at
  dp 1 as 2 pipeline stages (1F1B, local batch 4 x 2 accumulation steps, 2 workers)
  and at dp 4 (local batch 2);
* a streamed ``local_text`` corpus of jsonl files with every 3rd document held out,
  small enough to re-loop every ~2 steps, read by 2 DataLoader workers: resumed at dp 1
  (no workers), dp 2 as BTP TP2 x FSDP2 (4 processes, no workers) and dp 4 (2 workers
  per rank).

Every process dumps the token ids of each batch it yields (``BOOST_TITAN_DUMP_BATCHES``).
Checked: the uninterrupted run's windows are the corpus' token stream (the streamed
corpus tokenized here, independently: BOS + tokens + EOS per document, as torchtitan
packs it) cut into windows of 257 tokens, each global sample the window the shuffle's
arithmetic names (checked against brute force in test_tokenized_data.py); each resumed
run trains steps 5-8 on
the uninterrupted run's global batches (window for window, token for token, each step
on its own 8 windows) with the same losses (1e-5 relative); and every run's step-8
checkpoint holds the same position. (The same dp degree and layout resumes bitwise:
test_local_text.py; ``--checkpoint.exclude_from_loading dataloader`` restarting the data
at window 0: there too.)

Refusals (another corpus, seed, seq_len, tokenizer; checkpoints of the per-rank
loaders) and the order arithmetic are checked without processes in
test_tokenized_data.py."""

from __future__ import annotations

import json
import os
import random
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
from helpers import REPO_ROOT, run_training

from boost_titan.data.window_loader import DUMP_ENV

FSDP2 = "debug_cola_fsdp2.toml"  # CoLA, data_parallel_shard_degree 2
WINDOW = 257  # base/debug.toml's seq_len 256, plus the label
GLOBAL = 8  # windows per step: --training.global_batch_size
COMMON = (
    "--checkpoint.enable", "--checkpoint.interval", "4", "--training.steps", "8",
    "--validation.no-enable", "--training.global_batch_size", str(GLOBAL),
    "--boost.profile_freq", "0", "--metrics.no-enable_tensorboard",
)  # fmt: skip
WORDS = "the a river stone light model train data city north small old quiet green".split()
EVERY = 3  # the streamed corpus' dataset_holdout_every


def _layout(dp: int, workers: int, tp: int = 1, pp: int = 1):
    """(config, processes, overrides) of a layout with 8-window steps: FSDP over dp
    ranks (local batch 8 / dp, at most 4: dp 1 accumulates 2), TP (BTP) and PP (1F1B)
    around it."""
    local = min(4, GLOBAL // dp)
    args = [
        "--parallelism.data_parallel_shard_degree", str(dp),
        "--training.local_batch_size", str(local),
        "--training.dataloader.num_workers", str(workers),
    ]  # fmt: skip
    if tp > 1:
        args += ["--parallelism.tensor_parallel_degree", str(tp), "--boost.tp_plan", "btp"]
    if pp > 1:
        args += [
            "--parallelism.pipeline_parallel_degree", str(pp),
            "--parallelism.pipeline_parallel_schedule", "1F1B",
            "--parallelism.pipeline_parallel_microbatch_size", "2",
        ]  # fmt: skip
    return FSDP2, dp * tp * pp, tuple(args)


def _run(root: Path, name: str, layout, data: tuple[str, ...], step4: Path | None = None):
    config, procs, args = layout
    dump = root / name
    if step4 is not None:
        shutil.copytree(step4, dump / "checkpoint" / "step-4")
    old = os.environ.get(DUMP_ENV)
    os.environ[DUMP_ENV] = str(root / f"{name}.batches")
    try:
        run = run_training(config, procs, dump, *COMMON, *args, *data)
    finally:
        os.environ.pop(DUMP_ENV) if old is None else os.environ.__setitem__(DUMP_ENV, old)
    run.batches = _batches(root / f"{name}.batches")
    return run


def _batches(folder: Path) -> dict[int, list[tuple[int, list[int]]]]:
    """dp rank -> [(first window, the batch's windows' tokens)] in the order yielded,
    checked equal between the processes of one dp rank (TP peers) and contiguous."""
    by_rank: dict[int, list] = {}
    for path in sorted(folder.glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        rank = records[0]["dp_rank"]
        batches = []
        for r in records:
            assert r["windows"] == list(range(r["windows"][0], r["windows"][0] + len(r["tokens"])))
            batches.append((r["windows"][0], r["tokens"]))
        assert by_rank.setdefault(rank, batches) == batches, (path, rank)
    return by_rank


def _steps(run, first_step: int) -> dict[int, dict[int, list[int]]]:
    """step -> {global window index: tokens} of what the run trained on, from each rank's
    batches in order (step first_step + k // accumulation)."""
    dp = len(run.batches)
    local = len(run.batches[0][0][1])
    accumulation = GLOBAL // (local * dp)
    out: dict[int, dict[int, list[int]]] = {}
    for batches in run.batches.values():
        for k, (first, tokens) in enumerate(batches):
            step = first_step + k // accumulation
            for i, window in enumerate(tokens):
                assert out.setdefault(step, {}).setdefault(first + i, window) == window
    return out


def _reference(stream: np.ndarray, n_windows: int) -> list[list[int]]:
    """The windows of global samples 0..n_windows-1 of one corpus' token stream: each
    pass over its windows in the order of the seeded shuffle (seed 0, corpus 0)."""
    from boost_titan.data.order import pass_key, permute

    n = len(stream) // WINDOW
    out = []
    for i in range(n_windows):
        epoch, place = divmod(i, n)
        w = int(permute(np.array([place]), n, pass_key(0, 0, epoch))[0])
        out.append(stream[w * WINDOW : (w + 1) * WINDOW].tolist())
    return out


def _stream(texts, tokenizer) -> np.ndarray:
    """Each document BOS + tokens + EOS, back to back (torchtitan's packing)."""
    return np.asarray(
        [t for text in texts for t in tokenizer.encode(text, add_bos=True, add_eos=True)]
    )


def _position(step_dir: Path) -> dict:
    """The checkpoint's data position item, unpickled (no globals)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from boost_titan.checkpoint import safe_metadata

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is unavailable")
        items = _load_state_dict_from_keys({"dataloader.position"}, checkpoint_id=str(step_dir))
    return safe_metadata.dataloader_state(items["dataloader"]["position"], "position")


def _corpus_files(root: Path) -> Path:
    folder = root / "corpus"
    folder.mkdir()
    rng = random.Random(7)
    for f in range(4):
        lines = []
        for i in range(9):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))
            lines.append(json.dumps({"text": f"doc {f}.{i}: {words}"}) + "\n")
        (folder / f"part-{f}.jsonl").write_text("".join(lines))
    return folder


def _streamed_texts(folder: Path):
    for path in sorted(folder.glob("*.jsonl")):  # files in path order, every 3rd held out
        for i, line in enumerate(path.read_text().splitlines()):
            if i % EVERY != EVERY - 1:
                yield json.loads(line)["text"]


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    return HuggingFaceTokenizer(str(REPO_ROOT / "data" / "boost_corpus" / "tokenizer"))


@pytest.fixture(scope="module")
def embedded(corpus_dir, tmp_path_factory, tokenizer):
    """The embedded corpus: uninterrupted dp 2, resumed at dp 1 as PP2 (2 workers) and
    at dp 4."""

    root = tmp_path_factory.mktemp("embedded")
    full = _run(root, "full", _layout(2, 0), ())
    step4 = full.dump_folder / "checkpoint" / "step-4"
    resumed = {
        "pp2_dp1": _run(root, "pp2_dp1", _layout(1, 2, pp=2), (), step4),
        "dp4": _run(root, "dp4", _layout(4, 0), (), step4),
    }
    # the embedded corpus' tokenized stream as `make data` wrote it (its tokenization
    # is checked against the tokenizer's own encode in test_tokenized_data.py)
    from boost_titan.data.cache import ensure
    from boost_titan.data.text_sources import SavedText

    corpus = ensure(SavedText(str(corpus_dir / "train")), str(corpus_dir / "tokenizer"),
                    str(corpus_dir / "tokenized"))  # fmt: skip
    stream = np.concatenate([np.fromfile(p.prefix + ".bin", corpus.dtype) for p in corpus.parts])
    return full, resumed, _reference(stream, 8 * GLOBAL)


@pytest.fixture(scope="module")
def streamed(tmp_path_factory, tokenizer):
    """A jsonl corpus streamed by 2 workers at dp 2, resumed at dp 1, dp 2 as TP2 (no
    workers) and dp 4 (2 workers)."""
    root = tmp_path_factory.mktemp("streamed")
    folder = _corpus_files(root)
    data = (
        "--training.dataset", "local_text", "--training.dataset_path", str(folder),
        "--training.dataset_holdout_every", str(EVERY),
    )  # fmt: skip
    full = _run(root, "full", _layout(2, 2), data)
    step4 = full.dump_folder / "checkpoint" / "step-4"
    resumed = {
        "dp1": _run(root, "dp1", _layout(1, 0), data, step4),
        "tp2_dp2": _run(root, "tp2_dp2", _layout(2, 0, tp=2), data, step4),
        "dp4": _run(root, "dp4", _layout(4, 2), data, step4),
    }
    stream = _stream(_streamed_texts(folder), tokenizer)
    return full, resumed, _reference(stream, 8 * GLOBAL), len(stream) // WINDOW


def _check_resumes(full, resumed, reference) -> None:
    trained = _steps(full, 1)
    assert sorted(trained) == list(range(1, 9))
    for step, windows in trained.items():  # step s: global windows 8(s-1) .. 8s-1
        assert sorted(windows) == list(range(GLOBAL * (step - 1), GLOBAL * step)), step
        for i, tokens in windows.items():
            assert tokens == reference[i], (step, i)
    at_8 = _position(full.dump_folder / "checkpoint" / "step-8")
    assert at_8["samples"] == 8 * GLOBAL and at_8["dp_world_size"] == 2
    layout = ("dp_world_size", "local_batch_size")
    for name, run in resumed.items():
        assert sorted(run.loss[0]) == [5, 6, 7, 8], name  # resumed from step 4
        assert _steps(run, 5) == {s: trained[s] for s in range(5, 9)}, name
        for step in range(5, 9):
            a, b = run.loss[0][step], full.loss[0][step]
            assert abs(a - b) <= 1e-5 * abs(b), (name, step, a, b)
        after = _position(run.dump_folder / "checkpoint" / "step-8")
        assert {k: v for k, v in after.items() if k not in layout} == {
            k: v for k, v in at_8.items() if k not in layout
        }, name


@pytest.mark.slow
def test_embedded_resumed_at_dp_1_and_4_trains_on_the_same_global_batches(embedded):
    full, resumed, reference = embedded
    _check_resumes(full, resumed, reference)
    line = (
        "boost_corpus: data position from the checkpoint: sample 32, saved at data-parallel "
        "degree 2 x local batch 4; this run (degree 4 x 2) goes on with the same global order"
    )
    assert line in resumed["dp4"].output


@pytest.mark.slow
def test_streamed_with_workers_resumes_at_dp_1_2_4(streamed):
    full, resumed, reference, windows = streamed
    _check_resumes(full, resumed, reference)
    assert "Dataset local_text is being re-looped" in resumed["dp1"].output  # passes go on
    position = _position(full.dump_folder / "checkpoint" / "step-4")
    assert position["samples"] == 32 > windows  # saved after a pass over the corpus
