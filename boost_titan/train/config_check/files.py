"""Launch checks on disk: the tokenizer folder (tokenizer.json, its vocabulary against
the flavor's) and the datasets a run reads (local paths exist; remote ones are
reachable unless Hugging Face is offline). Raw text a run reads is tokenized into the
cache here, before torchrun starts the ranks (``boost_titan.data.cache``), and every
tokenized corpus is checked against the run: its tokenizer, the blend, enough windows."""

from __future__ import annotations

import os

from boost_titan.data.local_text import HOLDOUT_DATASET, LOCAL_DATASETS, CorpusError
from boost_titan.data.order import BlendError
from boost_titan.train.config_check.common import ConfigError, ConfigPathError, _ours, bad
from boost_titan.train.config_check.model import config_args
from boost_titan.train.config_check.model_tokenizer import check_model_tokenizer


def _writable_folders(config) -> list[tuple[str, str, str]]:
    """(section, key, folder) of every folder a run writes into: the dump folder and,
    where enabled, what torchtitan joins onto it (an absolute value stands alone)."""
    dump = config.job.dump_folder
    out = [("job", "dump_folder", dump)]
    if config.checkpoint.enable:
        out.append(("checkpoint", "folder", os.path.join(dump, config.checkpoint.folder)))
    if config.metrics.enable_tensorboard:
        out.append(("metrics", "save_tb_folder", os.path.join(dump, config.metrics.save_tb_folder)))
    if config.profiling.enable_profiling or getattr(config.boost, "profile_freq", 0):
        folder = os.path.join(dump, config.profiling.save_traces_folder)
        out.append(("profiling", "save_traces_folder", folder))
    return out


def _check_writable(config) -> None:
    """Each folder the run writes is a folder (or can be made one) on a filesystem this
    process may write: tried with a temporary file in it or its nearest existing parent
    (``os.access`` says yes to root on a read-only mount), removed at once."""
    import tempfile

    for section, key, folder in _writable_folders(config):
        probe = os.path.abspath(folder)
        while not os.path.exists(probe):
            probe = os.path.dirname(probe)
        value = getattr(getattr(config, section), key)
        if not os.path.isdir(probe):
            raise bad(
                section,
                key,
                value,
                f"cannot be made: {probe!r} is a file, not a folder; the run writes "
                f"{folder!r}, choose another path",
                ConfigPathError,
            )
        try:
            fd, name = tempfile.mkstemp(prefix=".boost-write-check-", dir=probe)
            os.close(fd)
            os.unlink(name)
        except OSError as e:
            raise bad(
                section,
                key,
                value,
                f"is not writable ({probe!r}: {e.strerror or e}); the run writes {folder!r} "
                "at start-up, choose a folder this user may write",
                ConfigPathError,
            ) from None


def _check_files(config, dp_degree: int = 1) -> None:
    """What a launch reads from disk: tokenizer, datasets (``dp_degree``: the
    data-parallel degree the files are shared over)."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from boost_titan.data.datasets import _BUILD_HINT
    from boost_titan.models.args import _check_tokenizer_vocab

    m = config.model
    if not os.path.isdir(m.hf_assets_path):
        why = "is a file, not a folder" if os.path.exists(m.hf_assets_path) else "does not exist"
        raise bad(
            "model",
            "hf_assets_path",
            m.hf_assets_path,
            f"{why} (cwd {os.getcwd()!r}); it must be the tokenizer folder holding "
            f"tokenizer.json (the embedded corpus': ./data/boost_corpus/tokenizer, {_BUILD_HINT})",
            ConfigPathError,
        )
    if not os.path.isfile(os.path.join(m.hf_assets_path, "tokenizer.json")):
        raise bad(
            "model",
            "hf_assets_path",
            m.hf_assets_path,
            f"holds no tokenizer.json (found {sorted(os.listdir(m.hf_assets_path))[:10]}); "
            f"point it at a Hugging Face tokenizer folder ({_BUILD_HINT})",
            ConfigPathError,
        )
    if _ours(config):
        check_model_tokenizer(config)  # a converted model's own tokenizer, first
        args = config_args(config)
        try:
            _check_tokenizer_vocab(m.hf_assets_path, args.vocab_size)
        except ValueError as e:
            raise ConfigError(
                f"[model] hf_assets_path = {m.hf_assets_path!r} with flavor {m.flavor!r}: {e}"
            ) from None
    sections = [("training", config.training)] + (
        [("validation", config.validation)] if config.validation.enable else []
    )
    _check_local_corpora(config, sections, dp_degree)
    for section, s in sections:
        if s.dataset in LOCAL_DATASETS or s.dataset == TOKENIZED:
            continue  # checked above
        entry = DATASETS[s.dataset]
        path = s.dataset_path or entry.path
        key = "dataset_path" if s.dataset_path else "dataset"
        value = s.dataset_path or s.dataset
        local = (
            s.dataset in ("boost_corpus", "boost_corpus_val")
            or os.path.isabs(path)
            or path.startswith(".")
        )
        if local and not os.path.exists(path):
            raise bad(
                section,
                key,
                value,
                f"reads {path!r}, which does not exist"
                + (f"; {_BUILD_HINT}" if s.dataset.startswith("boost_corpus") else ""),
                ConfigPathError,
            )
        offline = [
            v
            for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")
            if os.environ.get(v, "0") not in ("", "0")
        ]
        if not os.path.exists(path) and offline:
            raise bad(
                section,
                key,
                value,
                f"reads {path!r}, neither a local path nor reachable: "
                f"{offline[0]}=1 (run_train.sh's default) forbids downloading it; use "
                f"'boost_corpus' or 'local_text' with dataset_path",
                ConfigPathError,
            )
    _check_tokenized(config, sections, dp_degree)


TOKENIZED = "tokenized"
_OURS = (TOKENIZED, "boost_corpus", "boost_corpus_val", *LOCAL_DATASETS)


def _check_tokenized(config, sections, dp_degree: int) -> None:
    """The tokenized corpora each section reads (raw text tokenized into the cache
    first): the blend's entries, the tokenizer they were made with, a window of
    ``seq_len + 1`` tokens in each, a validation pass of at least one global batch."""
    from boost_titan.data.loader import check_tokenizer, parse_blend, resolve

    t = config.training
    if t.dataset_blend and t.dataset != TOKENIZED:
        raise bad("training", "dataset_blend", t.dataset_blend,
                  f"blends tokenized corpora: set [training] dataset = {TOKENIZED!r}")  # fmt: skip
    for section, s in sections:
        if s.dataset not in _OURS:
            continue
        key = "dataset_blend" if section == "training" and t.dataset_blend else "dataset_path"
        value = getattr(t, key) if key == "dataset_blend" else s.dataset_path
        try:
            if key == "dataset_blend":
                parse_blend(t.dataset_blend)
            elif s.dataset == TOKENIZED and not s.dataset_path:
                raise CorpusError(
                    "must be set for dataset 'tokenized' (a folder `boost-titan data tokenize` "
                    "wrote)" + ("; or set dataset_blend" if section == "training" else "")
                )
            _, corpora = resolve(config, section)
            check_tokenizer(corpora, config.model.hf_assets_path, s.dataset)
        except (CorpusError, BlendError) as e:
            missing = "does not exist" in str(e) or "not found" in str(e)
            cls = ConfigPathError if missing else ConfigError
            raise bad(section, key, value, f"({s.dataset}): {e}", cls) from None
        window = s.seq_len + 1
        for c in corpora:
            if c.windows(window) == 0:
                raise bad(section, "seq_len", s.seq_len,
                          f"is too long for {c.path} ({c.tokens} tokens, no window of "
                          f"seq_len + 1 = {window})")  # fmt: skip
        batch = s.local_batch_size * dp_degree
        if section == "validation" and s.steps == -1 and corpora[0].windows(window) < batch:
            raise bad(section, "local_batch_size", s.local_batch_size,
                      f"x {dp_degree} data-parallel ranks = {batch} windows per global batch, "
                      f"more than the {corpora[0].windows(window)} windows of {window} tokens "
                      f"in {corpora[0].path}: a validation pass would score nothing")  # fmt: skip


def _check_local_corpora(config, sections, dp_degree: int = 1) -> None:
    """``local_text`` / ``local_text_holdout``: the holdout settings, then the files each
    loader will read (``boost_titan.data.loader.corpus_for``, the loaders' own rule):
    readable, one format, no file without documents, the text field in each file's
    first document, and no file read by both training and validation."""
    from boost_titan.data.loader import corpus_for
    from boost_titan.data.local_text import check_corpus

    t = config.training
    for key in ("dataset_holdout_files", "dataset_holdout_every"):
        value = getattr(t, key)
        if value < 0:
            raise bad("training", key, value, "must be >= 0 (0: no holdout)")
        if value and t.dataset != "local_text":
            raise bad(
                "training",
                key,
                value,
                f"holds part of a local_text corpus out; [training] dataset is {t.dataset!r}",
            )
    holdout = t.dataset_holdout_files or t.dataset_holdout_every
    if not t.dataset_text_field:
        raise bad("training", "dataset_text_field", "", "must name the field holding the text")
    if t.dataset == HOLDOUT_DATASET:
        raise bad(
            "training",
            "dataset",
            HOLDOUT_DATASET,
            "is for [validation] only (what [training] dataset_holdout_files / "
            "dataset_holdout_every hold out of dataset = 'local_text')",
        )
    files = {}
    for section, s in sections:
        if s.dataset not in LOCAL_DATASETS:
            continue
        if s.dataset == HOLDOUT_DATASET:
            if t.dataset != "local_text" or not holdout:
                raise bad(
                    section,
                    "dataset",
                    HOLDOUT_DATASET,
                    "reads what [training] dataset_holdout_files or dataset_holdout_every "
                    f"holds out of dataset = 'local_text' (dataset {t.dataset!r}, neither "
                    "set); set dataset_holdout_files = N (the last N files) or "
                    "dataset_holdout_every = N (every N-th document of each file)",
                )
            if s.dataset_path:
                raise bad(
                    section,
                    "dataset_path",
                    s.dataset_path,
                    f"must be unset with dataset = {HOLDOUT_DATASET!r}, which reads "
                    "[training] dataset_path's held-out files",
                )
        elif not s.dataset_path:
            raise bad(
                section,
                "dataset_path",
                None,
                "must be set for dataset 'local_text' (a file or folder of "
                ".jsonl/.json/.txt/.parquet, or a saved dataset folder)",
            )
        path = t.dataset_path if s.dataset == HOLDOUT_DATASET else s.dataset_path
        try:
            corpus = corpus_for(config, section)
            # every rank lists the files (its loader will); only the first reads one
            # document of each (thousands of files x hundreds of ranks on a shared
            # filesystem): its error ends the launch
            if os.environ.get("RANK", "0") == "0":
                check_corpus(corpus)
        except CorpusError as e:
            why = str(e).removeprefix("local_text: ")
            cls = ConfigPathError if "does not exist" in why else ConfigError
            raise bad(section, "dataset_path", path, f"({s.dataset}): {why}", cls) from None
        files[section] = corpus
    if len(files) == 2 and config.validation.dataset != HOLDOUT_DATASET:  # (disjoint)
        train, val = files["training"], files["validation"]
        shared = sorted(set(train.files) & set(val.files)) or (
            [train.path] if not train.streamed and train.path == val.path else []
        )
        if shared:
            raise bad(
                "validation",
                "dataset_path",
                config.validation.dataset_path,
                f"reads {len(shared)} file(s) training reads too ({shared[0]}"
                f"{', ...' if len(shared) > 1 else ''}): validation would score documents "
                "trained on; hold files out with [training] dataset_holdout_files = N and "
                f"[validation] dataset = {HOLDOUT_DATASET!r}, or point it at other files",
            )
