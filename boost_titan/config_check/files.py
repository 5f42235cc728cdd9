"""Launch checks on disk: the tokenizer folder (tokenizer.json, its vocabulary against
the flavor's) and the datasets a run reads (local paths exist; remote ones are
reachable unless Hugging Face is offline)."""

from __future__ import annotations

import os

from boost_titan.config_check.common import ConfigError, ConfigPathError, _ours, bad
from boost_titan.config_check.model import config_args


def _check_files(config) -> None:
    """What a launch reads from disk: tokenizer, datasets."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from boost_titan.datasets import _BUILD_HINT
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
    for section, s in sections:
        entry = DATASETS[s.dataset]
        path = s.dataset_path or entry.path
        key = "dataset_path" if s.dataset_path else "dataset"
        value = s.dataset_path or s.dataset
        if s.dataset == "local_text" and not s.dataset_path:
            raise bad(
                section,
                "dataset_path",
                None,
                "must be set for dataset 'local_text' (a file or folder of "
                ".jsonl/.json/.txt/.parquet, or a saved dataset folder)",
            )
        local = (
            s.dataset in ("boost_corpus", "boost_corpus_val", "local_text")
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
