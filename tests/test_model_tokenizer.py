"""A model converted from a Hugging Face folder keeps that folder's tokenizer and special
ids through training and export (``boost_titan.checkpoint.model_tokenizer``).

The source: a Llama-3.2-shaped folder (GQA, llama3 RoPE, tied embeddings; 2 blocks)
with a small real byte-level BPE tokenizer made with ``tokenizers``, whose BOS/EOS are
not ids 0/1, a generation_config.json of its own and a vocabulary (320) above the
tokenizer's size, as Llama 3's 128256 is above its 128000 + 256 tokens, and below the
run's tokenizer's (8192): the run's tokenizer plays no part in the export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import REPO_ROOT

transformers = pytest.importorskip("transformers")

CONFIG = str(REPO_ROOT / "train_configs" / "debug_svd.toml")
BOS, EOS, VOCAB = "<|begin_of_text|>", "<|end_of_text|>", 320
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


def _tokenizer(folder: Path) -> tuple[int, int]:
    """A byte-level BPE of 290 tokens trained on a few sentences, BOS and EOS added last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = ["The history of the city begins with a river.", "A model keeps its tokens."] * 20
    tok.train_from_iterator(
        text,
        trainers.BpeTrainer(vocab_size=290, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()),
    )
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(folder / "tokenizer.json"))
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
              "model_max_length": 256, "clean_up_tokenization_spaces": False}  # fmt: skip
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "special_tokens_map.json").write_text(json.dumps({"bos_token": BOS,
                                                                "eos_token": EOS}))  # fmt: skip
    generation = {"bos_token_id": bos, "eos_token_id": [eos, bos], "do_sample": True,
                  "temperature": 0.6, "top_p": 0.9}  # fmt: skip
    (folder / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return bos, eos


@pytest.fixture(scope="module")
def source(corpus_dir, tmp_path_factory) -> Path:
    from test_from_dense_families import hf_folder

    folder = tmp_path_factory.mktemp("l32tok") / "llama3.2"
    folder.mkdir()
    bos, eos = _tokenizer(folder)
    assert (bos, eos) != (0, 1) and min(bos, eos) > 100
    hf_folder(folder, "llama3.2", vocab=VOCAB, bos_token_id=bos, eos_token_id=eos)
    _tokenizer(folder)  # (save_pretrained wrote a generation_config.json of its own)
    return folder


@pytest.fixture(scope="module")
def converted(source, tmp_path_factory) -> tuple[Path, str]:
    """(the step from-dense wrote, what it printed)."""
    import contextlib
    import io

    from boost_titan.cli import from_dense

    out, printed = tmp_path_factory.mktemp("conv") / "step-0", io.StringIO()
    with contextlib.redirect_stdout(printed):
        rc = from_dense.main(["--threads", "1", "--no-progress", "--job.config_file", CONFIG,
                              "--from", str(source), "--to", str(out), "--rank", "32",
                              "--kv-rank", "16"])  # fmt: skip
    assert rc == 0
    return out, printed.getvalue()


@pytest.fixture(scope="module")
def step(converted) -> Path:
    return converted[0]


def _export(step: Path, out: Path, *extra: str) -> None:
    from boost_titan.cli import checkpoint

    checkpoint.main(["export", "--format", "hf", "--job.config_file", CONFIG,
                     "--from", str(step), "--to", str(out), *extra])  # fmt: skip


def _same_tokenizer(source: Path, folder: Path) -> None:
    for name in TOKENIZER_FILES:
        assert (folder / name).read_bytes() == (source / name).read_bytes(), name


def test_export_carries_the_source_tokenizer_and_ids(source, step, tmp_path):
    src_config = json.loads((source / "config.json").read_text())
    bos, eos = src_config["bos_token_id"], src_config["eos_token_id"]
    _same_tokenizer(source, step / "tokenizer")
    record = json.loads((step / "tokenizer" / "special_ids.json").read_text())
    assert record["ids"] == {"bos_token_id": bos, "eos_token_id": eos}
    # the converted step, and a later step of a run whose model it is (--model.flavor)
    trained = tmp_path / "run" / "step-0"
    shutil.copytree(step, trained, ignore=shutil.ignore_patterns("tokenizer", "model_args.json"))
    cases = {"hf": (step, ()), "trained": (trained, ("--model.flavor", str(step)))}
    for name, (src, extra) in cases.items():
        out = tmp_path / name
        _export(src, out, *extra)
        _same_tokenizer(source, out)
        config = json.loads((out / "config.json").read_text())
        assert (config["bos_token_id"], config["eos_token_id"]) == (bos, eos) != (0, 1)
        assert config["max_position_embeddings"] == src_config["max_position_embeddings"]
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(tmp_path / "hf"))
    assert (tok.bos_token_id, tok.eos_token_id, tok.model_max_length) == (bos, eos, 256)


def test_training_with_another_tokenizer_is_refused_in_one_line(step, tmp_path, monkeypatch):
    from boost_titan.train.config_check import parse_config
    from boost_titan.train.config_check.model_tokenizer import check_model_tokenizer

    monkeypatch.setenv("WORLD_SIZE", "1")
    argv = ["--job.config_file", CONFIG, "--job.dump_folder", str(tmp_path / "run"),
            "--model.flavor", str(step), "--checkpoint.enable",
            "--checkpoint.initial_load_path", str(step)]  # fmt: skip
    with pytest.raises(ValueError) as err:  # the debug config's corpus tokenizer
        parse_config(argv)
    line = str(err.value)
    assert "\n" not in line and "is not the tokenizer of the model in [model] flavor" in line
    assert (
        "vocabulary 8192" in line
        and f"the model's tokenizer '{step}/tokenizer': vocabulary 292" in line
    )
    assert f"--model.hf_assets_path {step}/tokenizer" in line
    assert f"data tokenize --tokenizer {step}/tokenizer" in line
    mine = parse_config([*argv, "--model.hf_assets_path", str(step / "tokenizer")], layout=False)
    check_model_tokenizer(mine)  # the model's own: accepted


def test_the_printed_command_names_the_tokenizer(converted):
    out, printed = converted
    command = printed.rstrip().splitlines()[-1]
    assert command.endswith(f" --model.hf_assets_path {out}/tokenizer"), command


def test_a_folder_without_tokenizer_is_refused(source, tmp_path, capsys):
    from boost_titan.cli import from_dense

    bare = tmp_path / "bare"
    shutil.copytree(source, bare, ignore=shutil.ignore_patterns("tokenizer*", "special*"))
    rc = from_dense.main(["--threads", "1", "--no-progress", "--job.config_file", CONFIG,
                          "--from", str(bare), "--to", str(tmp_path / "s"),
                          "--rank", "32"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "holds no tokenizer.json" in err[0], err
    assert not (tmp_path / "s").exists()
