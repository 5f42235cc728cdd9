"""``[checkpoint] last_save_in_hf`` / ``initial_load_in_hf`` through our state-dict
adapters (``boost_titan/checkpoint/hf/adapters.py``), on real gloo ranks across layouts.

One save per model, from its seed checkpoint (``conftest.seed_checkpoint``), in a
tensor-parallel layout (CoLA: BTP TP2; dense: Megatron TP2), one step at learning rate 0,
so the HF checkpoint holds exactly the seed's weights (AdamW at lr 0 leaves every
parameter bitwise unchanged):

* the safetensors file is the seed's DCP weights through the layout's ``to_hf``, bit
  for bit, every tensor of the model and nothing else, beside a config.json of the
  model, and nothing else is left in the step folder (torchtitan's per-rank
  ``sharded/`` copy is removed) but its manifest, which verifies; the safetensors
  carry ``{"format": "pt"}``; the dense step folder loads with
  ``LlamaForCausalLM.from_pretrained`` and gives the seed model's logits;
* a config.json of another model in the folder is refused when the config is parsed, in one line;
* runs started from it with ``initial_load_in_hf`` under TP2 (CoLA: BTP; dense:
  Megatron), FSDP2 (CoLA) and PP2 (both) log exactly the losses of the same layout
  started from the seed's DCP checkpoint (``initial_load_path``), step for step (2
  steps: the second after an optimizer step), under another ``debug.seed``, so a load
  that loaded nothing would show.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, run_training
from safetensors import safe_open
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from boost_titan.checkpoint import integrity
from boost_titan.checkpoint.hf.adapters import hf_format
from boost_titan.models.flavors import flavors_for
from boost_titan.models.model import Transformer

COMMON = ("--checkpoint.enable", "--validation.no-enable", "--checkpoint.interval", "100")
PP2 = (
    "--parallelism.pipeline_parallel_degree", "2",
    "--parallelism.pipeline_parallel_schedule", "1F1B",
    "--parallelism.pipeline_parallel_microbatch_size", "2",
)  # fmt: skip

# model name -> (seed config, the TP2 layout that saves, the layout in HF, the arch)
MODELS = {
    "cola": ("debug_cola.toml", "debug_cola_btp_tp2.toml", "cola"),
    "llama": ("debug_llama2.toml", "debug_llama2_tp2.toml", "dense"),
}


@pytest.fixture(scope="module")
def hf_save(seed_checkpoint, tmp_path_factory):
    """layout -> (the seed's DCP step folder, the HF step folder a TP2 run saved)."""
    made = {}

    def get(layout: str) -> tuple[Path, Path]:
        if layout not in made:
            seed_cfg, tp2_cfg, _ = MODELS[layout]
            seed = seed_checkpoint(seed_cfg)
            dump = tmp_path_factory.mktemp(f"hf_save_{layout}")
            run = run_training(
                tp2_cfg, 2, dump, *COMMON,
                "--checkpoint.initial_load_path", str(seed),
                "--checkpoint.last_save_in_hf", "--checkpoint.last_save_model_only",
                "--training.steps", "1", "--optimizer.lr", "0",
            )  # fmt: skip
            assert len(run.losses()) == 1
            made[layout] = (seed, dump / "checkpoint" / "step-1")
        return made[layout]

    return get


def _train_from(config: str, ngpu: int, dump: Path, start: Path, hf: bool, *extra: str):
    # another seed than the seed checkpoint's (42): fresh weights differ from the loaded
    # ones, so a load that silently left the model as initialised (torchtitan loads with
    # strict=False) gives other losses
    load = ["--debug.seed", "7", "--checkpoint.initial_load_path", str(start)]
    if hf:
        load.append("--checkpoint.initial_load_in_hf")
    run = run_training(config, ngpu, dump, *COMMON, *load, "--training.steps", "2", *extra)
    fmt = ", Hugging Face safetensors" if hf else ""
    assert f"Loaded checkpoint {start} ([checkpoint] initial_load_path{fmt})" in run.output
    return run.losses()


@pytest.mark.parametrize("layout", list(MODELS))
def test_hf_save_under_tp2_is_the_seed_through_the_layout(hf_save, layout):
    seed, step = hf_save(layout)
    assert sorted(os.listdir(step)) == [
        ".manifest.json",  # sealed: every file's digests (boost_titan.checkpoint.integrity)
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ]
    result = integrity.check(step)
    assert result.ok and result.trust == "sealed" and result.items == 3, result
    with safe_open(str(step / "model-00001-of-00001.safetensors"), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}  # transformers 4.47 requires it
    saved = load_file(str(step / "model-00001-of-00001.safetensors"))
    everything = _load_state_dict_from_keys(checkpoint_id=str(seed))  # + train_state
    model_parts = ("tok_embeddings.", "layers.", "norm.", "output.")
    ours = {k: v for k, v in everything.items() if k.startswith(model_parts)}
    args = flavors_for(MODELS[layout][2])["debugmodel"].with_overrides(max_seq_len=256)
    fmt = hf_format(layout)
    want = fmt.to_hf(ours, args)
    fmt.check_complete(saved, args)
    assert saved.keys() == want.keys()
    for name, t in want.items():
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], t), name
    config = json.loads((step / "config.json").read_text())
    assert (
        # max_position_embeddings reads back as the weights' context
        fmt.args_from_config(config) == args.with_overrides(max_positions=256)
        and config["torch_dtype"] == "float32"
    )
    if layout == "llama":  # the step folder is a transformers checkpoint as it stands
        from transformers import LlamaForCausalLM

        hf = LlamaForCausalLM.from_pretrained(str(step)).eval()
        model = Transformer(args)
        model.load_state_dict(ours)
        tokens = torch.randint(
            0, args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0)
        )
        with torch.no_grad():
            torch.testing.assert_close(
                hf(tokens).logits, model.eval()(tokens), rtol=1e-5, atol=1e-5
            )


def test_hf_start_refuses_a_config_of_another_model(hf_save, tmp_path, monkeypatch):
    """initial_load_in_hf from a folder whose config.json describes another CoLA (no outer
    SiLU: same shapes, so DCP alone would load it silently): one line when the config is
    parsed, before any rank starts."""
    from boost_titan.train.config_check.parse import parse_config

    monkeypatch.setenv("WORLD_SIZE", "1")  # a launch: the files it would load are checked
    _, step = hf_save("cola")
    other = tmp_path / "other"
    shutil.copytree(step, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "only_lr_act": True}))
    argv = [
        "--job.config_file", str(REPO_ROOT / "train_configs" / "debug_cola.toml"),
        "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable",
        "--checkpoint.initial_load_path", str(other), "--checkpoint.initial_load_in_hf",
    ]  # fmt: skip
    with pytest.raises(ValueError) as e:
        parse_config(argv)
    assert str(e.value) == (
        f"[checkpoint] initial_load_path = {str(other)!r} (initial_load_in_hf): its config.json "
        "holds another model than this run's model: swiglu False (config: True). Use the "
        "config (model name, flavor, [boost] rank options) the weights were trained with."
    )
    (other / "config.json").write_text(json.dumps(config))
    parse_config(argv)  # the saved config itself fits


def test_cola_hf_start_under_tp2_fsdp2_pp2_equals_dcp_start(hf_save, tmp_path):
    seed, hf = hf_save("cola")
    for name, config, extra in (
        ("btp_tp2", "debug_cola_btp_tp2.toml", ()),
        ("fsdp2", "debug_cola_fsdp2.toml", ()),
        ("pp2", "debug_cola.toml", PP2),
    ):
        from_hf = _train_from(config, 2, tmp_path / f"{name}_hf", hf, True, *extra)
        from_dcp = _train_from(config, 2, tmp_path / f"{name}_dcp", seed, False, *extra)
        assert len(from_hf) == 2 and from_hf == from_dcp, name


def test_llama_hf_start_under_tp2_pp2_equals_dcp_start(hf_save, tmp_path):
    seed, hf = hf_save("llama")
    for config in ("debug_llama2_tp2.toml", "debug_llama2_pp2.toml"):
        from_hf = _train_from(config, 2, tmp_path / f"{config}_hf", hf, True)
        from_dcp = _train_from(config, 2, tmp_path / f"{config}_dcp", seed, False)
        assert len(from_hf) == 2 and from_hf == from_dcp, config
