"""Does the text data loader keep up with training? Time to first batch, disk and tokens/s
of torchtitan's loader over a generated jsonl corpus, against what the recipes consume.

    PYTHONPATH=. .venv/bin/python benchmarks/data_loader.py --dir /tmp/dl_bench \\
        [--size-gb 2] [--files 64] [--seq 2048 4096] [--seconds 15] [--workers 0 2] [--keep]

1. Writes ``--size-gb`` of jsonl (``{"text": ...}`` a line) in ``--files`` files under
   ``--dir``: documents of the embedded corpus (``data/boost_corpus/train``) drawn with a
   fixed seed, so the text, its length distribution and its tokens are real English.
2. Raw tokenization with the embedded corpus' tokenizer (torchtitan's
   ``HuggingFaceTokenizer``, as the trainer builds it): one document at a time, as
   torchtitan's ``HuggingFaceTextDataset`` calls it, and ``tokenizers``' ``encode_batch``
   (its Rust threads, every core of this machine).
3. One loader = one rank (``dp_world_size`` 1): torchtitan's ``HuggingFaceTextDataset``
   in its ``ParallelAwareDataloader``, batch ``--batch`` (the recipes' 4) x each ``--seq``,
   over the corpus read three ways:
   arrow      ``datasets.load_dataset("json", data_files=..., split="train")``: the whole
              corpus converted to Arrow first, in a fresh ``HF_DATASETS_CACHE`` under
              ``--dir`` whose size is reported (time to first batch includes the conversion)
   streaming  the same with ``streaming=True``: files read as iterated, nothing cached
   local_text ``boost_titan.data.datasets``' loader for ``dataset = "local_text"`` as it is in
              this checkout (it reuses arrow's cache if it converts too)
   For each: seconds to the first batch, then batches for ``--seconds`` -> steady
   tokens/s. ``--workers N``: also the streaming loader with N DataLoader worker
   processes (``[training.dataloader] num_workers``), which tokenize ahead of the step.
4. What the 1B and 7B recipes consume per GPU, from the FLOPs per token the planner and
   the trainer's MFU use (``LlamaArgs.flops_per_token``) at ``--gpu-tflops`` x ``--mfu``,
   and from the BOOST paper's published 7B step time (``shared/design/boost.md`` section 7:
   A100, seq 4096, micro-batch 4, TP4, CoLA under BOOST 0.72 s/iteration), and the margin
   = the streamed loader's tokens/s (0 workers; per wall second here, and per CPU-second
   of the loader: one uncontended core) / what a rank's loader must give. With ``num_workers = 0``
   (torchtitan's default) the loader runs inside the training step: its share of each
   step is 1 / margin.

5. ``--global-dp D ...``: the trainer's own loader (``boost_titan.data.global_loader``, the
   global order) as rank 0 of ``D`` data-parallel ranks over the same files, with 0 and
   each ``--workers`` count: every rank tokenizes the whole stream and trains on 1/D of
   it, so the rate that matters is the stream's (tokens tokenized per second) and the
   largest dp it keeps up with at a recipe's need is stream rate / what a rank needs.

Everything generated is deleted at the end unless ``--keep``. Noisy on a shared machine:
figures, not assertions."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
import tomllib
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message=".*set_vital.*")
REPO = Path(__file__).resolve().parents[1]
RECIPES = ("llama2_1b", "cola_llama2_1b", "llama2_7b", "cola_llama2_7b")
PAPER_7B = {"recipe": "cola_llama2_7b", "seconds": 0.72, "tokens": 4 * 4096}  # boost.md s7


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="scratch folder (corpus + HF cache), created")
    p.add_argument("--size-gb", type=float, default=2.0, help="corpus size (default 2)")
    p.add_argument("--files", type=int, default=64, help="jsonl files (default 64)")
    p.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--batch", type=int, default=4, help="local batch size (recipes: 4)")
    p.add_argument("--seconds", type=float, default=15.0, help="steady measurement per case")
    p.add_argument(
        "--workers",
        type=int,
        nargs="*",
        default=[2],
        help="DataLoader worker counts to try on the streaming loader (0 always runs)",
    )
    p.add_argument("--modes", default="arrow,streaming,local_text")
    p.add_argument(
        "--global-dp",
        type=int,
        nargs="*",
        default=[1, 8],
        help="data-parallel degrees at which to time the trainer's global-order loader",
    )
    p.add_argument("--tokenize-mb", type=float, default=8.0, help="text for the raw encode test")
    p.add_argument(
        "--gpu-tflops",
        type=float,
        default=989.0,
        help="dense bf16 peak per GPU (default: H100 SXM, 989)",
    )
    p.add_argument("--mfu", type=float, default=0.40, help="assumed MFU (default 0.40)")
    p.add_argument("--keep", action="store_true", help="keep the corpus and the cache")
    return p.parse_args()


def du_bytes(path: Path) -> int:
    out = subprocess.run(["du", "-sb", str(path)], capture_output=True, text=True, check=True)
    return int(out.stdout.split()[0])


def make_corpus(root: Path, size_gb: float, n_files: int) -> tuple[list[str], list[str]]:
    """``n_files`` jsonl files of embedded-corpus documents drawn with seed 0; returns the
    file names and a sample of the texts."""
    from datasets import load_from_disk

    from boost_titan.data.corpus.manifest import default_corpus_dir

    train = default_corpus_dir() / "train"
    if not train.is_dir():
        sys.exit(f"error: {train} missing; build it: .venv/bin/boost-titan data build")
    texts = load_from_disk(str(train))["text"]
    lines = [(json.dumps({"text": t}) + "\n").encode() for t in texts]
    rng = random.Random(0)
    per_file = int(size_gb * 1e9 / n_files)
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in range(n_files):
        path = root / f"part-{i:05d}.jsonl"
        written = 0
        with open(path, "wb") as f:
            while written < per_file:
                chunk = b"".join(rng.choices(lines, k=16))
                f.write(chunk)
                written += len(chunk)
        files.append(str(path))
    return files, texts


def tokenize_rates(tok, texts: list[str], mb: float) -> dict[str, float]:
    """tokens/s of one-at-a-time encode (torchtitan's path) and of encode_batch."""
    sample, size = [], 0
    for t in texts:
        sample.append(t)
        size += len(t.encode())
        if size >= mb * 1e6:
            break
    out = {"mb": size / 1e6}
    t0 = time.perf_counter()
    n = sum(len(tok.encode(t, add_bos=True, add_eos=True)) for t in sample)
    out["one_at_a_time"] = n / (time.perf_counter() - t0)
    t0 = time.perf_counter()
    n = sum(
        len(e.ids)
        for i in range(0, len(sample), 64)
        for e in tok.tokenizer.encode_batch(sample[i : i + 64])
    )
    out["encode_batch"] = n / (time.perf_counter() - t0)
    out["bytes_per_token"] = size / n
    return out


def measure_loader(name: str, load, tok, seq: int, batch: int, seconds: float, workers: int):
    """(seconds to the first batch incl. ``load``, steady tokens/s, steady tokens per
    CPU-second of this process (0 workers: what one uncontended core gives; with workers
    their CPU time is elsewhere: None), batches timed)."""
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets import DatasetConfig
    from torchtitan.hf_datasets.text_datasets import DATASETS, HuggingFaceTextDataset

    DATASETS[name] = DatasetConfig(path="-", loader=lambda _: load(), sample_processor=_text)
    t0 = time.perf_counter()
    ds = HuggingFaceTextDataset(name, None, tok, seq_len=seq, infinite=True)
    extra = {"num_workers": workers}
    if workers:
        extra.update(prefetch_factor=4, persistent_workers=False)
    dl = ParallelAwareDataloader(ds, dp_rank=0, dp_world_size=1, batch_size=batch, **extra)
    it = iter(dl)
    x, _ = next(it)
    first = time.perf_counter() - t0
    assert x["input"].shape == (batch, seq)
    t1, c1, n = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t1 < seconds:
        next(it)
        n += 1
    rate = n * batch * seq / (time.perf_counter() - t1)
    cpu_rate = n * batch * seq / (time.process_time() - c1) if workers == 0 else None
    del it, dl
    return first, rate, cpu_rate, n


def measure_global(corpus_dir: Path, tok, seq: int, batch: int, seconds, workers: int, dp: int):
    """The trainer's loader (the global order) as rank 0 of ``dp``: (seconds to the first
    batch, stream tokens/s, stream tokens per CPU-second of this process (0 workers: all
    of the work; with workers: the packing, what more workers cannot spread), batches
    timed). The stream is dp x what the rank trains on."""
    from boost_titan.data import fingerprint, local_text
    from boost_titan.data.global_loader import GlobalOrderLoader
    from boost_titan.data.sources import FileSource

    t0 = time.perf_counter()
    corpus = local_text.find_corpus(str(corpus_dir))
    loader = GlobalOrderLoader(
        "local_text", FileSource("local_text", corpus), tok, seq_len=seq,
        local_batch_size=batch, dp_rank=0, dp_world_size=dp, num_workers=workers,
        prefetch_factor=4 if workers else None, fingerprint=fingerprint.fingerprint(corpus),
    )  # fmt: skip
    it = iter(loader)
    x, _ = next(it)
    first = time.perf_counter() - t0
    assert x["input"].shape == (batch, seq)
    t1, c1, n = time.perf_counter(), time.process_time(), 0
    while time.perf_counter() - t1 < seconds:
        next(it)
        n += 1
    stream = n * batch * dp * (seq + 1)
    rate = stream / (time.perf_counter() - t1)
    cpu_rate = stream / (time.process_time() - c1)
    del it, loader
    return first, rate, cpu_rate, n


def _text(sample) -> str:
    return sample["text"]


def recipe_demand(gpu_tflops: float, mfu: float) -> list[dict]:
    """Per recipe: FLOPs/token, tokens/s per GPU at the stated peak x MFU, and what one
    rank's loader must give (every rank of a TP x PP group loads the same batch)."""
    from boost_titan.models.flavors import MODEL_ARCH, flavors_for

    rows = []
    for recipe in RECIPES:
        cfg = tomllib.loads((REPO / "recipes" / f"{recipe}.toml").read_text())
        base = tomllib.loads((REPO / "recipes" / cfg["extends"]).read_text())
        par = {**base.get("parallelism", {}), **cfg.get("parallelism", {})}
        train = {**base["training"], **cfg.get("training", {})}
        args = flavors_for(MODEL_ARCH[cfg["model"]["name"]])[cfg["model"]["flavor"]]
        fpt = args.flops_per_token(train["seq_len"])
        per_gpu = gpu_tflops * 1e12 * mfu / fpt
        group = par.get("tensor_parallel_degree", 1) * par.get("pipeline_parallel_degree", 1)
        rows.append(
            {
                "recipe": recipe,
                "flops_per_token": fpt,
                "tp_pp": group,
                "seq": train["seq_len"],
                "batch": train["local_batch_size"],
                "gpu_tokens_s": per_gpu,
                "loader_tokens_s": per_gpu * group,
            }
        )
    return rows


def main() -> int:
    a = parse()
    root = Path(a.dir).expanduser().absolute()
    cache = root / "hf_cache"
    # before `datasets` is imported: it reads these once
    os.environ["HF_DATASETS_CACHE"] = str(cache)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    import datasets
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from boost_titan.data.corpus.manifest import default_corpus_dir

    datasets.disable_progress_bars()
    modes = a.modes.split(",")
    print(
        f"machine: {os.cpu_count()} CPU cores; python {sys.version.split()[0]}; "
        f"datasets {datasets.__version__}"
    )
    try:
        t0 = time.perf_counter()
        files, texts = make_corpus(root / "corpus", a.size_gb, a.files)
        size = du_bytes(root / "corpus")
        print(
            f"corpus: {len(files)} jsonl files, {size / 1e9:.2f} GB in "
            f"{time.perf_counter() - t0:.0f} s under {root / 'corpus'}"
        )
        tok = HuggingFaceTokenizer(str(default_corpus_dir() / "tokenizer"))

        enc = tokenize_rates(tok, texts, a.tokenize_mb)
        print(
            f"\nraw tokenization ({enc['mb']:.1f} MB of text, {enc['bytes_per_token']:.2f} "
            f"bytes/token, vocab {tok.get_vocab_size()}):"
        )
        print(
            f"  one document at a time (torchtitan's path): {enc['one_at_a_time']:>12,.0f} tokens/s"
        )
        print(
            f"  encode_batch(64 docs), {os.cpu_count()} threads:        "
            f"{enc['encode_batch']:>12,.0f} tokens/s"
        )

        def load_arrow():
            return datasets.load_dataset("json", data_files=files, split="train")

        def load_streaming():
            return datasets.load_dataset("json", data_files=files, split="train", streaming=True)

        def load_local_text():
            from boost_titan.data.datasets import _load_local

            return _load_local(str(root / "corpus"))

        loaders = {"arrow": load_arrow, "streaming": load_streaming, "local_text": load_local_text}
        results = []
        print(
            f"\nloader: torchtitan HuggingFaceTextDataset + ParallelAwareDataloader, one rank, "
            f"batch {a.batch}, {a.seconds:.0f} s per case"
        )
        print(
            f"{'mode':<11} {'workers':>7} {'seq':>5} {'first batch s':>13} {'tokens/s':>10} "
            f"{'tokens/CPU-s':>12} {'batches':>7} {'+HF cache GB':>12}"
        )
        cases = [(m, 0) for m in modes] + [("streaming", w) for w in a.workers if w > 0]
        for mode, workers in cases:
            for seq in a.seq:
                before = du_bytes(cache) if cache.exists() else 0
                first, rate, cpu_rate, n = measure_loader(
                    f"bench_{mode}", loaders[mode], tok, seq, a.batch, a.seconds, workers
                )
                # what this case added to the HF cache (arrow: its conversion, first seq)
                cache_gb = ((du_bytes(cache) if cache.exists() else 0) - before) / 1e9
                results.append(
                    {
                        "mode": mode,
                        "workers": workers,
                        "seq": seq,
                        "first_s": first,
                        "tokens_s": rate,
                        "tokens_per_cpu_s": cpu_rate,
                        "batches": n,
                        "cache_gb": cache_gb,
                    }
                )
                print(
                    f"{mode:<11} {workers:>7} {seq:>5} {first:>13.2f} {rate:>10,.0f} "
                    f"{f'{cpu_rate:,.0f}' if cpu_rate else '-':>12} {n:>7} {cache_gb:>12.2f}",
                    flush=True,
                )

        glob = []
        if a.global_dp:
            print(
                f"\nthe trainer's loader (global order, boost_titan.data.global_loader), rank 0 "
                f"of dp ranks, batch {a.batch}: every rank tokenizes the whole stream"
            )
            print(
                f"{'dp':>3} {'workers':>7} {'seq':>5} {'first batch s':>13} {'stream tok/s':>12} "
                f"{'stream tok/CPU-s':>16} {'trains on tok/s':>15} {'batches':>7}   "
                "(tok/CPU-s with workers: the main process's packing only)"
            )
        for dp in a.global_dp:
            for workers in [0, *[w for w in a.workers if w > 0]]:
                for seq in a.seq:
                    first, rate, cpu_rate, n = measure_global(
                        root / "corpus", tok, seq, a.batch, a.seconds, workers, dp
                    )
                    glob.append(
                        {
                            "dp": dp,
                            "workers": workers,
                            "seq": seq,
                            "first_s": first,
                            "stream_tokens_s": rate,
                            "stream_tokens_per_cpu_s": cpu_rate,
                            "batches": n,
                        }
                    )
                    print(
                        f"{dp:>3} {workers:>7} {seq:>5} {first:>13.2f} {rate:>12,.0f} "
                        f"{cpu_rate:>16,.0f} {rate / dp:>15,.0f} "
                        f"{n:>7}",
                        flush=True,
                    )

        demand = recipe_demand(a.gpu_tflops, a.mfu)
        print(
            f"\nwhat the recipes consume: FLOPs/token (LlamaArgs.flops_per_token, the "
            f"planner's and the trainer's MFU formula) at {a.gpu_tflops:.0f} TFLOP/s x MFU "
            f"{a.mfu:.2f} per GPU; a rank's loader feeds its TP x PP group"
        )
        # the margin is the streamed loader's (local_text's path once it streams), 0 workers
        ref = {r["seq"]: r for r in results if r["mode"] == "streaming" and r["workers"] == 0}
        print(
            f"{'recipe':<16} {'GFLOP/tok':>9} {'TPxPP':>5} {'tok/s/GPU':>10} "
            f"{'loader needs':>12} {'margin wall':>11} {'margin CPU-s':>12}"
        )

        def margins(seq: int, need: float) -> str:
            r = ref.get(seq)
            if r is None:
                return f"{'(seq not measured)':>24}"
            return f"{r['tokens_s'] / need:>10.1f}x {r['tokens_per_cpu_s'] / need:>11.1f}x"

        for d in demand:
            print(
                f"{d['recipe']:<16} {d['flops_per_token'] / 1e9:>9.2f} {d['tp_pp']:>5} "
                f"{d['gpu_tokens_s']:>10,.0f} {d['loader_tokens_s']:>12,.0f} "
                f"{margins(d['seq'], d['loader_tokens_s'])}"
            )
        if glob:
            # the largest dp degree whose whole stream a rank tokenizes as fast as it trains
            best = {}
            for g in glob:
                key = (g["workers"], g["seq"])
                cpu = g["stream_tokens_per_cpu_s"] if not g["workers"] else None
                best[key] = max(best.get(key, 0), cpu if cpu else g["stream_tokens_s"])
            print(
                "\nglobal order: the largest data-parallel degree a rank keeps up with = stream "
                "tokens/s (0 workers: per CPU-second, one free core; with workers: wall here) / "
                "what the rank's loader needs"
            )
            for d in demand:
                cols = [
                    f"{w} workers {best[w, d['seq']] / d['loader_tokens_s']:.1f}"
                    for w, seq in sorted(best)
                    if seq == d["seq"]
                ]
                print(f"{d['recipe']:<16} seq {d['seq']}: dp <= " + ", ".join(cols))
        need = PAPER_7B["tokens"] / PAPER_7B["seconds"]
        print(
            f"published: BOOST paper 7B CoLA TP4 on A100, 0.72 s/iteration at micro-batch 4 x "
            f"seq 4096 (shared/design/boost.md s7): a rank's loader needs {need:,.0f} tokens/s; "
            f"margin wall, CPU-s: {' '.join(margins(4096, need).split())}"
        )
        print(
            "margin = streamed loader (0 workers) tokens/s / what a rank's loader must give; "
            "wall: on this machine now, CPU-s: per CPU-second of the loader (one free core). "
            "< 1: the loader is the bottleneck; with num_workers = 0 the loader runs inside "
            "each step and costs 1/margin of it"
        )
        (root / "results.json").write_text(
            json.dumps(
                {"tokenize": enc, "loader": results, "global": glob, "demand": demand}, indent=2
            )
        )
    finally:
        if not a.keep:
            for sub in ("corpus", "hf_cache"):
                shutil.rmtree(root / sub, ignore_errors=True)
            print(f"deleted {root / 'corpus'} and {cache} (--keep keeps them)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
