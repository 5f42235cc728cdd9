"""Any dense LLaMA converts at its own shapes, exactly at full rank.

Tiny random ``transformers`` folders, one per family, with that family's features:

* Llama 2: multi-head attention, RMSNorm eps 1e-5;
* Llama 3.1: GQA 4:1, rope_theta 500000, llama3 rope_scaling (a low original context, so
  the scaled, the smoothed and the unscaled frequency bands all occur at head_dim 16);
* Llama 3.2: the same plus tied embeddings (no ``lm_head.weight`` in the file).

The SVD model converted at full rank (``HFSource`` -> ``Converter``, shapes from the
folder's config.json alone) computes ``transformers``' own ``LlamaForCausalLM`` logits to
1e-5 relative. Through the command line, a Llama-3.2-shaped folder converts with no
flavor of its shapes, exports (``--format hf``, no rank flag: the step records its model)
and loads back in ``transformers`` with the source's logits; a dense folder imports at its
own shapes and exports to ``LlamaForCausalLM`` (eps, theta, scaling survive); settings our
model cannot run are refused in one line naming the key and value.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT

from boost_titan.checkpoint.from_dense.convert import Converter, Options
from boost_titan.checkpoint.from_dense.source import HFSource
from boost_titan.models.model import Transformer

transformers = pytest.importorskip("transformers")

SEQ = 48
CONFIGS = REPO_ROOT / "train_configs"
TOKENIZER = REPO_ROOT / "data/boost_corpus/tokenizer"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
FAMILIES = {
    "llama2": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "llama3.1": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=False,
    ),
    "llama3.2": dict(
        num_attention_heads=8,
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
}


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_folder(folder: Path, family: str, vocab: int = 512, **over) -> Path:
    """A random LlamaForCausalLM of ``family`` saved at ``folder`` (norms off 1, so a lost
    norm or a wrong eps shows; sharp attention, so a RoPE or q/k order slip shows)."""
    kw = dict(
        vocab_size=vocab, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
        rms_norm_eps=1e-5, max_position_embeddings=256, **FAMILIES[family],
    )  # fmt: skip
    kw.update(over)
    cfg = transformers.LlamaConfig(**kw)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.1)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)
    model.save_pretrained(folder)
    return folder


def tokens(vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (2, SEQ), generator=torch.Generator().manual_seed(3))


def hf_logits(folder: Path, ids: torch.Tensor, **kw) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw)
    with torch.no_grad():
        return model.eval()(ids).logits


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_full_rank_svd_computes_transformers_logits(family, tmp_path):
    folder = hf_folder(tmp_path / family, family)
    source = HFSource(folder)
    a = source.args
    target = replace(a, arch="svd", rank=a.dim, kv_rank=a.kv_dim, max_seq_len=SEQ)
    state = Converter(source, target, Options()).state_dict()
    model = Transformer(target)
    model.load_state_dict(state, strict=True)
    ids = tokens(a.vocab_size)
    with torch.no_grad():
        got = model.eval()(ids)
    want = hf_logits(folder, ids)
    err = rel(got, want)
    print(f"\n{family}: full-rank SVD vs transformers' LlamaForCausalLM, rel. error {err:.2e}")
    assert err < 1e-5
    assert a.norm_eps == 1e-5 and (a.kv_heads == 2) == (family != "llama2")
    if family != "llama2":
        assert a.rope_theta == 500000.0 and a.rope_scaling_factor == 8.0
        assert a.rope_original_max_positions == 64


# ----------------------------------------------------------------------------- the CLI
def with_tokenizer(folder: Path) -> Path:
    """The embedded corpus' tokenizer beside the weights (vocabulary 8192)."""
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).write_bytes((TOKENIZER / f).read_bytes())
    return folder


def checkpoint_cli(*argv: str) -> None:
    from boost_titan.cli import checkpoint

    checkpoint.main(list(argv))


def from_dense(*argv: str) -> int:
    from boost_titan.cli import from_dense as cli

    return cli.main(["--threads", "1", "--no-progress", *argv])


@pytest.fixture(scope="module")
def llama32(corpus_dir, tmp_path_factory) -> Path:
    """A Llama-3.2-shaped folder, shrunk: GQA 4:1, theta 500000, llama3 scaling, tied
    embeddings, eps 1e-5; the corpus' vocabulary (the CLI checks the tokenizer fits)."""
    folder = tmp_path_factory.mktemp("l32") / "llama3.2"
    return with_tokenizer(hf_folder(folder, "llama3.2", vocab=8192))


@pytest.fixture(scope="module")
def svd_step(llama32, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("svd") / "step-0"
    # full rank: 128 = dim, 32 = kv_dim; the config names debugmodel, not these shapes
    cfg = str(CONFIGS / "debug_svd.toml")
    assert from_dense("--job.config_file", cfg, "--from", str(llama32), "--to", str(out),
                      "--rank", "128", "--kv-rank", "32") == 0  # fmt: skip
    return out


def test_a_llama32_shaped_folder_converts_at_its_own_shapes(svd_step):
    record = json.loads((svd_step / "model_args.json").read_text())["model_args"]
    want = dict(
        arch="svd", dim=128, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=344, vocab_size=8192,
        norm_eps=1e-5, rope_theta=500000.0, rope_scaling_factor=8.0, rope_low_freq_factor=1.0,
        rope_high_freq_factor=4.0, rope_original_max_positions=64, max_positions=256,
        rank=128, kv_rank=32,
    )  # fmt: skip
    assert {k: record[k] for k in want} == want


def test_export_needs_no_rank_and_transformers_loads_the_source_logits(svd_step, llama32, tmp_path):
    out = tmp_path / "hf"
    cfg = str(CONFIGS / "debug_svd.toml")
    checkpoint_cli("export", "--format", "hf", "--job.config_file", cfg,
                   "--from", str(svd_step), "--to", str(out))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 500000.0
    assert config["rope_interleaved_scaling"]["factor"] == 8.0
    assert config["rank"] == 128 and config["max_position_embeddings"] == 256
    ids = tokens(8192)
    err = rel(hf_logits(out, ids, trust_remote_code=True), hf_logits(llama32, ids))
    print(f"\nllama3.2-shaped: SVD export vs the dense folder, rel. error {err:.2e}")
    assert err < 1e-5


def test_a_dense_folder_imports_at_its_shapes_and_exports_to_llama(corpus_dir, tmp_path):
    src = with_tokenizer(hf_folder(tmp_path / "l31", "llama3.1", vocab=8192))
    step, out = tmp_path / "step-0", tmp_path / "hf"
    cfg = str(CONFIGS / "debug_llama2.toml")
    checkpoint_cli("import", "--format", "hf", "--job.config_file", cfg,
                   "--from", str(src), "--to", str(step))  # fmt: skip
    checkpoint_cli("export", "--format", "hf", "--job.config_file", cfg,
                   "--from", str(step), "--to", str(out))  # fmt: skip
    config = json.loads((out / "config.json").read_text())
    assert config["rms_norm_eps"] == 1e-5 and config["num_key_value_heads"] == 2
    assert config["rope_parameters"] == {**LLAMA3_ROPE, "rope_theta": 500000.0}
    ids = tokens(8192)
    err = rel(hf_logits(out, ids), hf_logits(src, ids))
    print(f"\nllama3.1: import -> export through llama2, rel. error {err:.2e}")
    assert err < 1e-6


def test_a_converted_step_trains_under_btp_tp2_from_its_record(svd_step, tmp_path):
    """The step names the model (--model.flavor STEP): GQA 8:2 heads split over 2 ranks,
    the llama3 RoPE table at the run's sequence length, two optimizer steps."""
    from helpers import run_training

    run = run_training(
        "debug_svd_btp_tp2.toml", 2, tmp_path / "tp2",
        "--checkpoint.enable", "--validation.no-enable", "--metrics.no-enable-tensorboard",
        "--training.steps", "2", "--training.mixed_precision_param", "float32",
        "--checkpoint.initial_load_path", str(svd_step), "--model.flavor", str(svd_step),
    )  # fmt: skip
    assert f"Loaded checkpoint {svd_step} ([checkpoint] initial_load_path)" in run.output
    losses = run.losses()
    print(f"\nLlama-3.2-shaped SVD, BTP TP2: losses {losses}")
    assert len(losses) == 2 and all(0 < x < 20 for x in losses)


# ----------------------------------------------------------------------------- refusals
def _one_line(capsys, run) -> str:
    try:
        rc = run()
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("note:")]
    assert rc == 1 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize(
    "key, value, needle",
    [
        ("attention_bias", True, "attention_bias = True"),
        ("mlp_bias", True, "mlp_bias = True"),
        ("hidden_act", "gelu", "hidden_act = 'gelu'"),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0}, "rope type 'yarn'"),
    ],
)
def test_what_our_model_cannot_run_is_refused_naming_it(llama32, tmp_path, capsys, key, value,
                                                        needle):  # fmt: skip
    folder = tmp_path / "bad"
    folder.mkdir()
    config = json.loads((llama32 / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, key: value}))
    argv = ["--job.config_file", str(CONFIGS / "debug_svd.toml"), "--from", str(folder),
            "--to", str(tmp_path / "step-0"), "--rank", "64"]  # fmt: skip
    assert needle in _one_line(capsys, lambda: from_dense(*argv))
    assert not (tmp_path / "step-0").exists()


def test_a_step_loads_only_as_the_model_it_records(llama32, svd_step, tmp_path, capsys,
                                                  monkeypatch):  # fmt: skip
    from boost_titan.train.config_check import parse_config

    cfg = str(CONFIGS / "debug_svd.toml")
    # no rank: the folder's shapes are not the config flavor's, whose rank cannot apply
    line = _one_line(capsys, lambda: from_dense("--job.config_file", cfg, "--from", str(llama32),
                                                "--to", str(tmp_path / "s")))  # fmt: skip
    assert "dim 128 (flavor: 256)" in line and "give --rank R" in line
    # training from the step under the TOML's built-in flavor: refused at the launch
    # checks (one process), naming the step
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="records another model than model 'svd_llama2' "
                       "flavor 'debugmodel': dim 128 \\(config: 256\\)"):  # fmt: skip
        parse_config(
            [
                "--job.config_file",
                cfg,
                "--job.dump_folder",
                str(tmp_path / "run"),
                "--checkpoint.enable",
                "--checkpoint.initial_load_path",
                str(svd_step),
            ]
        )

    # the record names its architecture: another model name is refused
    line = _one_line(capsys, lambda: _export(cfg, svd_step, tmp_path / "hf", "cola_llama2"))
    assert "records a 'svd' model; [model] name 'cola_llama2' is 'cola'" in line


def _export(cfg: str, step: Path, out: Path, name: str) -> None:
    checkpoint_cli("export", "--format", "hf", "--job.config_file", cfg, "--from", str(step),
                   "--to", str(out), "--model.name", name, "--model.flavor", str(step))  # fmt: skip
