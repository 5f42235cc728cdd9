"""Hugging Face folders of the ``boost`` layout: our ``transformers`` model class computes
what the trainer's model computes, exported folders load with ``AutoModelForCausalLM`` /
``AutoTokenizer`` offline and generate what our model decodes, HF -> DCP -> HF is bitwise,
and bad folders fail with one error naming what is wrong, writing nothing.

References are independent of the code under test: the trainer's ``Transformer`` (logits,
a plain greedy loop), torchtitan's tokenizer, the DCP seed checkpoint's tensors.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, run_main

from boost_titan.checkpoint.hf import HFFormatError
from boost_titan.checkpoint.hf.boost_format import BOOST
from boost_titan.checkpoint.hf.folder import (
    INDEX_FILE,
    read_hf_config,
    read_hf_tensors,
    write_hf_folder,
)
from boost_titan.models import flavors_for
from boost_titan.models.model import Transformer

# (arch, flavor, LaX gate): every architecture with MHA and GQA, LaX with both gates
CASES = [
    (arch, flavor, gate)
    for arch in ("dense", "svd", "cola", "lax")
    for flavor in ("debugmodel", "debugmodel_gqa")
    for gate in (("kron", "dense") if arch == "lax" else ("kron",))
]
PROMPT = "The history of the city begins with"
NEW_TOKENS = 20


def _ours(arch: str, flavor: str, gate: str, seed: int = 0) -> Transformer:
    """A 2-block debug model of the trainer, initialised as the trainer does."""
    args = flavors_for(arch)[flavor].with_overrides(n_layers=2, max_seq_len=64, lax_gate=gate)
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model.eval()


def _transformers_model(model: Transformer):
    from boost_titan.checkpoint.hf.remote.configuration_boost_llama import BoostLlamaConfig
    from boost_titan.checkpoint.hf.remote.modeling_boost_llama import BoostLlamaForCausalLM

    args = model.model_args
    config = {k: v for k, v in BOOST.config(args).items() if k not in ("auto_map",)}
    with torch.device("meta"):  # no random init: every tensor is assigned
        hf = BoostLlamaForCausalLM(BoostLlamaConfig(**config)).eval()
    hf.load_state_dict(BOOST.to_hf(model.state_dict(), args), strict=True, assign=True)
    return hf


@pytest.mark.parametrize("arch,flavor,gate", CASES)
def test_transformers_logits_equal_ours(arch, flavor, gate):
    ours = _ours(arch, flavor, gate)
    hf = _transformers_model(ours)
    tokens = torch.randint(0, ours.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ours(tokens)
        got = hf(tokens, use_cache=False).logits
        # the KV cache: the prompt, then one token at a time, gives the same last logits
        out = hf(tokens[:, :40], use_cache=True)
        cache = out.cache
        for t in range(40, 48):
            step = hf(tokens[:, t : t + 1], cache=cache, use_cache=True)
            cache = step.cache
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=0)
    torch.testing.assert_close(step.logits[:, -1], ref[:, -1], rtol=1e-4, atol=1e-5)
    assert got.abs().max() > 0.1  # a model that computes something


def _greedy(model: Transformer, prompt: list[int], n: int, eos: int) -> list[int]:
    """Greedy decoding with the trainer's model: the whole sequence each step, no cache.
    EOS is suppressed (here and in generate()): a random model emits it early, and all
    ``n`` tokens are compared."""
    tokens = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(n):
            logits = model(tokens)[:, -1]
            logits[:, eos] = -float("inf")
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
    return tokens[0].tolist()


def test_left_padded_batch_generates_each_row_like_ours():
    """generate() on a left-padded batch (attention_mask with zeros): each row decodes as
    the trainer's model decodes that prompt alone (padding masked, never NaN)."""
    ours = _ours("lax", "debugmodel_gqa", "kron")
    hf = _transformers_model(ours)
    a, b = [5, 17, 300, 42, 7, 99], [8, 9, 10]
    ids = torch.tensor([a, [0] * 3 + b])
    mask = torch.tensor([[1] * 6, [0] * 3 + [1] * 3])
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=10,
        do_sample=False,
        pad_token_id=0,
        suppress_tokens=[1],
    )
    for row, prompt in zip(out.tolist(), (a, b)):
        assert row[-10:] == _greedy(ours, prompt, 10, eos=1)[-10:]


# Runs with nothing of ours imported (asserted), offline, stdin closed: each folder loaded
# with AutoModelForCausalLM / AutoTokenizer, greedy generate() with and without the KV cache.
_LOAD = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
jobs = json.loads(sys.argv[1])
out = {}
for name, job in jobs.items():
    tok = AutoTokenizer.from_pretrained(job["dir"], trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(job["dir"], trust_remote_code=True)
    prompt = torch.tensor([job["prompt"]])
    gen = {
        str(c): model.generate(
            prompt, max_new_tokens=job["n"], do_sample=False, use_cache=c,
            suppress_tokens=[tok.eos_token_id],
        )[0].tolist()
        for c in (True, False)
    }
    with torch.no_grad():
        logits = model(torch.tensor([job["tokens"]]), use_cache=False).logits
    out[name] = {
        "class": type(model).__name__, "tokenizer": type(tok).__name__, "dtype": str(model.dtype),
        "encoded": tok(job["text"])["input_ids"], "bos": tok.bos_token_id, "eos": tok.eos_token_id,
        "generated": gen, "logits": logits[0].tolist(),
    }
plain = AutoTokenizer.from_pretrained(jobs["lax"]["dir"])  # no trust_remote_code, no prompt
out["plain_encoded"] = plain(jobs["lax"]["text"])["input_ids"]
out["ours_imported"] = sorted(m for m in sys.modules if m.startswith(("boost_titan", "torchtitan")))
print("\nRESULT " + json.dumps(out))  # after transformers' prompt (no newline of its own)
"""


def test_exported_folders_load_offline_and_generate_like_ours(corpus_dir, tmp_path):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    tokenizer_dir = corpus_dir / "tokenizer"
    ours_tok = HuggingFaceTokenizer(str(tokenizer_dir))
    prompt = ours_tok.encode(PROMPT, add_bos=True, add_eos=False)
    models = {
        "dense": _ours("dense", "debugmodel", "kron"),
        "svd": _ours("svd", "debugmodel_gqa", "kron"),
        "cola": _ours("cola", "debugmodel", "kron"),
        "lax": _ours("lax", "debugmodel_gqa", "kron"),
        "lax_dense_gate_sharded": _ours("lax", "debugmodel", "dense"),
    }
    tokens = torch.randint(0, 8192, (32,), generator=torch.Generator().manual_seed(2)).tolist()
    jobs = {}
    for name, model in models.items():
        folder = tmp_path / name
        write_hf_folder(
            {k: v.detach() for k, v in model.state_dict().items()},
            model.model_args,
            "boost",
            tokenizer_dir,
            folder,
            max_shard_size="1MB" if "sharded" in name else "5GB",
        )
        jobs[name] = {
            "dir": str(folder),
            "prompt": prompt,
            "n": NEW_TOKENS,
            "tokens": tokens,
            "text": PROMPT,
        }
    sharded = tmp_path / "lax_dense_gate_sharded"
    index = json.loads((sharded / INDEX_FILE).read_text())
    shard_files = sorted(set(index["weight_map"].values()))
    assert len(shard_files) > 3 and not (sharded / "model.safetensors").exists()
    assert shard_files[0] == f"model-00001-of-{len(shard_files):05d}.safetensors"
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size() for v in models["lax_dense_gate_sharded"].state_dict().values()
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD, json.dumps(jobs)],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.split("\nRESULT ", 1)[1])
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    assert got["ours_imported"] == []  # transformers + torch alone ran the folders
    expected_ids = ours_tok.encode(PROMPT, add_bos=False, add_eos=False)
    assert got["plain_encoded"] == expected_ids
    for name, model in models.items():
        res = got[name]
        assert res["class"] == "BoostLlamaForCausalLM" and res["dtype"] == "torch.float32"
        assert res["encoded"] == expected_ids, name
        assert (res["bos"], res["eos"]) == (ours_tok.bos_id, ours_tok.eos_id), name
        want = _greedy(model, prompt, NEW_TOKENS, ours_tok.eos_id)
        assert len(want) == len(prompt) + NEW_TOKENS
        assert res["generated"]["True"] == want, name
        assert res["generated"]["False"] == want, name
        with torch.no_grad():
            ref = model(torch.tensor([tokens]))[0]
        torch.testing.assert_close(torch.tensor(res["logits"]), ref, rtol=1e-5, atol=0)


# ----------------------------------------------------------------------------- CLI
def _cli(*args: str, config: str = "debug_cola.toml", ok: bool = True):
    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        *args,
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / config),
    )
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def exported(seed_checkpoint, tmp_path_factory):
    """The debug_cola seed checkpoint exported (no --hf-layout: the default, boost),
    imported back to DCP and exported again; plus a bf16 export sharded at 1MB."""
    root = tmp_path_factory.mktemp("hf")
    seed = seed_checkpoint("debug_cola.toml")
    first, again = root / "first", root / "again"
    imported = root / "imported" / "step-0"
    _cli("export", "--format", "hf", "--from", str(seed), "--to", str(first))
    _cli("import", "--format", "hf", "--from", str(first), "--to", str(imported))
    _cli(
        "export",
        "--format",
        "hf",
        "--hf-layout",
        "boost",
        "--from",
        str(imported),
        "--to",
        str(again),
    )
    bf16 = root / "bf16"
    _cli(
        "export", "--format", "hf", "--hf-layout", "boost", "--from", str(seed), "--to", str(bf16),
        "--dtype", "bfloat16", "--max-shard-size", "1MB",
    )  # fmt: skip
    return {"root": root, "seed": seed, "first": first, "again": again, "bf16": bf16}


def test_hf_dcp_hf_round_trip_is_bitwise(exported):
    from boost_titan.checkpoint.export import read_dcp_model
    from boost_titan.checkpoint.hf.boost_format import hf_name

    first, again = exported["first"], exported["again"]
    _identical(read_hf_tensors(first), read_hf_tensors(again))
    assert read_hf_config(first) == read_hf_config(again)
    assert sorted(p.name for p in first.iterdir()) == sorted(p.name for p in again.iterdir())
    for name in ("tokenizer.json", "modeling_boost_llama.py", "configuration_boost_llama.py"):
        assert (first / name).read_bytes() == (again / name).read_bytes()
    # and the folder holds the seed checkpoint's tensors under their HF names
    from boost_titan.checkpoint.export import expected_tensors, model_for

    hf = read_hf_tensors(first)
    _, meta_model = model_for(_job("debug_cola.toml"))
    state = read_dcp_model(exported["seed"], expected_tensors(meta_model))
    _identical(hf, {hf_name(k): v for k, v in state.items()})
    config = read_hf_config(first)
    assert (config["model_type"], config["arch"], config["rank"], config["torch_dtype"]) == (
        "boost_llama", "cola", 64, "float32",
    )  # fmt: skip
    umask = os.umask(0)
    os.umask(umask)
    assert oct(first.stat().st_mode & 0o777) == oct(0o777 & ~umask)
    for p in first.iterdir():
        assert oct(p.stat().st_mode & 0o777) == oct(0o666 & ~umask), p
    assert not [p for p in exported["root"].iterdir() if p.name.endswith(".tmp")]


# the default export of a CoLA model, opened as a user would: transformers alone, offline,
# stdin closed (a trust_remote_code prompt would print "[y/N]" and read EOF)
_OPEN_DEFAULT = r"""
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast
folder = sys.argv[1]
model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
tok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
plain = PreTrainedTokenizerFast.from_pretrained(folder)  # no flag: no config.json read
ids = tok("The history of the city", return_tensors="pt").input_ids
assert plain("The history of the city")["input_ids"] == ids[0].tolist()
out = model.generate(ids, max_new_tokens=4, do_sample=False)
print("OPENED", type(model).__name__, type(tok).__name__, out.shape[1] - ids.shape[1])
"""


def test_default_cola_export_opens_with_auto_classes(exported, tmp_path):
    """A CoLA export without --hf-layout is the boost layout (the authors' layout needs
    their code), which AutoModelForCausalLM opens with trust_remote_code, and whose
    tokenizer loads without a prompt."""
    assert read_hf_config(exported["first"])["model_type"] == "boost_llama"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _OPEN_DEFAULT, str(exported["first"])],
        cwd=tmp_path,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "OPENED BoostLlamaForCausalLM" in proc.stdout and proc.stdout.rstrip().endswith(" 4")
    assert "[y/N]" not in proc.stdout + proc.stderr


def test_bf16_export_is_sharded_with_an_index(exported):
    bf16, first = exported["bf16"], exported["first"]
    index = json.loads((bf16 / INDEX_FILE).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 3 and all((bf16 / f).is_file() for f in files)
    assert read_hf_config(bf16)["torch_dtype"] == "bfloat16"
    want = {k: v.to(torch.bfloat16) for k, v in read_hf_tensors(first).items()}
    _identical(read_hf_tensors(bf16), want)


# ----------------------------------------------------------------------------- bad input
def _job(config: str, *overrides: str):
    from boost_titan.train.config_check import parse_config

    return parse_config(
        ["--job.config_file", str(REPO_ROOT / "train_configs" / config), *overrides],
        layout=False,
    )


def _rewrite(folder: Path, change) -> None:
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_tokenizer(folder: Path) -> None:
    tok = json.loads((folder / "tokenizer.json").read_text())
    tok["added_tokens"].append({**tok["added_tokens"][-1], "id": 9000, "content": "<|extra|>"})
    (folder / "tokenizer.json").write_text(json.dumps(tok))


_BAD_IMPORTS = {
    # name: (config, overrides, change to the folder, what the error names)
    "another architecture": ("debug_svd.toml", (), None, "arch 'cola' (config: 'svd')"),
    "another rank": ("debug_cola.toml", ("--boost.rank", "32"), None, "rank 64 (config: 32)"),
    "missing tensor": (
        "debug_cola.toml",
        (),
        lambda f: _rewrite(f, lambda t: t.pop("model.layers.1.attention.wk.up.weight")),
        "missing 1 tensors, e.g. ['layers.1.attention.wk.up.weight']",
    ),
    "extra tensor": (
        "debug_cola.toml",
        (),
        lambda f: _rewrite(f, lambda t: t.update({"model.layers.0.extra": torch.zeros(2)})),
        "1 tensors the model does not have, e.g. ['layers.0.extra']",
    ),
    "foreign name": (
        "debug_cola.toml",
        (),
        lambda f: _rewrite(f, lambda t: t.update({"transformer.wte": torch.zeros(2)})),
        "not in the boost layout",
    ),
    "mis-shaped tensor": (
        "debug_cola.toml",
        (),
        lambda f: _rewrite(f, lambda t: t.update({"model.norm.weight": torch.ones(255)})),
        "norm.weight: (255,) (model: (256,))",
    ),
    "no tokenizer": (
        "debug_cola.toml",
        (),
        lambda f: (f / "tokenizer.json").unlink(),
        "no tokenizer in",
    ),
    "vocabulary larger than the model's": (
        "debug_cola.toml",
        (),
        _edit_tokenizer,
        "has 9001 tokens but the model's vocab_size is 8192",
    ),
    "no config.json": (
        "debug_cola.toml",
        (),
        lambda f: (f / "config.json").unlink(),
        "is not a Hugging Face model folder",
    ),
}


@pytest.mark.parametrize("case", sorted(_BAD_IMPORTS))
def test_import_refuses_a_folder_that_does_not_fit(exported, tmp_path, case):
    from boost_titan.checkpoint.hf.convert import import_hf

    config, overrides, change, message = _BAD_IMPORTS[case]
    folder = tmp_path / "folder"
    shutil.copytree(exported["first"], folder)
    if change is not None:
        change(folder)
    out = tmp_path / "ckpt" / "step-0"
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        import_hf(_job(config, *overrides), str(folder), str(out))
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)
    assert not out.exists() and not (tmp_path / "ckpt").exists()  # nothing written


def test_export_refuses_bad_input_and_writes_nothing(exported, tmp_path):
    from boost_titan.checkpoint.hf.convert import export_hf
    from boost_titan.checkpoint.hf.folder import get_format

    seed = str(exported["seed"])
    out = tmp_path / "out"
    job = _job("debug_cola.toml", "--model.hf_assets_path", str(tmp_path / "nowhere"))
    with pytest.raises(HFFormatError, match="no tokenizer in .*nowhere"):
        export_hf(job, seed, str(out), "boost")
    (tmp_path / "existing").mkdir()
    with pytest.raises(FileExistsError, match="exists; export writes a new folder"):
        export_hf(_job("debug_cola.toml"), seed, str(tmp_path / "existing"), "boost")
    with pytest.raises(HFFormatError, match="unknown Hugging Face layout 'gpt2'"):
        get_format("gpt2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["existing"]


def test_cli_import_error_is_one_line(exported, tmp_path):
    out = tmp_path / "step-0"
    proc = _cli(
        "import", "--format", "hf", "--from", str(exported["first"]), "--to", str(out),
        config="debug_svd.toml", ok=False,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "import: error: folder" in proc.stderr and "arch 'cola' (config: 'svd')" in proc.stderr
    assert not out.exists()


def test_training_does_not_import_transformers():
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import boost_titan.train, boost_titan.train.specs, boost_titan.cli.checkpoint, sys; "
            "assert 'transformers' not in sys.modules, 'transformers imported'",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
