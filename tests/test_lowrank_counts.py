"""Parameter and FLOP counts of every flavor against closed forms written here.

Models are built on the meta device (no memory). The closed forms are derived from the
shapes alone: every low-rank projection in -> out of rank r holds r * (in + out)
parameters; GQA k/v use kv rank min(r, kv_dim // 2); LaX blocks >= 1 add, per
projection, a gate (dense r*r, or Kronecker a^2 + b^2 with r = a*b, a the largest
divisor <= sqrt(r)) and an r-LayerNorm (2r); embeddings and LM head are untied (V*d
each); RMSNorms d each.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from boost_titan.models import FLAVORS, flavors_for
from boost_titan.models.model import Transformer

ARCHS = ("svd", "cola", "lax")

# LLaMA-2 / CoLA shapes from the paper (design doc section 1): layers, d, heads, kv, f, r, V
PAPER_SHAPES = {
    "60m": (8, 512, 8, 8, 1376, 128, 32000),
    "130m": (12, 768, 12, 12, 2048, 256, 32000),
    "350m": (24, 1024, 16, 16, 2736, 256, 32000),
    "1b": (24, 2048, 32, 32, 5472, 512, 32000),
    "3b": (28, 3072, 24, 24, 8192, 768, 32000),
    "7b": (32, 4096, 32, 32, 11008, 1024, 32000),
    "13b": (40, 5120, 40, 40, 13824, 1280, 32000),
    "30b": (36, 8192, 64, 64, 22016, 2048, 32000),
    "34b": (48, 8192, 64, 8, 22016, 2048, 32000),
}
# paper, tied embeddings, billions (2 decimals): dense, CoLA
PAPER_PARAMS_B = {
    "1b": (1.28, 0.54),
    "3b": (3.27, 1.35),
    "7b": (6.61, 2.69),
    "13b": (12.85, 5.17),
    "30b": (29.40, 11.78),
}


def kron_ab(r: int) -> tuple[int, int]:
    a = max(x for x in range(1, math.isqrt(r) + 1) if r % x == 0)
    return a, r // a


def shapes(a):
    """(in, out, rank) of q, k, v, o, gate, up, down, derived here."""
    d, f, h = a.dim, a.ffn_dim, a.n_heads
    kv = a.n_kv_heads or h
    hd = d // h
    kv_dim = kv * hd
    r = a.rank
    if a.kv_rank:
        rkv = a.kv_rank
    else:
        rkv = r if kv == h else min(r, kv_dim // 2)
    return [
        (d, d, r),
        (d, kv_dim, rkv),
        (d, kv_dim, rkv),
        (d, d, r),
        (d, f, r),
        (d, f, r),
        (f, d, r),
    ]


def gate_params(r, kind):
    if kind == "dense":
        return r * r
    a, b = kron_ab(r)
    return a * a + b * b


def gate_macs(r, kind):
    if kind == "dense":
        return r * r
    a, b = kron_ab(r)
    return r * (a + b)  # G1^T H: a*a*b MACs, then (.) G0: a*b*b


def expected_params(a, arch) -> int:
    d, V, L = a.dim, a.vocab_size, a.n_layers
    n = 2 * V * d + d  # embedding, LM head (untied), final norm
    per_block = 2 * d  # attention_norm, ffn_norm
    for din, dout, r in shapes(a):
        per_block += din * dout if arch == "dense" else r * (din + dout)
    n += L * per_block
    if arch == "lax":
        n += (L - 1) * sum(gate_params(r, a.lax_gate) + 2 * r for _, _, r in shapes(a))
    return n


def expected_flops(a, arch, seq) -> int:
    d, V, L = a.dim, a.vocab_size, a.n_layers
    macs = d * V
    for din, dout, r in shapes(a):
        macs += L * (din * dout if arch == "dense" else r * (din + dout))
    if arch == "lax":
        macs += (L - 1) * sum(gate_macs(r, a.lax_gate) for _, _, r in shapes(a))
    hd = d // a.n_heads
    return 6 * macs + 12 * L * a.n_heads * hd * seq


_MODELS: dict[str, Transformer] = {}


def meta_model(a) -> Transformer:
    """Meta-device model (cached per args: building the large flavors takes a while)."""
    key = repr(a)
    if key not in _MODELS:
        with torch.device("meta"):
            _MODELS[key] = Transformer(a)
    return _MODELS[key]


def nparams(m) -> int:
    return sum(p.numel() for p in m.parameters())


CASES = [(arch, name) for arch in ("dense",) + ARCHS for name in FLAVORS]


def test_every_architecture_has_every_flavor():
    for arch in ("dense",) + ARCHS:
        assert set(flavors_for(arch)) == set(FLAVORS)
    assert set(PAPER_SHAPES) <= set(FLAVORS)
    assert {"debugmodel", "debugmodel_gqa"} <= set(FLAVORS)


@pytest.mark.parametrize("arch,name", CASES)
def test_flavor_shapes_follow_the_paper(arch, name):
    a = flavors_for(arch)[name]
    assert a.arch == arch
    if name in PAPER_SHAPES:
        L, d, h, kv, f, r, V = PAPER_SHAPES[name]
        assert (
            a.n_layers,
            a.dim,
            a.n_heads,
            a.n_kv_heads or a.n_heads,
            a.ffn_dim,
            a.vocab_size,
        ) == (L, d, h, kv, f, V)
        assert a.rope_theta == 10000.0
        if arch != "dense":
            assert a.rank == r
    if arch == "cola":  # outer SiLU kept at 60M/130M (and the debug models) only
        assert a.swiglu == (name in ("debugmodel", "debugmodel_gqa", "60m", "130m"))
    if arch in ("svd", "lax"):
        assert a.swiglu


@pytest.mark.parametrize("arch,name", CASES)
def test_params_and_flops_closed_form(arch, name):
    a = flavors_for(arch)[name]
    m = meta_model(a)
    assert nparams(m) == expected_params(a, arch), (arch, name)
    for seq in (256, 4096):
        n, flops = a.get_nparams_and_flops(m, seq)
        assert n == nparams(m)
        assert flops == expected_flops(a, arch, seq), (arch, name, seq)


@pytest.mark.parametrize("name", ["debugmodel", "debugmodel_gqa", "1b", "34b"])
def test_lax_dense_gate_counts(name):
    a = replace(flavors_for("lax")[name], lax_gate="dense")
    m = meta_model(a)
    assert nparams(m) == expected_params(a, "lax")
    assert a.flops_per_token(2048) == expected_flops(a, "lax", 2048)
    # dense gates are bigger than Kronecker ones
    k = flavors_for("lax")[name]
    assert nparams(m) > nparams(meta_model(k))


@pytest.mark.parametrize("name,kv_dim,r_kv", [("debugmodel_gqa", 128, 64), ("34b", 1024, 512)])
def test_gqa_kv_rank(name, kv_dim, r_kv):
    """GQA k/v rank = min(r, kv_dim // 2): debug 4 kv heads x 32 -> 64; 34b 8 x 128 -> 512."""
    for arch in ARCHS:
        a = flavors_for(arch)[name]
        m = meta_model(a)
        for p in ("wk", "wv"):
            proj = getattr(m.layers["1"].attention, p)
            assert proj.down.weight.shape == (r_kv, a.dim)
            assert proj.up.weight.shape == (kv_dim, r_kv)
        assert m.layers["1"].attention.wq.down.weight.shape == (a.rank, a.dim)


def test_paper_7b_cola_params():
    a = flavors_for("cola")["7b"]
    n = nparams(meta_model(a))
    assert n - a.vocab_size * a.dim == 2_689_863_680


@pytest.mark.parametrize("name", sorted(PAPER_PARAMS_B))
def test_paper_param_table(name):
    dense_b, cola_b = PAPER_PARAMS_B[name]
    for arch, want in (("dense", dense_b), ("cola", cola_b)):
        a = flavors_for(arch)[name]
        tied = nparams(meta_model(a)) - a.vocab_size * a.dim
        assert round(tied / 1e9, 2) == pytest.approx(want), (arch, name, tied)


def test_print_param_table():
    rows = []
    header = f"{'flavor':>6} | " + " | ".join(f"{x:>15}" for x in ("dense", "svd", "cola", "lax"))
    rows.append("parameters (untied embeddings; tied = minus V*d)")
    rows.append(header)
    rows.append("-" * len(header))
    for name in ("1b", "7b", "30b"):
        cells = []
        for arch in ("dense", "svd", "cola", "lax"):
            a = flavors_for(arch)[name]
            n = nparams(meta_model(a))
            assert n == expected_params(a, arch)
            cells.append(f"{n:>15,}")
        rows.append(f"{name:>6} | " + " | ".join(cells))
    print("\n" + "\n".join(rows))
