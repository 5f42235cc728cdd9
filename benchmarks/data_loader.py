"""What the data path costs a rank, from 1 to 1,024 data-parallel ranks: ``data tokenize``
throughput, the loader's bytes read, CPU time and tokens/s per step at each dp degree, and
a rank's memory over a 10 GB and a 1 TB tokenized corpus.

    PYTHONPATH=. .venv/bin/python benchmarks/data_loader.py --dir /tmp/dl_bench \\
        [--size-mb 100] [--steps 200] [--batch 4] [--seq 4096] [--keep]

1. **Tokenize.** Writes ``--size-mb`` of jsonl in 16 files under ``--dir`` (documents of
   the embedded corpus drawn with a fixed seed: real English, its length distribution)
   and runs ``boost_titan.data.tokenize.tokenize`` on it with the embedded tokenizer, in
   a fresh process each: ``--workers 1`` (one core: one process, tokenizers' pool of 1
   thread) and every core. Prints input MB/s and tokens/s of each.
2. **Per-rank cost at dp 1, 8, 64, 1024.** The data order is arithmetic, so one rank of
   any degree is built alone: the last rank (``dp - 1``) of each degree, local batch
   ``--batch`` x ``--seq`` (the 7B recipes'), reads ``--steps`` steps with no DataLoader
   workers, from a position deep in the stream (the run's 10,000th step). Per step: bytes
   its reader asked for, bytes the kernel read for it (``/proc/self/io`` rchar), CPU
   seconds (``time.process_time``) and wall seconds; each beside dp 1's as a ratio.
3. **Tokens/s on one core** (no workers): the loader's rate per CPU second and per wall
   second at dp 1024, against a CoLA 7B H100 rank's need (~70k tokens/s: docs/training.md).
4. **Memory.** Synthetic tokenized corpora (sparse ``.bin`` files: no disk blocks; real
   ``.idx``, block digests and ``corpus.json``) of 10 GB (160 parts of 64 MiB) and 1 TB
   (16,384 parts): a fresh process builds the dp-1024 loader and reads 100 steps from
   random places; its peak RSS (``ru_maxrss``) beside the same process's before the loader.

Figures, not assertions: docs/benchmarks.md keeps them. Noisy on a shared machine."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "data" / "boost_corpus" / "tokenizer"
NEED = 70_000  # tokens/s of a CoLA 7B H100 rank (docs/training.md)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="scratch folder, created")
    p.add_argument("--size-mb", type=float, default=100.0, help="raw jsonl to tokenize (MB)")
    p.add_argument("--steps", type=int, default=200, help="steps read per dp degree")
    p.add_argument("--batch", type=int, default=4, help="local batch size (recipes: 4)")
    p.add_argument("--seq", type=int, default=4096, help="seq_len (recipes: 4096)")
    p.add_argument("--keep", action="store_true", help="keep what was generated")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    return p.parse_args()


# ---------------------------------------------------------------------------------------
# 1. tokenize


def write_jsonl(folder: Path, size_mb: float) -> int:
    from datasets import load_from_disk

    docs = load_from_disk(str(REPO / "data" / "boost_corpus" / "train"))["text"]
    rng = random.Random(0)
    folder.mkdir(parents=True)
    total, target, f = 0, int(size_mb * 1e6), 0
    files = [open(folder / f"part-{i:02d}.jsonl", "w") for i in range(16)]
    while total < target:
        line = json.dumps({"text": rng.choice(docs)}) + "\n"
        files[f % 16].write(line)
        total += len(line)
        f += 1
    for fh in files:
        fh.close()
    return total


def tokenize_child(raw: str, out: str, workers: str) -> None:
    from boost_titan.data.text_sources import source_of
    from boost_titan.data.tokenize import tokenize

    start = time.perf_counter()
    m = tokenize(source_of(raw), str(TOKENIZER), out, int(workers), quiet=True)
    wall = time.perf_counter() - start
    print(json.dumps({"wall": wall, "tokens": m["tokens"], "bytes": m["source"]["input_bytes"]}))


def child(*argv: str) -> dict:
    proc = subprocess.run(
        [sys.executable, __file__, "--dir", "-", "--child", *argv],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)},
    )  # fmt: skip
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------
# 2-3. the loader, one rank of each degree


def rchar() -> int:
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar")).split()[1])


def rank_cost(corpus_dir: str, dp: int, batch: int, seq: int, steps: int) -> dict:
    from fractions import Fraction

    from boost_titan.data.tokenized import open_corpus
    from boost_titan.data.window_loader import WindowLoader

    corpus = open_corpus(corpus_dir)
    loader = WindowLoader("bench", [corpus], [Fraction(1)], seq_len=seq, local_batch_size=batch,
                          dp_rank=dp - 1, dp_world_size=dp)  # fmt: skip
    loader.samples = 10_000 * batch * dp  # deep in the stream: the run's 10,000th step
    it = iter(loader)
    next(it)  # the part's file opened
    asked, io0 = loader.readers[0].bytes_read, rchar()
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for _ in range(steps):
        next(it)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {
        "asked": (loader.readers[0].bytes_read - asked) / steps,
        "kernel": (rchar() - io0) / steps,
        "cpu": cpu / steps,
        "wall": wall / steps,
        "tokens": batch * seq,
    }


# ---------------------------------------------------------------------------------------
# 4. memory over synthetic corpora


def synthetic(folder: Path, parts: int, part_tokens: int) -> None:
    """A tokenized corpus of sparse .bin parts (zeros), real .idx files and manifest."""
    import numpy as np

    from boost_titan.data import indexed, part_blocks
    from boost_titan.data.tokenize import _write_json, tokenizer_identity
    from boost_titan.data.tokenized import FORMAT, VERSION, manifest_digest

    folder.mkdir(parents=True)
    docs = part_tokens // 1024  # 1,024-token documents
    indexed.write_index(str(folder / "part.idx"), np.full(docs, 1024, np.int64), np.uint16)
    zeros = part_blocks.BlockHasher()  # every part's blocks: zeros (a sparse file)
    zeros.update(bytes(docs * 2048))
    blocks = part_blocks.write(str(folder / "part.blocks"), zeros.finish())
    records = []
    for p in range(parts):
        prefix = folder / f"part-{p:05d}"
        with open(f"{prefix}.bin", "wb") as f:
            f.truncate(docs * 1024 * 2)
        os.link(folder / "part.idx", f"{prefix}.idx")
        os.link(folder / "part.blocks", f"{prefix}.blocks")
        records.append({"prefix": prefix.name, "tokens": docs * 1024, "documents": docs,
                        "bin_bytes": docs * 2048, "idx_bytes": os.path.getsize(folder / "part.idx"),
                        "digest": f"{p:032x}",
                        "blocks": {**blocks, "file": f"{prefix.name}.blocks"}})  # fmt: skip
    body = {
        "format": FORMAT, "version": VERSION, "dtype": "uint16",
        "tokenizer": tokenizer_identity(str(TOKENIZER)),
        "source": {"kind": "synthetic", "path": str(folder)}, "plan": "synthetic",
        "documents": docs * parts, "tokens": docs * 1024 * parts, "max_token": 0, "parts": records,
    }  # fmt: skip
    _write_json(str(folder / "corpus.json"), {**body, "digest": manifest_digest(body)})


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1])


def memory_child(corpus_dir: str, batch: str, seq: str) -> None:
    from fractions import Fraction

    import numpy as np

    from boost_titan.data.tokenized import open_corpus
    from boost_titan.data.window_loader import WindowLoader

    gc.collect()
    before, peak_before = rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    corpus = open_corpus(corpus_dir)
    dp, b = 1024, int(batch)
    loader = WindowLoader("bench", [corpus], [Fraction(1)], seq_len=int(seq), local_batch_size=b,
                          dp_rank=dp - 1, dp_world_size=dp)  # fmt: skip
    rng = np.random.default_rng(0)
    windows = corpus.windows(int(seq) + 1)
    for start in rng.integers(0, 50 * windows, 100):
        loader.read_batch(loader.samples_of(int(start), 0))
    after, peak = rss_kb(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reads = sum(r.reads for r in loader.readers)
    opened = sum(len(r._fds) for r in loader.readers)
    manifest_mb = os.path.getsize(os.path.join(corpus_dir, "corpus.json")) / 1e6
    record = {"before_kb": before, "after_kb": after, "parts": len(corpus.parts),
              "peak_grew_kb": peak - peak_before, "manifest_mb": manifest_mb}  # fmt: skip
    print(json.dumps({**record, "opened": opened, "reads": reads, "tb": corpus.tokens * 2e-12}))


# ---------------------------------------------------------------------------------------


def main() -> None:
    import logging

    logging.disable(logging.WARNING)  # a small corpus re-loops every few steps at dp 1024
    args = parse()
    if args.child:
        {"tokenize": tokenize_child, "memory": memory_child}[args.child[0]](*args.child[1:])
        return
    root = Path(args.dir)
    if root.exists():
        sys.exit(f"{root} exists: give a new scratch folder")
    try:
        raw = root / "raw"
        size = write_jsonl(raw, args.size_mb)
        print(f"## 1. data tokenize: {size / 1e6:.0f} MB of jsonl in 16 files, "
              f"{os.cpu_count()} cores\n")  # fmt: skip
        print("| workers | wall s | input MB/s | tokens/s |\n|---|---|---|---|")
        for workers in (1, os.cpu_count()):
            r = child("tokenize", str(raw), str(root / f"tok{workers}"), str(workers))
            print(f"| {workers} | {r['wall']:.1f} | {r['bytes'] / 1e6 / r['wall']:.2f} | "
                  f"{r['tokens'] / r['wall']:,.0f} |")  # fmt: skip
        corpus = str(root / "tok1")
        print(f"\n## 2. one rank per step: local batch {args.batch} x seq {args.seq}, "
              f"{args.steps} steps from step 10,000, no DataLoader workers\n")  # fmt: skip
        print("| dp | rank | bytes asked | bytes read (kernel) | CPU ms | wall ms | CPU x dp 1 | "
              "bytes x dp 1 |\n|---|---|---|---|---|---|---|---|")  # fmt: skip
        costs = {}
        for dp in (1, 8, 64, 1024):
            c = costs[dp] = rank_cost(corpus, dp, args.batch, args.seq, args.steps)
            ratios = f"{c['cpu'] / costs[1]['cpu']:.2f} | {c['kernel'] / costs[1]['kernel']:.2f}"
            print(f"| {dp} | {dp - 1} | {c['asked']:,.0f} | {c['kernel']:,.0f} | "
                  f"{c['cpu'] * 1e3:.3f} | {c['wall'] * 1e3:.3f} | {ratios} |")  # fmt: skip
        c = costs[1024]
        per_cpu, per_wall = c["tokens"] / c["cpu"], c["tokens"] / c["wall"]
        print(f"\n## 3. loader rate, one core, no workers (dp 1024)\n\n{per_cpu:,.0f} tokens per "
              f"CPU second, {per_wall:,.0f} per wall second: {per_cpu / NEED:,.0f}x / "
              f"{per_wall / NEED:,.0f}x a CoLA 7B H100 rank's ~{NEED:,} tokens/s")  # fmt: skip
        print("\n## 4. a rank's memory (dp 1024, 100 steps from random places)\n")
        print("| corpus | parts | corpus.json MB | reads | files open at the end | RSS before "
              "MiB | RSS after MiB | grew MiB | peak RSS grew MiB |\n"
              "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for name, parts in (("10 GB", 160), ("1 TB", 16_384)):
            folder = root / f"synthetic_{parts}"
            synthetic(folder, parts, 32 << 20)  # 64 MiB of uint16 per part
            r = child("memory", str(folder), str(args.batch), str(args.seq))
            shutil.rmtree(folder)
            print(f"| {name} ({r['tb']:.3f} TB) | {r['parts']} | {r['manifest_mb']:.1f} | "
                  f"{r['reads']} | {r['opened']} | {r['before_kb'] / 1024:.0f} | "
                  f"{r['after_kb'] / 1024:.0f} | {(r['after_kb'] - r['before_kb']) / 1024:.1f} | "
                  f"{r['peak_grew_kb'] / 1024:.1f} |")  # fmt: skip
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
