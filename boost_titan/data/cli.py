"""``boost-titan data build|info|tokenizer|tokenize|seal`` -- build or describe the
embedded corpus, train a tokenizer on your own files, tokenize raw text into a
tokenized corpus, or seal existing Megatron .bin/.idx files as one."""

from __future__ import annotations

import json
import logging

from boost_titan.config import Parser, refuse
from boost_titan.data.corpus.build import build_corpus
from boost_titan.data.corpus.manifest import (
    ENV_DATA_DIR,
    default_corpus_dir,
    format_manifest,
    read_manifest,
)
from boost_titan.data.corpus.sources import CorpusBuildError
from boost_titan.data.tokenizer import DEFAULT_VOCAB_SIZE, MIN_VOCAB_SIZE

PROG = "boost-titan data"


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog=PROG, description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    out_help = f"corpus folder (default: ${ENV_DATA_DIR} or ./data/boost_corpus)"

    b = sub.add_parser("build", help="fetch the pinned sources, build splits and tokenizer")
    b.add_argument("--out", default=None, help=out_help)
    b.add_argument(
        "--vocab-size",
        type=int,
        default=DEFAULT_VOCAB_SIZE,
        help="BPE vocab size (default %(default)s)",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if the corpus is up to date")
    b.add_argument(
        "--cache-dir", default=None, help="download cache (default: <out>/../.downloads)"
    )

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
    t.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="PATH",
        help="a .jsonl/.json/.txt/.parquet file or a folder of them (searched recursively)",
    )
    t.add_argument(
        "--text-field",
        default="text",
        help="the field holding each document's text (default %(default)s; .txt: whole file)",
    )
    t.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help=f"tokens in the vocabulary (>= {MIN_VOCAB_SIZE}; the recipes' flavors take 32000)",
    )
    t.add_argument("--out", required=True, help="tokenizer folder to write")
    sample = t.add_mutually_exclusive_group()
    sample.add_argument(
        "--sample-docs",
        type=int,
        default=None,
        help="train on at most this many documents, spread over the files",
    )
    sample.add_argument(
        "--sample-bytes",
        type=float,
        default=None,
        help="train on at most this many bytes of text (e.g. 2e9), spread over the files",
    )
    t.add_argument(
        "--force", action="store_true", help="overwrite the tokenizer files in a non-empty --out"
    )

    k = sub.add_parser(
        "tokenize",
        help="tokenize raw text once into a tokenized corpus "
        "(Megatron .bin/.idx parts + corpus.json)",
        description="Tokenize a .jsonl/.json/.txt/.parquet file, a folder of them or a "
        "save_to_disk folder into a tokenized corpus that [training] dataset = 'tokenized' "
        "reads. Every local core by default; several machines with --shard i/n (the same "
        "arguments on each, then --merge once). Safe to kill and rerun: finished parts are kept.",
    )
    k.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="PATH",
        help="a .jsonl/.json/.txt/.parquet file, a folder of them, or a save_to_disk folder",
    )
    k.add_argument(
        "--tokenizer", required=True, metavar="DIR", help="tokenizer folder (tokenizer.json)"
    )
    k.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the tokenized corpus folder to write: new, empty or holding only a corpus of "
        "ours, outside --from",
    )
    k.add_argument(
        "--text-field",
        default="text",
        help="the field holding each document's text (default %(default)s)",
    )
    k.add_argument("--workers", type=int, default=None, help="processes (default: every core)")
    k.add_argument(
        "--shard",
        default="0/1",
        metavar="I/N",
        help="this machine's share: parts p with p %% N == I",
    )
    k.add_argument(
        "--merge",
        action="store_true",
        help="tokenize nothing: write corpus.json once every shard is done",
    )
    k.add_argument(
        "--force",
        action="store_true",
        help="replace a corpus of another source or tokenizer in --out (removes only the "
        "files its corpus.json and part records list)",
    )

    e = sub.add_parser(
        "seal",
        help="make existing Megatron .bin/.idx files a tokenized corpus (read where they are)",
        description="Check and digest existing Megatron-LM / NeMo / GPT-NeoX indexed datasets "
        "and write a corpus.json naming them, for [training] dataset = 'tokenized'.",
    )
    e.add_argument(
        "prefixes",
        nargs="+",
        metavar="PREFIX",
        help="path prefix (or .bin/.idx path) of each dataset",
    )
    e.add_argument("--tokenizer", required=True, metavar="DIR", help="the tokenizer the ids are of")
    e.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="folder for corpus.json and the block digests: new, empty or a sealed corpus of "
        "ours, not the inputs' folder",
    )

    args = parser.parse_args(argv)
    if args.cmd == "tokenizer":
        return _tokenizer(args)
    if args.cmd in ("tokenize", "seal"):
        return _tokenize(args)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )

    if args.cmd == "build":
        try:
            manifest = build_corpus(
                args.out, vocab_size=args.vocab_size, force=args.force, cache_dir=args.cache_dir
            )
        except CorpusBuildError as e:
            refuse(f"{PROG} build", e, 1)
        manifest.pop("_built_now", None)
        print(format_manifest(manifest))
        return _tokenize_embedded(args.out)

    out = args.out if args.out is not None else default_corpus_dir()
    manifest = read_manifest(out)
    if manifest is None:
        refuse(f"{PROG} info", f"no corpus manifest in {out}; run `boost-titan data build`", 1)
    print(json.dumps(manifest, indent=2) if args.json else f"{out}\n{format_manifest(manifest)}")
    return 0


def _tokenizer(args) -> int:
    from pathlib import Path

    from boost_titan.data.user_tokenizer import summary, train_user_tokenizer

    sample_bytes = None if args.sample_bytes is None else int(args.sample_bytes)
    try:
        info = train_user_tokenizer(
            args.source,
            args.out,
            args.vocab_size,
            args.text_field,
            args.sample_docs,
            sample_bytes,
            args.force,
        )
    except CorpusBuildError as e:
        refuse(f"{PROG} tokenizer", e, 1)
    print(summary(info, Path(args.out).expanduser().absolute()))
    return 0


def _tokenize(args) -> int:
    from boost_titan.data.local_text import CorpusError
    from boost_titan.data.order import BlendError

    try:
        if args.cmd == "seal":
            from boost_titan.data.seal import seal

            m = seal(args.prefixes, args.tokenizer, args.out)
            print(
                f"{args.out}: {m['documents']} documents, {m['tokens']} tokens in "
                f"{len(m['parts'])} Megatron dataset(s), digest {m['digest'][:12]}"
            )
            return 0
        from boost_titan.data.text_sources import source_of
        from boost_titan.data.tokenize import tokenize

        index, count = _shard(args.shard)
        if args.workers is not None and args.workers < 1:
            raise BlendError(f"--workers {args.workers} must be >= 1")
        m = tokenize(
            source_of(args.source, args.text_field),
            args.tokenizer,
            args.out,
            args.workers,
            (index, count),
            args.merge,
            args.force,
        )
    except (CorpusError, BlendError, OSError) as e:
        refuse(f"{PROG} {args.cmd}", e, 1)
    if m is None:
        print(
            f"{args.out}: shard {args.shard} done; the corpus is complete once every shard "
            "is: then run the same command with --merge"
        )
        return 0
    print(
        f"{args.out}: {m['documents']} documents, {m['tokens']} tokens ({m['dtype']}) in "
        f"{len(m['parts'])} part(s), digest {m['digest'][:12]}"
    )
    return 0


def _shard(text: str) -> tuple[int, int]:
    from boost_titan.data.order import BlendError

    try:
        i, n = (int(x) for x in text.split("/"))
    except ValueError:
        raise BlendError(f"--shard {text!r} is not I/N (e.g. 0/16)") from None
    if not (n >= 1 and 0 <= i < n):
        raise BlendError(f"--shard {text!r}: I must be in 0..N-1 and N >= 1")
    return i, n


def _tokenize_embedded(out) -> int:
    """The embedded corpus' splits tokenized with its tokenizer into its cache folder
    (``boost_titan.data.cache``): what boost_corpus / boost_corpus_val train on."""
    from boost_titan.data.cache import ensure
    from boost_titan.data.corpus.manifest import TOKENIZER_DIR, resolve_dirs
    from boost_titan.data.local_text import CorpusError
    from boost_titan.data.text_sources import SavedText

    folder, _ = resolve_dirs(out, None)
    try:
        for split in ("train", "validation"):
            c = ensure(SavedText(str(folder / split), "text"), str(folder / TOKENIZER_DIR),
                       str(folder / "tokenized"))  # fmt: skip
            print(f"tokenized {split}: {c.describe()}")
    except CorpusError as e:
        refuse(f"{PROG} build", e, 1)
    return 0
