"""DataLoader workers (``[training.dataloader] num_workers``) over torchtitan's text
dataset: a map-style dataset is read once per worker, so boost_titan refuses it where
torchtitan's loader reads it (validation of ``boost_corpus_val``, datasets of
torchtitan's registry; boost_titan.data.workers); a streamed one is split among the
workers. boost_titan's training loader (the global order) has workers tokenize chunks
of the one stream in turn: the same batches with or without them."""

import itertools
import json

import pytest

from boost_titan.data.workers import DataloaderWorkersError, check_workers

DOCS = [f"document number {i} " * 20 for i in range(200)]


@pytest.fixture(scope="module")
def loaders(corpus_dir, tmp_path_factory):
    """``make(kind, workers)``: a ParallelAwareDataloader over DOCS, one rank, seq 64,
    finite; kind "map" (an in-memory datasets.Dataset) or "stream" (4 jsonl files,
    load_dataset(streaming=True))."""
    import datasets
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    root = tmp_path_factory.mktemp("stream")
    files = []
    for f in range(4):
        files.append(str(root / f"p{f}.jsonl"))
        rows = DOCS[f * 50 : (f + 1) * 50]
        (root / f"p{f}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in rows))
    tok = HuggingFaceTokenizer(str(corpus_dir / "tokenizer"))
    load = {
        "map": lambda _: datasets.Dataset.from_dict({"text": DOCS}),
        "stream": lambda _: datasets.load_dataset(
            "json", data_files=files, split="train", streaming=True
        ),
    }
    for kind, fn in load.items():
        DATASETS[f"workers_{kind}"] = DatasetConfig(
            path="-", loader=fn, sample_processor=lambda s: s["text"]
        )

    def make(kind: str, workers: int):
        ds = HuggingFaceTextDataset(f"workers_{kind}", None, tok, seq_len=64, infinite=False)
        return ParallelAwareDataloader(
            ds, dp_rank=0, dp_world_size=1, batch_size=1, num_workers=workers
        )

    return make


def test_map_style_is_read_once_per_worker_and_refused(loaders):
    # why the guard exists: 2 workers over a map-style dataset give every batch twice
    alone = sum(1 for _ in loaders("map", 0))
    assert sum(1 for _ in loaders("map", 2)) == 2 * alone
    check_workers(loaders("map", 0), "training", "workers_map")
    with pytest.raises(DataloaderWorkersError) as e:
        check_workers(loaders("map", 2), "training", "workers_map")
    assert str(e.value).startswith(
        "[training.dataloader] num_workers = 2 with dataset 'workers_map', a map-style dataset"
    )


def test_streamed_is_split_among_workers(loaders):
    # the same documents, streamed from 4 files: 2 workers read each file once; each
    # worker packs its own token buffer, so at most one partial sequence per worker
    # is left over at the end
    alone = sum(1 for _ in loaders("stream", 0))
    two = loaders("stream", 2)
    check_workers(two, "training", "workers_stream")
    assert alone - 2 <= sum(1 for _ in two) <= alone


def test_the_trainers_loader_reads_map_style_data_with_workers(corpus_dir):
    """The train spec's own loader (boost_titan.data.loader), on the embedded corpus:
    2 workers give the batches of none (before the global order: refused, each worker
    would have read every document)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from torchtitan.protocols.train_spec import get_train_spec

    from boost_titan.train.config_check.parse import parse_config

    config = ["--job.config_file", "train_configs/debug_cola.toml"]
    tok = HuggingFaceTokenizer(str(corpus_dir / "tokenizer"))
    batches = []
    for workers in ("0", "2"):
        job = parse_config([*config, "--training.dataloader.num_workers", workers])
        loader = get_train_spec(job.model.name).build_dataloader_fn(2, 1, tok, job)
        batches.append([labels.tolist() for _, labels in itertools.islice(loader, 3)])
    assert batches[0] == batches[1] and len(batches[0]) == 3
