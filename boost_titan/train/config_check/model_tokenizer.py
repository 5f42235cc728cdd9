"""A converted model trains with its own tokenizer (``boost_titan.checkpoint.model_tokenizer``).

A run whose model is a step that carries a tokenizer (``[model] flavor = STEP`` or
``[checkpoint] initial_load_path = STEP``: a conversion of a Hugging Face folder) must
tokenize with that tokenizer: ``[model] hf_assets_path`` is compared with it as a
tokenized corpus is (``data.tokenize.tokenizer_identity``: the files' digests and the
BOS/EOS ids), and another is refused in one line naming both and how to use the model's.
No opt-in: the model's embeddings and LM head are rows of its tokenizer's ids, so any
other tokenizer's ids would stand for other tokens (a smaller one trains without an
error and is silently wrong), and an export would pair the weights with the model's
tokenizer, not the one the run trained with."""

from __future__ import annotations

import shlex

from boost_titan.checkpoint.model_tokenizer import model_tokenizer
from boost_titan.config import ConfigError


def _identity(folder) -> dict:
    from boost_titan.data.tokenize import tokenizer_identity

    try:
        return tokenizer_identity(str(folder))
    except ConfigError:
        raise
    except Exception as e:  # the tokenizers library's own errors name no file
        raise ConfigError(f"tokenizer folder {str(folder)!r} cannot be read: {e}") from None


def _differs(carried_folder, hf_assets_path: str) -> tuple[dict, dict] | None:
    theirs, mine = _identity(carried_folder), _identity(hf_assets_path)
    return None if theirs["digest"] == mine["digest"] else (theirs, mine)


def check_model_tokenizer(config) -> None:
    """One line when ``[model] hf_assets_path`` is not the tokenizer of the run's model."""
    m, ck = config.model, config.checkpoint
    load = ck.initial_load_path if ck.enable and not ck.initial_load_in_hf else None
    for key, step, carried in (
        ("flavor", m.flavor, model_tokenizer(None, m.flavor)),
        ("initial_load_path", load, model_tokenizer(load, None)),
    ):
        if carried is None:
            continue
        found = _differs(carried.folder, m.hf_assets_path)
        if found is None:
            continue
        theirs, mine = found
        section = "model" if key == "flavor" else "checkpoint"
        tok = shlex.quote(str(carried.folder))
        raise ConfigError(
            f"[model] hf_assets_path = {m.hf_assets_path!r} is not the tokenizer of the model "
            f"in [{section}] {key} = {step!r} (converted from {carried.source!r}): vocabulary "
            f"{mine['vocab_size']}, digest {mine['digest'][:12]}; the model's tokenizer "
            f"{str(carried.folder)!r}: vocabulary {theirs['vocab_size']}, digest "
            f"{theirs['digest'][:12]}; its ids would stand for other tokens. Use the model's: "
            f"--model.hf_assets_path {tok} "
            "(the embedded corpus and local_text are tokenized with it as they are read; a "
            f"tokenized corpus: boost-titan data tokenize --tokenizer {tok} --from TEXT "
            "--out DIR)"
        )


def tokenizer_flag(step, hf_assets_path: str) -> str:
    """What a command training from ``step`` adds so that it tokenizes with the model's
    tokenizer: ``--model.hf_assets_path STEP/tokenizer`` where the config's is another."""
    carried = model_tokenizer(str(step), None)
    if carried is None:
        return ""
    try:
        same = _differs(carried.folder, hf_assets_path) is None
    except (OSError, ValueError):  # no tokenizer there (the step is written: say, not fail)
        same = False
    return "" if same else f" --model.hf_assets_path {shlex.quote(str(carried.folder))}"
