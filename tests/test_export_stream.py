"""Export streams: it reads a DCP step a block at a time and writes each safetensors file
a tensor at a time, never holding the whole model, and writes what the whole-model
export wrote (``read_dcp_model`` + ``safetensors.torch.save_file``), bit for bit.

The streaming is checked by counting, not by RSS (too noisy at test sizes): the reader
records the most tensor bytes it held at once, which must be one block's (or the
largest top-level tensor's) on a 4-block model, each block read once."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT

from boost_titan.checkpoint import export
from boost_titan.checkpoint.export import read_dcp_model, write_dcp_model
from boost_titan.checkpoint.from_dense.source import model_shapes
from boost_titan.models.flavors import flavors_for

TOKENIZER = REPO_ROOT / "data/boost_corpus/tokenizer"


@pytest.fixture(scope="module")
def dense_step(corpus_dir, tmp_path_factory) -> Path:
    """A 4-block dense llama2 step with random weights, recording its model (GQA, so
    q and k are permuted apart in the llama layout)."""
    args = flavors_for("dense")["debugmodel_gqa"].with_overrides(n_layers=4)
    gen = torch.Generator().manual_seed(0)
    state = {k: torch.randn(s, generator=gen) for k, s in model_shapes(args).items()}
    step = write_dcp_model(state, tmp_path_factory.mktemp("dense") / "step-0", args)
    DENSE_STATE.update(state)
    return step


DENSE_STATE: dict[str, torch.Tensor] = {}  # what dense_step wrote


def _job(step: Path):
    from boost_titan.train.config_check import parse_config

    return parse_config(
        ["--job.config_file", str(REPO_ROOT / "train_configs/debug_llama2.toml"),
         "--model.flavor", str(step), "--model.hf_assets_path", str(TOKENIZER)],
        layout=False,
    )  # fmt: skip


@pytest.fixture
def readers(monkeypatch) -> list:
    """Every DCPModelReader an export makes."""
    made = []

    class Counted(export.DCPModelReader):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)

    monkeypatch.setattr(export, "DCPModelReader", Counted)
    return made


def _parts(path: Path) -> tuple[dict, bytes]:
    """(the header as JSON, the data bytes) of a safetensors file."""
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _groups(state: dict[str, torch.Tensor]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for k, v in state.items():
        key = ".".join(k.split(".")[:2]) if k.startswith("layers.") else k
        sizes[key] = sizes.get(key, 0) + v.numel() * v.element_size()
    return sizes


def _held_one_group(reader, state) -> None:
    groups = _groups(state)
    total = sum(groups.values())
    block = max(v for k, v in groups.items() if k.startswith("layers."))
    assert reader.loads == len(groups)  # each block read once
    assert reader.peak_bytes == max(groups.values()) < total / 3
    print(f"\nheld at most {reader.peak_bytes:,} of {total:,} bytes (a block: {block:,})")


def test_safetensors_export_streams_and_equals_the_whole_model_export(
    dense_step, tmp_path, readers, monkeypatch
):
    from safetensors.torch import load_file, save_file

    from boost_titan.checkpoint.integrity import blocks

    # a verified read maps the file a window at a time (8 MiB embeddings: 4 windows)
    mapped, real = [], blocks._mapped
    monkeypatch.setattr(blocks, "_MAP_WINDOW", 2 * blocks.BLOCK)
    monkeypatch.setattr(
        blocks, "_mapped", lambda fd, start, n: mapped.append(n) or real(fd, start, n)
    )
    job = _job(dense_step)
    out = export.export_safetensors(job, str(dense_step), str(tmp_path / "m.safetensors"))
    (reader,) = readers
    state = read_dcp_model(dense_step, export.expected_tensors(export.model_for(job)[1]))
    _held_one_group(reader, state)
    old = tmp_path / "old.safetensors"
    header, data = _parts(out)
    save_file({k: state[k] for k in sorted(state)}, str(old), metadata=header["__metadata__"])
    old_header, old_data = _parts(old)
    # the same tensors at the same offsets, the same metadata, the same bytes
    assert header == old_header and data == old_data
    assert list(header)[1:] == list(old_header)[1:]  # (the metadata's order is save_file's own)
    got = load_file(str(out))
    assert sorted(got) == sorted(DENSE_STATE)
    assert all(torch.equal(got[k], DENSE_STATE[k]) for k in got)  # what was saved
    assert max(mapped) <= 2 * blocks.BLOCK and len(mapped) > len(got)


def test_hf_export_streams_and_equals_the_whole_model_export(dense_step, tmp_path, readers):
    from safetensors.torch import load_file, save_file

    from boost_titan.checkpoint.hf.convert import export_hf
    from boost_titan.checkpoint.hf.llama_format import LLAMA

    job = _job(dense_step)
    args = export.model_for(job)[0]
    state = read_dcp_model(dense_step, export.expected_tensors(export.model_for(job)[1]))
    want = {k: v.to(torch.bfloat16) for k, v in LLAMA.to_hf(state, args).items()}
    for name, dtype, shard in (("f32", None, "5GB"), ("bf16", torch.bfloat16, "2MB")):
        out = export_hf(job, str(dense_step), str(tmp_path / name), "llama", dtype, shard)
        _held_one_group(readers[-1], state)
        files = sorted(out.glob("*.safetensors"))
        got: dict[str, torch.Tensor] = {}
        for f in files:  # each file: what save_file writes of its tensors, byte for byte
            tensors = load_file(str(f))
            save_file(tensors, str(tmp_path / "old.safetensors"), metadata={"format": "pt"})
            assert f.read_bytes() == (tmp_path / "old.safetensors").read_bytes(), f
            got.update(tensors)
        reference = want if dtype else LLAMA.to_hf(state, args)
        assert sorted(got) == sorted(reference)
        assert all(torch.equal(got[k], reference[k]) for k in got)
        assert (len(files) > 1) == (dtype is not None)  # 2MB shards: several files
        assert (out / "model.safetensors.index.json").is_file() == (dtype is not None)
