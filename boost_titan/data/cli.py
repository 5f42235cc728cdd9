"""``boost-titan data build|info|tokenizer`` -- build or describe the embedded corpus,
or train a tokenizer on your own files."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from boost_titan.data.corpus.build import build_corpus
from boost_titan.data.corpus.manifest import (
    ENV_DATA_DIR,
    default_corpus_dir,
    format_manifest,
    read_manifest,
)
from boost_titan.data.corpus.sources import CorpusBuildError
from boost_titan.data.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="boost-titan data", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    out_help = f"corpus folder (default: ${ENV_DATA_DIR} or ./data/boost_corpus)"

    b = sub.add_parser("build", help="fetch the pinned sources, build splits and tokenizer")
    b.add_argument("--out", default=None, help=out_help)
    b.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="BPE vocab size (default %(default)s)")
    b.add_argument("--force", action="store_true", help="rebuild even if the corpus is up to date")
    b.add_argument("--cache-dir", default=None, help="download cache (default: <out>/../.downloads)")

    i = sub.add_parser("info", help="print the manifest summary")
    i.add_argument("--out", default=None, help=out_help)
    i.add_argument("--json", action="store_true", help="print the raw manifest")

    t = sub.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer on your own files, streaming them",
        description="Train a byte-level BPE tokenizer (BOS id 0, EOS id 1) on your own "
        ".jsonl/.json/.txt/.parquet files, reading them one document at a time, and write "
        "the folder [model] hf_assets_path takes.",
    )
    t.add_argument("--from", dest="source", required=True, metavar="PATH",
                   help="a .jsonl/.json/.txt/.parquet file or a folder of them (searched recursively)")
    t.add_argument("--text-field", default="text",
                   help="the field holding each document's text (default %(default)s; .txt: whole file)")
    t.add_argument("--vocab-size", type=int, required=True,
                   help=f"tokens in the vocabulary (>= {MIN_VOCAB_SIZE}; the recipes' flavors take 32000)")
    t.add_argument("--out", required=True, help="tokenizer folder to write")
    sample = t.add_mutually_exclusive_group()
    sample.add_argument("--sample-docs", type=int, default=None,
                        help="train on at most this many documents, spread over the files")
    sample.add_argument("--sample-bytes", type=float, default=None,
                        help="train on at most this many bytes of text (e.g. 2e9), spread over the files")
    t.add_argument("--force", action="store_true", help="overwrite the tokenizer files in a non-empty --out")

    args = parser.parse_args(argv)
    if args.cmd == "tokenizer":
        return _tokenizer(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    if args.cmd == "build":
        try:
            manifest = build_corpus(args.out, vocab_size=args.vocab_size, force=args.force,
                                    cache_dir=args.cache_dir)
        except CorpusBuildError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        manifest.pop("_built_now", None)
        print(format_manifest(manifest))
        return 0

    out = args.out if args.out is not None else default_corpus_dir()
    manifest = read_manifest(out)
    if manifest is None:
        print(f"no corpus manifest in {out}; run `boost-titan data build`", file=sys.stderr)
        return 1
    print(json.dumps(manifest, indent=2) if args.json else f"{out}\n{format_manifest(manifest)}")
    return 0


def _tokenizer(args) -> int:
    from pathlib import Path

    from boost_titan.data.user_tokenizer import summary, train_user_tokenizer

    sample_bytes = None if args.sample_bytes is None else int(args.sample_bytes)
    try:
        info = train_user_tokenizer(args.source, args.out, args.vocab_size, args.text_field,
                                    args.sample_docs, sample_bytes, args.force)
    except CorpusBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(summary(info, Path(args.out).expanduser().absolute()))
    return 0
