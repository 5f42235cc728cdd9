"""The llama and cola Hugging Face layouts (boost_titan/checkpoint/hf/llama_format.py,
cola_format.py).

llama: ``transformers``' own ``LlamaForCausalLM``, built from our exported weights, gives
our logits (fp32), MHA and GQA; the q/k permutation is what makes it so.

cola: the CoLA authors' ``ColaForCausalLM`` is not in ``transformers`` and their code is
not ours to ship, so this file does not run it. Instead:

* ``tests/data/cola_authors_tiny.json`` lists the names and shapes of their model's state
  dict for a tiny config; our ``to_hf`` must give exactly those. It was made from their
  repository (github.com/alvin-zyl/CoLA at 91ff0d1) copied outside this one, under
  transformers 5.25 with four shims (docs/huggingface-adapters.md), by building
  ``ColaForCausalLM(ColaConfig(**ColaFormat().config(args)))`` for the ``args`` of
  :func:`tiny_cola` (``swiglu=False``) and writing ``{name: list(shape)}`` of its
  ``state_dict()``. The same script loaded our exported weights into their model and
  theirs into ours: logits equal to 1e-6 relative (docs).
* their forward is transformers' LLaMA with each projection a ``ColaLayer``
  (``silu(x @ cola_a) @ cola_b``) and, with ``only_lr_act``, no SiLU between gate and up;
  :func:`cola_reference` builds exactly that from ``LlamaForCausalLM`` and a
  three-line restatement of ``ColaLayer.forward``, and must give our logits.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from boost_titan.checkpoint.hf import HFFormatError
from boost_titan.checkpoint.hf.cola_format import COLA
from boost_titan.checkpoint.hf.llama_format import LLAMA
from boost_titan.models.args import LlamaArgs
from boost_titan.models.model import Transformer

transformers = pytest.importorskip("transformers")

FIXTURE = Path(__file__).parent / "data" / "cola_authors_tiny.json"
VOCAB, SEQ = 97, 24


def model(args: LlamaArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(args)
    with torch.no_grad():
        m.init_weights()
        for n, p in m.named_parameters():
            if "norm" in n:  # norms off 1, so a swapped norm shows
                p.normal_(1.0, 0.1)
            if (".wq." in n or ".wk." in n) and ".down." not in n:
                p.mul_(8.0)  # sharp attention, so RoPE's pairing shows in the logits
    return m.eval()


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))


def tiny_llama(kv: int | None) -> LlamaArgs:
    return LlamaArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=kv, vocab_size=VOCAB,
                     ffn_dim=96, max_seq_len=SEQ)  # fmt: skip


def tiny_cola(swiglu: bool) -> LlamaArgs:
    return LlamaArgs(dim=64, n_layers=2, n_heads=4, vocab_size=VOCAB, ffn_dim=96,
                     max_seq_len=SEQ, arch="cola", rank=16, swiglu=swiglu,
                     norm_eps=1e-6)  # fmt: skip


def assert_bitwise_round_trip(fmt, sd, args) -> None:
    back = fmt.from_hf(fmt.to_hf(sd, args), args)
    assert back.keys() == sd.keys()
    for k in sd:
        assert torch.equal(back[k], sd[k]), k
        assert back[k].is_contiguous(), k


# ------------------------------------------------------------------------------ llama
@pytest.mark.parametrize("kv", [None, 2], ids=["mha", "gqa"])
def test_llama_logits_match_transformers(kv):
    args = tiny_llama(kv)
    ours = model(args)
    sd = ours.state_dict()
    cfg = LLAMA.config(args)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg)).eval()
    hf.load_state_dict(LLAMA.to_hf(sd, args), strict=True)
    with torch.no_grad():
        want, got = ours(tokens()), hf(tokens()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # without the q/k permutation the logits differ: the permutation is what matches
    plain = {LLAMA.to_hf({k: v}, args).popitem()[0]: v for k, v in sd.items()}
    hf.load_state_dict(plain, strict=True)
    with torch.no_grad():
        assert (hf(tokens()).logits - want).abs().max() > 1e-2
    assert_bitwise_round_trip(LLAMA, sd, args)
    # the config's max_position_embeddings is read as the weights' context
    assert LLAMA.args_from_config(cfg) == replace(args, max_positions=SEQ)
    # transformers reads back the same config
    again = transformers.LlamaConfig(**cfg).to_dict()
    assert LLAMA.args_from_config(again) == replace(args, max_positions=SEQ)


def test_llama_refusals():
    args = tiny_llama(None)
    sd = model(args).state_dict()
    with pytest.raises(HFFormatError, match="'layers.0.attention.wq.weight' has shape"):
        LLAMA.to_hf({"layers.0.attention.wq.weight": sd["output.weight"]}, args)
    with pytest.raises(HFFormatError, match="'model.layers.9.mlp.gate_proj.weight' is not"):
        LLAMA.from_hf({"model.layers.9.mlp.gate_proj.weight": torch.zeros(96, 64)}, args)
    with pytest.raises(HFFormatError, match="holds architectures \\['dense'\\], not 'cola'"):
        LLAMA.config(tiny_cola(True))
    with pytest.raises(HFFormatError, match="rope type 'yarn'"):
        LLAMA.args_from_config({**LLAMA.config(args), "rope_parameters": {"rope_type": "yarn"}})
    with pytest.raises(HFFormatError, match="llama3 rope scaling lacks \\['factor'"):
        LLAMA.args_from_config({**LLAMA.config(args), "rope_parameters": {"rope_type": "llama3"}})
    with pytest.raises(HFFormatError, match="missing \\['lm_head.weight'\\]"):
        LLAMA.check_complete([n for n in LLAMA.hf_shapes(args) if n != "lm_head.weight"], args)


# ------------------------------------------------------------------------------ cola
class _ColaProj(torch.nn.Module):
    """``ColaLayer.forward`` of the CoLA authors (bias-free): silu(x @ a) @ b."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor):
        super().__init__()
        self.cola_a, self.cola_b = torch.nn.Parameter(a), torch.nn.Parameter(b)

    def forward(self, x):
        return torch.nn.functional.silu(x @ self.cola_a) @ self.cola_b


def cola_reference(hf_sd: dict, cfg: dict):
    """Their ColaForCausalLM, rebuilt from LlamaForCausalLM: every projection a
    ColaLayer; ``only_lr_act``: no activation between gate and up."""
    llama_cfg = {k: v for k, v in cfg.items() if k not in ("rank", "only_lr_act", "lr_act_type")}
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_cfg)).eval()
    for name, a in hf_sd.items():
        if name.endswith(".cola_a"):
            parent, attr = name.removesuffix(".cola_a").rsplit(".", 1)
            b = hf_sd[name.replace(".cola_a", ".cola_b")]
            setattr(ref.get_submodule(parent), attr, _ColaProj(a.clone(), b.clone()))
    ref.load_state_dict(hf_sd, strict=True)  # every name of their layout, nothing else
    if cfg["only_lr_act"]:
        for layer in ref.model.layers:
            layer.mlp.act_fn = torch.nn.Identity()
    return ref


@pytest.mark.parametrize("swiglu", [True, False], ids=["swiglu", "only_lr_act"])
def test_cola_logits_match_reference(swiglu):
    args = tiny_cola(swiglu)
    ours = model(args)
    sd = ours.state_dict()
    cfg = COLA.config(args)
    assert cfg["only_lr_act"] is (not swiglu) and cfg["rank"] == 16
    ref = cola_reference(COLA.to_hf(sd, args), cfg)
    with torch.no_grad():
        want, got = ours(tokens()), ref(tokens()).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # q's and k's B unpermuted (plain transposes): other logits
    plain = dict(COLA.to_hf(sd, args))
    for i in range(args.n_layers):
        for ours, hf in (("wq", "q_proj"), ("wk", "k_proj")):
            up = sd[f"layers.{i}.attention.{ours}.up.weight"]
            plain[f"model.layers.{i}.self_attn.{hf}.cola_b"] = up.t().contiguous()
    with torch.no_grad():
        assert (cola_reference(plain, cfg)(tokens()).logits - want).abs().max() > 1e-2
    assert_bitwise_round_trip(COLA, sd, args)
    assert COLA.args_from_config(cfg) == replace(args, max_positions=SEQ)


def test_cola_names_and_shapes_are_the_authors():
    fixture = json.loads(FIXTURE.read_text())
    args = tiny_cola(swiglu=False)
    cfg = COLA.config(args)
    assert {k: cfg[k] for k in fixture["config"]} == fixture["config"]
    hf = COLA.to_hf(model(args).state_dict(), args)
    got = {n: list(t.shape) for n, t in hf.items()}
    assert got == fixture["tensors"]
    assert list(got) == list(fixture["tensors"])  # their order, too
    assert COLA.hf_shapes(args) == {n: tuple(s) for n, s in fixture["tensors"].items()}
    # their config files' keys read back as our flavors (cola_configs/cola_60m.json)
    theirs_60m = {
        "architectures": ["ColaForCausalLM"], "hidden_act": "silu", "hidden_size": 512,
        "intermediate_size": 1376, "max_sequence_length": 1024, "model_type": "cola",
        "num_attention_heads": 8, "num_hidden_layers": 8, "rms_norm_eps": 1e-06,
        "vocab_size": 32000, "rank": 128, "only_lr_act": False,
    }  # fmt: skip
    from boost_titan.models.flavors import flavors_for

    got = COLA.args_from_config(theirs_60m)
    want = flavors_for("cola")["60m"]
    assert got.with_overrides(max_seq_len=want.max_seq_len) == want
    # 350m and up: no only_lr_act key, their ColaConfig's default (true): no outer SiLU
    del theirs_60m["only_lr_act"]
    assert COLA.args_from_config(theirs_60m).swiglu is False


def test_cola_refuses_what_the_authors_model_cannot_hold():
    gqa = tiny_cola(True).with_overrides(n_kv_heads=2)
    with pytest.raises(HFFormatError, match="grouped-query attention"):
        COLA.config(gqa)
    with pytest.raises(HFFormatError, match="a k/v rank 8 other than rank 16"):
        COLA.config(tiny_cola(True).with_overrides(kv_rank=8))
    with pytest.raises(HFFormatError, match="latent_act 'none'"):
        COLA.config(tiny_cola(True).with_overrides(latent_act="none"))
    with pytest.raises(HFFormatError, match="not 'dense'"):
        COLA.config(tiny_llama(None))
    with pytest.raises(HFFormatError, match="no grouped-query attention"):
        COLA.args_from_config({**COLA.config(tiny_cola(True)), "num_key_value_heads": 2})


# ------------------------------------------------------------------------------ training options
def test_hf_step_in_the_run_folder_is_not_resumed(tmp_path, monkeypatch):
    """The same command again after a last_save_in_hf save: refused at launch, naming
    the way to start from it (initial_load_in_hf)."""
    from boost_titan.train.config_check import parse_config

    step = tmp_path / "checkpoint" / "step-2"
    step.mkdir(parents=True)
    (step / "model.safetensors.index.json").write_text("{}")  # what marks it complete
    monkeypatch.setenv("WORLD_SIZE", "1")  # the launch checks run
    with pytest.raises(ValueError, match="holds only the model, as Hugging Face safetensors") as e:
        parse_config(["--job.config_file", "train_configs/debug_cola.toml",
                      "--checkpoint.enable", "--job.dump_folder", str(tmp_path)])  # fmt: skip
    assert (
        f"--checkpoint.initial_load_path {step} --checkpoint.initial_load_in_hf and a new"
        in str(e.value)
    )


def test_hf_checkpoint_options_refused_before_training():
    from boost_titan.checkpoint.hf.adapters import adapter_for
    from boost_titan.train.config_check import parse_config

    base = ["--job.config_file", "train_configs/debug_cola.toml", "--checkpoint.enable"]
    with pytest.raises(ValueError, match="last_save_model_only = False but last_save_in_hf"):
        parse_config(
            [*base, "--checkpoint.last_save_in_hf", "--checkpoint.no-last-save-model-only"]
        )
    with pytest.raises(ValueError, match="initial_load_model_only = False but initial_load_in"):
        parse_config(
            [*base, "--checkpoint.initial_load_in_hf", "--checkpoint.no-initial-load-model-only"]
        )
    # a layout that cannot hold the model: refused when the config is parsed, only when
    # the run saves or loads HF
    gqa = [*base, "--model.flavor", "debugmodel_gqa"]
    parse_config(gqa)
    for key, extra in (
        ("last_save_in_hf", "--checkpoint.last_save_model_only"),
        ("initial_load_in_hf", "--checkpoint.initial_load_model_only"),
    ):
        with pytest.raises(ValueError) as e:
            parse_config([*gqa, f"--checkpoint.{key}", extra])
        assert str(e.value).startswith(
            f"[checkpoint] {key} = True but cola_llama2's Hugging Face layout 'cola' cannot "
            "hold this model: the CoLA authors' model cannot hold this cola_llama2: grouped-query "
            "attention (n_kv_heads 4 < n_heads 8"
        ), str(e.value)
        assert "export --format hf --hf-layout boost" in str(e.value)
    assert adapter_for("llama2").layout == "llama" and adapter_for("cola_llama2").layout == "cola"
    assert adapter_for("svd_llama2").layout == adapter_for("lax_llama2").layout == "boost"
