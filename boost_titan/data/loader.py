"""Which data ``[training]`` and ``[validation]`` read, and the loaders that read it.

Every dataset boost_titan reads itself is read as a tokenized corpus by one loader
(``boost_titan.data.window_loader``):

* ``tokenized``: ``dataset_path`` is a corpus ``boost-titan data tokenize`` / ``data
  seal`` wrote; training may blend several (``[training] dataset_blend = ["0.7:/a",
  "0.3:/b"]``);
* raw text (``boost_corpus`` / ``boost_corpus_val``, ``local_text`` and its holdout,
  any map-style dataset of torchtitan's registry) is tokenized once into the cache
  (``boost_titan.data.cache``) and read from there.

A Hugging Face streaming dataset of torchtitan's registry (``c4``) keeps torchtitan's
per-rank loader (its position resumes only at its own dp degree,
``boost_titan.checkpoint.data_position``).

Before the first step every rank's view of its data (each corpus' digest, the blend,
seed, ``seq_len``) is compared with rank 0's (:func:`agree`; a rank receives one view,
not every rank's): a rank that sees another corpus, or cannot read it, stops every rank
with one line (never a hang in a later collective), and a corpus tokenized with another
tokenizer than ``[model] hf_assets_path`` is refused (:func:`check_tokenizer`). One log
line per rank says what it reads.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from fractions import Fraction

from torchtitan.hf_datasets.text_datasets import _validate_dataset, build_text_dataloader
from torchtitan.hf_datasets.text_datasets import (
    build_text_validation_dataloader as _torchtitan_validation_dataloader,
)
from torchtitan.tools.logging import logger

from boost_titan.data import local_text
from boost_titan.data.local_text import HOLDOUT_DATASET, LOCAL_DATASETS, Corpus, CorpusError
from boost_titan.data.order import BlendError, parse_weight
from boost_titan.data.text_sources import FileText, SavedText
from boost_titan.data.tokenized import TokenizedCorpus, open_corpus
from boost_titan.data.window_loader import WindowLoader, differences

TOKENIZED = "tokenized"
EMBEDDED = {"boost_corpus": "train", "boost_corpus_val": "validation"}


def corpus_for(job_config, section: str) -> Corpus:
    """The local_text corpus ``[section]`` (training / validation) reads, holdout
    applied: training keeps all but the last ``dataset_holdout_files`` files (or all
    but every N-th document), ``local_text_holdout`` reads exactly those."""
    training = job_config.training
    s = getattr(job_config, section)
    field = training.dataset_text_field
    files, every = training.dataset_holdout_files, training.dataset_holdout_every
    holdout = section == "training" and (files or every)
    if s.dataset != HOLDOUT_DATASET and not holdout:
        return local_text.find_corpus(s.dataset_path, field)
    corpus = local_text.find_corpus(training.dataset_path, field)
    if files and every:
        raise CorpusError(
            f"local_text: dataset_holdout_files = {files} and dataset_holdout_every = {every}: "
            "hold out files or every N-th document, not both (the other 0)"
        )
    if not files and not every:
        raise CorpusError(
            f"local_text: [validation] dataset = {HOLDOUT_DATASET!r} reads what [training] "
            "holds out, and neither dataset_holdout_files nor dataset_holdout_every is set"
        )
    split = (
        local_text.split_every(corpus, every) if every else local_text.split_holdout(corpus, files)
    )
    return split[1 if s.dataset == HOLDOUT_DATASET else 0]


def parse_blend(entries: list[str]) -> list[tuple[Fraction, str]]:
    """``["0.7:/data/web", "0.3:/data/code"]`` -> [(weight, path)]; one line when bad."""
    out = []
    for entry in entries:
        weight, sep, path = str(entry).partition(":")
        if not sep or not path.strip():
            raise BlendError(
                f"[training] dataset_blend entry {entry!r} is not 'WEIGHT:PATH' (e.g. "
                "'0.7:/data/web_tokenized')"
            )
        out.append(
            (parse_weight(weight, f"[training] dataset_blend entry {entry!r}"), path.strip())
        )
    return out


def raw_source(job_config, section: str):
    """(text source, cache root) of a raw-text dataset, ``"tokenized"``, or None for a
    dataset torchtitan's per-rank loader reads."""
    from datasets import Dataset

    from boost_titan.data.cache import cache_root
    from boost_titan.data.corpus.manifest import default_corpus_dir

    s, t = getattr(job_config, section), job_config.training
    if s.dataset == TOKENIZED:
        return TOKENIZED
    root = cache_root(t.dataset_cache)
    if s.dataset in EMBEDDED:
        from boost_titan.data.corpus.manifest import BUILD_HINT

        corpus_dir = default_corpus_dir()
        path = s.dataset_path or str(corpus_dir / EMBEDDED[s.dataset])
        if not os.path.isdir(path):
            raise CorpusError(f"corpus split not found at {path!r}; {BUILD_HINT}")
        return SavedText(path, "text"), str(corpus_dir / "tokenized")
    if s.dataset in LOCAL_DATASETS:
        corpus = corpus_for(job_config, section)
        if corpus.streamed:
            return FileText(corpus), root
        return SavedText(corpus.path, corpus.text_field), root
    path, load, text_of = _validate_dataset(s.dataset.lower(), s.dataset_path)
    data = load(path)
    if not isinstance(data, Dataset):
        return None
    source = SavedText(path, "text", text_of, name=s.dataset, loader=load)
    source._data = data
    return source, root


def resolve(job_config, section: str) -> tuple[list[Fraction], list[TokenizedCorpus]] | None:
    """The weights and tokenized corpora ``[section]`` reads (tokenizing raw text into the
    cache first), or None for torchtitan's per-rank loader."""
    from boost_titan.data.cache import ensure

    found = raw_source(job_config, section)
    if found is None:
        return None
    s, t = getattr(job_config, section), job_config.training
    if found == TOKENIZED:
        if section == "training" and t.dataset_blend:
            blend = parse_blend(t.dataset_blend)
        elif s.dataset_path:
            blend = [(Fraction(1), s.dataset_path)]
        else:
            raise CorpusError(
                f"[{section}] dataset = 'tokenized' needs dataset_path (a folder `boost-titan "
                "data tokenize` wrote)" + (" or dataset_blend" if section == "training" else "")
            )
        return [w for w, _ in blend], [open_corpus(p) for _, p in blend]
    source, root = found
    return [Fraction(1)], [ensure(source, job_config.model.hf_assets_path, root)]


def check_tokenizer(corpora: list[TokenizedCorpus], tokenizer_dir: str, name: str) -> None:
    from boost_titan.data.tokenize import tokenizer_identity

    mine = tokenizer_identity(tokenizer_dir)
    for c in corpora:
        theirs = c.tokenizer
        if theirs["digest"] != mine["digest"]:
            raise CorpusError(
                f"{name}: {c.path} was tokenized with the tokenizer at {theirs.get('path')!r} "
                f"(digest {theirs['digest'][:12]}, vocabulary {theirs.get('vocab_size')}), and "
                f"[model] hf_assets_path {tokenizer_dir!r} is another (digest "
                f"{mine['digest'][:12]}, vocabulary {mine['vocab_size']}): its ids would stand "
                "for other tokens; tokenize the corpus with this tokenizer or point "
                "hf_assets_path at the corpus' tokenizer"
            )


def agree(view, name: str) -> None:
    """Every rank's view of its data (a dict, or the error that stopped it from reading
    it) compared with rank 0's; any difference stops every rank with one line (every
    view is gathered then, to name the first rank that differs). Nothing to compare
    without a process group (or on the dry run's fake one)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1 or dist.get_backend() == "fake":
        if isinstance(view, CorpusError):
            raise view
        return
    mine = f"error: {view}" if isinstance(view, CorpusError) else json.dumps(view, sort_keys=True)
    if _same_as_rank0(mine):  # (every rank's, or every rank failed alike)
        if isinstance(view, CorpusError):
            raise view
        return
    # someone differs: every rank's view, for the line that names the first one
    views: list = [None] * dist.get_world_size()
    dist.all_gather_object(views, mine)
    if isinstance(view, CorpusError):
        raise view
    failed = [r for r, v in enumerate(views) if v.startswith("error: ")]
    if failed:
        r = failed[0]
        raise CorpusError(
            f"{name}: rank {r} cannot read the data ({views[r][7:]})"
            + (f"; {len(failed)} ranks in all" if len(failed) > 1 else "")
        )
    differ = [r for r, v in enumerate(views) if v != views[0]]
    if differ:
        r = differ[0]
        what = differences(json.loads(views[0]), json.loads(views[r]), "rank 0's")
        what = what or ["the views differ"]
        raise CorpusError(
            f"{name}: rank {r} sees other data than rank 0 ({'; '.join(what)}; "
            f"{len(differ)} of {len(views)} ranks differ from rank 0): every rank must "
            "read the same corpus (the same folder listing and files on every node)"
        )


def _same_as_rank0(mine: str) -> bool:
    """Whether every rank's view is rank 0's: rank 0's broadcast, each rank compares its
    own, and one flag is reduced, so a rank receives one view at any world size (issue
    #48: gathering every rank's view cost each rank O(world) bytes at every start)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_object_coll_device

    box = [mine]
    dist.broadcast_object_list(box, src=0)
    differs = torch.tensor([int(mine != box[0])], device=_get_object_coll_device())
    dist.all_reduce(differs, op=dist.ReduceOp.MAX)
    return not differs.item()


def _build(job_config, section, dp_world_size, dp_rank, infinite, tokenizer=None, **kwargs):
    """A WindowLoader over ``[section]``'s data, checked and agreed on by every rank."""
    s = getattr(job_config, section)
    vocab = getattr(tokenizer, "get_vocab_size", None)
    kwargs["vocab_size"] = vocab() if vocab else None
    try:
        found = resolve(job_config, section)
        if found is None:
            view = None
        else:
            weights, corpora = found
            check_tokenizer(corpora, job_config.model.hf_assets_path, s.dataset)
            loader = WindowLoader(s.dataset, corpora, weights, seq_len=s.seq_len,
                                  dp_rank=dp_rank, dp_world_size=dp_world_size,
                                  infinite=infinite, **kwargs)  # fmt: skip
            view = loader.view()
    except (CorpusError, BlendError, OSError) as e:
        view = e if isinstance(e, CorpusError) else CorpusError(f"{s.dataset}: {e}")
    agree(view, s.dataset)
    if view is None:
        return None
    logger.info(loader.describe())
    return loader


def replica_data_rank(ft, dp_world_size: int, dp_rank: int) -> tuple[int, int]:
    """Under torchft replica groups (``boost_titan.train.replicas``) the global batch spans
    the groups: group ``i``'s rank ``r`` of ``dp`` is rank ``i * dp + r`` of ``N * dp``."""
    if not ft.enable:
        return dp_world_size, dp_rank
    return ft.group_size * dp_world_size, ft.replica_id * dp_world_size + dp_rank


def build_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=True):
    """The TrainSpec's ``build_dataloader_fn`` (module docstring)."""
    dp_world_size, dp_rank = replica_data_rank(job_config.fault_tolerance, dp_world_size, dp_rank)
    t = job_config.training
    loader = _build(job_config, "training", dp_world_size, dp_rank, infinite, tokenizer,
                    local_batch_size=t.local_batch_size, seed=t.dataset_seed,
                    shuffle=t.dataset_shuffle, **asdict(t.dataloader))  # fmt: skip
    if loader is None:
        loader = build_text_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite)
    return loader


def build_validation_dataloader(dp_world_size, dp_rank, tokenizer, job_config, infinite=False):
    """torchtitan's Validator builds its loader by this name (see :func:`install`)."""
    v = job_config.validation
    loader = _build(job_config, "validation", dp_world_size, dp_rank, infinite, tokenizer,
                    local_batch_size=v.local_batch_size, shuffle=False, validation=True,
                    **asdict(v.dataloader))  # fmt: skip
    if loader is None:
        return _torchtitan_validation_dataloader(
            dp_world_size=dp_world_size,
            dp_rank=dp_rank,
            tokenizer=tokenizer,
            job_config=job_config,
            infinite=infinite,
        )
    return loader


def install() -> None:
    """torchtitan's ``Validator.__init__`` calls ``build_text_validation_dataloader``
    from its own module (no TrainSpec hook): point that name at ours, which hands every
    other dataset back to torchtitan's."""
    import torchtitan.components.validate as validate

    validate.build_text_validation_dataloader = build_validation_dataloader
