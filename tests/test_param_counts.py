"""Parameter and FLOP counts of the dense LLaMA-2 flavors against closed forms.

Every model is built on the meta device (no memory); the reference numbers are
computed here from the flavor's shapes alone, never from the model.
"""

from __future__ import annotations

import pytest
import torch

from boost_titan.models.flavors import flavors_for
from boost_titan.models.model import Transformer

DENSE = flavors_for("dense")
SEQ_LEN = 4096

# /work/shared/design/boost.md: size -> (d, f, layers, heads, dense params with tied
# embeddings in billions, as printed there)
PAPER_SIZES = {
    "1b": (2048, 5472, 24, 32, 1.28),
    "3b": (3072, 8192, 28, 24, 3.27),
    "7b": (4096, 11008, 32, 32, 6.61),
    "13b": (5120, 13824, 40, 40, 12.85),
    "30b": (8192, 22016, 36, 64, 29.40),
}
# CoLA's own small sizes: size -> (d, f, layers, heads)
COLA_SIZES = {
    "60m": (512, 1376, 8, 8),
    "130m": (768, 2048, 12, 12),
    "350m": (1024, 2736, 24, 16),
}


def _shapes(a):
    d, f, L, V = a.dim, a.ffn_dim, a.n_layers, a.vocab_size
    h = a.n_heads
    kv = a.n_kv_heads if a.n_kv_heads is not None else h
    hd = d // h
    return d, f, L, V, h, kv, hd


def closed_form_params(a) -> int:
    d, f, L, V, h, kv, hd = _shapes(a)
    attention = d * (h * hd) + 2 * d * (kv * hd) + (h * hd) * d
    ffn = 3 * d * f
    norms = 2 * d
    return V * d + d * V + L * (attention + ffn + norms) + d


def closed_form_flops(a, seq_len: int) -> int:
    d, f, L, V, h, kv, hd = _shapes(a)
    gemm_weights = d * V + L * (d * (h * hd) + 2 * d * (kv * hd) + (h * hd) * d + 3 * d * f)
    return 6 * gemm_weights + 12 * L * h * hd * seq_len


def _meta_model(args):
    with torch.device("meta"):
        return Transformer(args)


def test_dense_flavor_table_is_not_empty():
    assert {"debugmodel", "60m", "130m", "350m", "1b", "3b", "7b", "13b", "30b", "34b"} <= set(
        DENSE
    )


@pytest.mark.parametrize("flavor", sorted(DENSE))
def test_params_and_flops_match_closed_form(flavor):
    args = DENSE[flavor]
    assert args.arch == "dense"
    model = _meta_model(args)
    assert all(p.is_meta for p in model.parameters())
    expected_params = closed_form_params(args)
    assert sum(p.numel() for p in model.parameters()) == expected_params
    for seq_len in (256, SEQ_LEN):
        nparams, flops = args.get_nparams_and_flops(model, seq_len)
        assert nparams == expected_params
        assert flops == closed_form_flops(args, seq_len)


def test_7b_dense_param_count_exact():
    args = DENSE["7b"]
    model = _meta_model(args)
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616
    assert args.get_nparams_and_flops(model, SEQ_LEN)[0] == 6_738_415_616


def test_7b_flops_per_token_literal():
    # 6 * 6,607,077,376 GEMM weights (all but embedding + norms) + 12*32*32*128*4096
    nparams, flops = DENSE["7b"].get_nparams_and_flops(_meta_model(DENSE["7b"]), 4096)
    gemm = 6_738_415_616 - 32000 * 4096 - (2 * 32 + 1) * 4096
    assert gemm == 6_607_077_376
    assert flops == 6 * gemm + 12 * 32 * 32 * 128 * 4096


def test_34b_is_gqa_with_8_kv_heads():
    a = DENSE["34b"]
    assert (a.n_layers, a.dim, a.n_heads, a.n_kv_heads, a.ffn_dim) == (48, 8192, 64, 8, 22016)
    model = _meta_model(a)
    attn = model.layers["0"].attention
    hd = 8192 // 64
    assert tuple(attn.wq.weight.shape) == (64 * hd, 8192)
    assert tuple(attn.wk.weight.shape) == (8 * hd, 8192)
    assert tuple(attn.wv.weight.shape) == (8 * hd, 8192)
    assert tuple(attn.wo.weight.shape) == (8192, 64 * hd)


@pytest.mark.parametrize("flavor", sorted(PAPER_SIZES))
def test_paper_flavor_shapes(flavor):
    d, f, layers, heads, tied_billions = PAPER_SIZES[flavor]
    a = DENSE[flavor]
    assert (a.dim, a.ffn_dim, a.n_layers, a.n_heads) == (d, f, layers, heads)
    assert a.n_kv_heads in (None, heads)  # MHA
    assert a.vocab_size == 32000
    # the paper counts tied embeddings: drop the LM head once
    tied = closed_form_params(a) - a.vocab_size * a.dim
    assert round(tied / 1e9, 2) == pytest.approx(tied_billions, abs=1e-9)


@pytest.mark.parametrize("flavor", sorted(COLA_SIZES))
def test_cola_small_flavor_shapes(flavor):
    d, f, layers, heads = COLA_SIZES[flavor]
    a = DENSE[flavor]
    assert (a.dim, a.ffn_dim, a.n_layers, a.n_heads) == (d, f, layers, heads)
    assert a.n_kv_heads in (None, heads)
    assert a.vocab_size == 32000


def test_llama2_rope_theta_and_no_biases():
    a = DENSE["7b"]
    assert a.rope_theta == 10000.0
    model = _meta_model(a)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
