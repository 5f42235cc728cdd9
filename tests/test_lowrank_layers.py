"""Low-rank layers against references written here with plain tensor ops.

Every reference below is an independent re-implementation (matmuls, softmax with a causal
mask, RMSNorm / LayerNorm by formula, the Kronecker gate as a dense ``torch.kron``
matrix). Only RoPE is borrowed from torchtitan (``apply_rotary_emb`` and the model's
``freqs_cis``): it is not what is under test. The models' parameters are read by name and
copied into leaf tensors, so reference gradients come from autograd on the reference.
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from torchtitan.models.llama3.model.model import apply_rotary_emb

from boost_titan.config import Boost, validate_boost_config
from boost_titan.models import LlamaArgs, flavors_for
from boost_titan.models.bottleneck import Bottleneck, KroneckerGate, LatentCross
from boost_titan.models.model import Transformer

TOL = 1e-5
PROJ_ORDER = ("wq", "wk", "wv", "wo", "w1", "w3", "w2")  # q k v o gate up down
ATTN = ("wq", "wk", "wv", "wo")


def assert_rel_close(
    actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL, what: str = ""
):
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    err = (actual.double() - expected.double()).norm() / expected.double().norm().clamp_min(1e-30)
    assert err < tol, f"{what}: relative error {err:.3e} >= {tol:.0e}"
    # and element-wise, relative to the tensor's scale
    scale = expected.abs().max().item()
    assert (actual - expected).abs().max().item() <= 10 * tol * scale + 1e-12, what


# ----------------------------------------------------------------------------- references
def ref_act(z, act):
    return z * torch.sigmoid(z) if act == "silu" else z


def ref_rmsnorm(x, g, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * g


def ref_layernorm(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = (x - mu).pow(2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def kron_matrix(g1, g0):
    """Dense matrix of h -> flatten(G1^T unflatten(h) G0) for row-major flatten."""
    return torch.kron(g1.t(), g0.t())


def ref_gate(h, P, prefix, gate):
    if gate == "dense":
        return h @ P[prefix + "gate.weight"].t()
    M = kron_matrix(P[prefix + "gate.g1"], P[prefix + "gate.g0"])
    return h @ M.t()


def ref_causal_attention(q, k, v, n_heads, n_kv, head_dim, freqs_cis):
    b, s, _ = q.shape
    q = q.reshape(b, s, n_heads, head_dim)
    k = k.reshape(b, s, n_kv, head_dim)
    v = v.reshape(b, s, n_kv, head_dim)
    q, k = apply_rotary_emb(q, k, freqs_cis=freqs_cis)
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, h, s, hd]
    rep = n_heads // n_kv  # query head i reads kv head i // rep
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(head_dim)
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    scores = scores.masked_fill(mask, float("-inf"))
    out = torch.softmax(scores, -1) @ v
    return out.transpose(1, 2).reshape(b, s, n_heads * head_dim)


def ref_block(x, P, pre, a: LlamaArgs, freqs_cis, prev=None, gate=None):
    """One bottleneck LLaMA block. ``prev``: previous block's latents (LaX crossing)
    by projection name, or None. Returns (output, {name: latent after act})."""
    act = a.latent_act if a.latent_act != "default" else ("none" if a.arch == "svd" else "silu")
    n_kv = a.n_kv_heads or a.n_heads
    lat = {}

    def proj(name, inp):
        full = pre + ("attention." if name in ATTN else "feed_forward.") + name + "."
        z = inp @ P[full + "down.weight"].t()
        if prev is not None:
            cp = full + "cross."
            z = ref_layernorm(
                z + ref_gate(prev[name], P, cp, gate),
                P[cp + "norm.weight"],
                P[cp + "norm.bias"],
                a.lax_norm_eps,
            )
        z = ref_act(z, act)
        lat[name] = z
        return z @ P[full + "up.weight"].t()

    xn = ref_rmsnorm(x, P[pre + "attention_norm.weight"], a.norm_eps)
    q, k, v = proj("wq", xn), proj("wk", xn), proj("wv", xn)
    o = ref_causal_attention(q, k, v, a.n_heads, n_kv, a.dim // a.n_heads, freqs_cis)
    h = x + proj("wo", o)
    hn = ref_rmsnorm(h, P[pre + "ffn_norm.weight"], a.norm_eps)
    gate_, up = proj("w1", hn), proj("w3", hn)
    mid = (ref_act(gate_, "silu") if a.swiglu else gate_) * up
    out = h + proj("w2", mid)
    return out, lat


def ref_transformer(tokens, P, a: LlamaArgs, freqs_cis):
    h = P["tok_embeddings.weight"][tokens]
    prev = None
    for i in range(a.n_layers):
        lax_cross = a.arch == "lax" and i > 0
        h, lat = ref_block(
            h, P, f"layers.{i}.", a, freqs_cis, prev=prev if lax_cross else None, gate=a.lax_gate
        )
        prev = lat
    h = ref_rmsnorm(h, P["norm.weight"], a.norm_eps)
    return h @ P["output.weight"].t()


# ----------------------------------------------------------------------------- helpers
def small_args(arch="cola", n_kv_heads=None, **kw) -> LlamaArgs:
    base = dict(
        dim=64,
        n_layers=1,
        n_heads=4,
        n_kv_heads=n_kv_heads,
        vocab_size=97,
        ffn_dim=96,
        rank=24,
        max_seq_len=32,
        norm_eps=1e-6,
        arch=arch,
    )
    base.update(kw)
    return LlamaArgs(**base)


def build(args: LlamaArgs, seed=0) -> Transformer:
    torch.manual_seed(seed)
    m = Transformer(args)
    with torch.no_grad():  # as torchtitan's Trainer calls it
        m.init_weights()
    # Randomise the norms' affine parameters (init leaves them at 1 / 0) so the
    # references prove they are used, and LaX's gates/norms at a visible scale.
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("norm.bias"):
                p.copy_(0.3 * torch.randn_like(p))
    return m


def leaf_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone().requires_grad_(True) for n, p in model.named_parameters()}


def ref_grads(P, loss):
    names = list(P)
    grads = torch.autograd.grad(loss, [P[n] for n in names], allow_unused=True)
    return dict(zip(names, grads))


# ----------------------------------------------------------------------------- Bottleneck
@pytest.mark.parametrize("act", ["silu", "none"])
@pytest.mark.parametrize("din,dout,r", [(48, 80, 16), (80, 48, 7)])
def test_bottleneck_matches_matmuls(act, din, dout, r):
    torch.manual_seed(1)
    layer = Bottleneck(din, dout, r, act)
    layer.init_weights()
    x = torch.randn(3, 5, din, requires_grad=True)
    y = layer(x)
    A, B = layer.down.weight.detach(), layer.up.weight.detach()
    assert A.shape == (r, din) and B.shape == (dout, r)
    z = x.detach() @ A.t()
    expected = ref_act(z, act) @ B.t()
    assert_rel_close(y.detach(), expected, what="B act(A x)")
    if act == "silu":  # the activation really is there: not equal to the linear B A x
        assert (y.detach() - z @ B.t()).abs().max() > 1e-3


def test_bottleneck_with_crossing_matches_reference():
    torch.manual_seed(2)
    r = 12
    for gate in ("dense", "kron"):
        layer = Bottleneck(40, 56, r, "silu", LatentCross(r, gate, 1e-6))
        layer.init_weights()
        with torch.no_grad():
            layer.cross.norm.weight.normal_(1, 0.3)
            layer.cross.norm.bias.normal_(0, 0.3)
        x, prev = torch.randn(2, 5, 40), torch.randn(2, 5, r)
        P = {n: p.detach() for n, p in layer.named_parameters()}
        z = ref_layernorm(
            x @ P["down.weight"].t() + ref_gate(prev, P, "cross.", gate),
            P["cross.norm.weight"],
            P["cross.norm.bias"],
            1e-6,
        )
        expected = ref_act(z, "silu") @ P["up.weight"].t()
        assert_rel_close(layer(x, prev).detach(), expected, what=f"crossing {gate}")


# ----------------------------------------------------------------------------- Kronecker gate
@pytest.mark.parametrize("r", [64, 24, 12, 2048])
def test_kronecker_gate_is_dense_kron_matrix(r):
    torch.manual_seed(3)
    gate = KroneckerGate(r)
    gate.init_weights()
    # expected factorisation: a = largest divisor of r <= sqrt(r)
    a = max(d for d in range(1, math.isqrt(r) + 1) if r % d == 0)
    assert (gate.g1.shape, gate.g0.shape) == ((a, a), (r // a, r // a))
    h = torch.randn(3, 4, r)
    M = kron_matrix(gate.g1.detach(), gate.g0.detach())
    assert M.shape == (r, r)
    assert_rel_close(gate(h).detach(), h @ M.t(), what="kron gate")
    if a != r // a:  # the transposed ordering (G0 x G1) is really different
        wrong = torch.kron(gate.g0.detach().t(), gate.g1.detach().t())
        assert (gate(h).detach() - h @ wrong.t()).abs().max() > 1e-3


# ----------------------------------------------------------------------------- LowRankBlock
@pytest.mark.parametrize("arch", ["svd", "cola"])
@pytest.mark.parametrize("swiglu", [True, False])
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_lowrank_block_matches_reference(arch, swiglu, n_kv_heads):
    outs, grads = {}, {}
    torch.manual_seed(10)
    x0 = torch.randn(2, 11, 64)
    w_out = torch.randn(2, 11, 64)
    for grouped in (True, False):
        a = small_args(arch, n_kv_heads, swiglu=swiglu, group_linears=grouped)
        if n_kv_heads:  # GQA: k/v rank defaults to min(rank, kv_dim // 2) = 16 != 24
            assert a.effective_kv_rank == 16
        m = build(a, seed=4)  # same seed: same weights in both modes
        block = m.layers["0"]
        x = x0.clone().requires_grad_(True)
        y = block(x, m.freqs_cis)
        (y * w_out).sum().backward()
        outs[grouped] = y.detach()
        grads[grouped] = {n: p.grad.clone() for n, p in block.named_parameters()}
        grads[grouped]["<input>"] = x.grad.clone()

        # the reference, on copies of this block's weights
        P = {n: p.detach().clone().requires_grad_(True) for n, p in block.named_parameters()}
        xr = x0.clone().requires_grad_(True)
        yr, _ = ref_block(xr, P, "", a, m.freqs_cis)
        assert_rel_close(y.detach(), yr.detach(), what=f"block forward grouped={grouped}")
        g = ref_grads(P | {"<input>": xr}, (yr * w_out).sum())
        assert set(g) == set(grads[grouped])
        for n, gr in g.items():
            assert gr is not None, n
            assert_rel_close(grads[grouped][n], gr, tol=3e-5, what=f"grad {n} grouped={grouped}")

    assert_rel_close(outs[True], outs[False], what="grouped vs ungrouped forward")
    for n in grads[True]:
        assert_rel_close(
            grads[True][n], grads[False][n], tol=3e-5, what=f"grouped vs ungrouped grad {n}"
        )


def test_block_parameters_do_not_depend_on_grouping():
    sd = {
        g: build(small_args("cola", 2, group_linears=g), seed=5).state_dict() for g in (True, False)
    }
    assert list(sd[True]) == list(sd[False])
    for k in sd[True]:
        assert torch.equal(sd[True][k], sd[False][k]), k


@pytest.mark.parametrize("arch", ["dense", "svd", "cola", "lax"])
def test_raw_gradients_have_their_parameters_layout(arch):
    """Gradients as autograd computes them (before AccumulateGrad copies them into the
    parameter's layout) are contiguous, grouped B's included: zero-bubble pipeline
    schedules assign them to ``.grad`` as they come, and CPU fused AdamW misreads a
    non-contiguous one (CoLA/LaX trained wrong from step 2)."""
    a = small_args(arch, 2, n_layers=2, group_linears=True)
    m = build(a, seed=6)
    params = dict(m.named_parameters())
    loss = m(torch.randint(0, a.vocab_size, (2, 13))).float().pow(2).mean()
    grads = torch.autograd.grad(loss, list(params.values()))
    bad = [n for (n, p), g in zip(params.items(), grads) if g.stride() != p.stride()]
    assert not bad, bad


@pytest.mark.parametrize("arch", ["svd", "cola"])
def test_transformer_matches_reference(arch):
    a = small_args(arch, 2, n_layers=2)
    m = build(a, seed=6)
    tokens = torch.randint(0, a.vocab_size, (2, 13))
    P = {n: p.detach() for n, p in m.named_parameters()}
    assert_rel_close(m(tokens).detach(), ref_transformer(tokens, P, a, m.freqs_cis), what="logits")


@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
def test_dense_and_lowrank_blocks_run_the_same_attention_kernel_path(monkeypatch, n_kv_heads):
    """Every block, dense or low-rank, calls torchtitan's SDPA wrapper (its backend
    priority: cuDNN, Flash, math) once per forward with the same GQA flag, so a CoLA-vs-
    dense ratio on a GPU compares architectures, not attention kernels."""
    from torchtitan.models.attention import ScaledDotProductAttentionWrapper

    calls = []
    wrapped = ScaledDotProductAttentionWrapper.forward

    def spy(self, q, k, v, **kw):
        calls.append((q.shape[1], k.shape[1], kw.get("enable_gqa")))
        return wrapped(self, q, k, v, **kw)

    monkeypatch.setattr(ScaledDotProductAttentionWrapper, "forward", spy)
    seen = {}
    for arch in ("dense", "cola", "lax"):
        a = small_args(arch, n_kv_heads, n_layers=2)
        calls.clear()
        build(a, seed=6)(torch.randint(0, a.vocab_size, (2, 13)))
        assert len(calls) == a.n_layers, arch
        seen[arch] = set(calls)
    assert seen["dense"] == seen["cola"] == seen["lax"]
    heads, kv, gqa = next(iter(seen["dense"]))
    assert gqa == (n_kv_heads is not None) and kv == (n_kv_heads or heads)


# ----------------------------------------------------------------------------- LaX
@pytest.mark.parametrize("gate", ["dense", "kron"])
@pytest.mark.parametrize("n_kv_heads", [None, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("act", ["default", "none"], ids=["lax", "lax_svd"])
def test_lax_two_blocks_match_unrolled_reference(gate, n_kv_heads, act):
    a = small_args("lax", n_kv_heads, n_layers=2, lax_gate=gate, latent_act=act)
    m = build(a, seed=7)
    # block 0 has no crossing, gate or norm; block 1 has one per projection
    names0 = {n for n, _ in m.layers["0"].named_parameters()}
    names1 = {n for n, _ in m.layers["1"].named_parameters()}
    assert not any(".cross." in n for n in names0)
    assert sum(n.endswith(".cross.norm.weight") for n in names1) == 7
    r_kv = 16 if n_kv_heads else 24  # GQA: min(rank 24, kv_dim 32 // 2)
    widths = [24] + [r_kv] * 2 + [24] * 4

    torch.manual_seed(11)
    x = torch.randn(2, 9, a.dim)
    P = {n: p.detach() for n, p in m.named_parameters()}
    fc = m.freqs_cis

    # block 0: hidden state plus its latents; the "previous latents" it receives are unused
    junk = torch.randn(2, 9, sum(widths))
    out0 = m.layers["0"](torch.cat([x, junk], -1), fc).detach()
    y0, lat0 = ref_block(x, P, "layers.0.", a, fc)
    h0, *z0 = out0.split([a.dim] + widths, -1)
    assert_rel_close(h0, y0, what="block 0 hidden")
    for name, z in zip(PROJ_ORDER, z0):
        assert_rel_close(z, lat0[name], what=f"block 0 latent {name}")

    # block 1 crosses in block 0's latents of the same projection type
    out1 = m.layers["1"](out0, fc).detach()
    y1, lat1 = ref_block(y0, P, "layers.1.", a, fc, prev=lat0, gate=gate)
    h1, *z1 = out1.split([a.dim] + widths, -1)
    assert_rel_close(h1, y1, what="block 1 hidden")
    for name, z in zip(PROJ_ORDER, z1):
        assert_rel_close(z, lat1[name], what=f"block 1 latent {name}")
    # the crossing matters: without it block 1 computes something else
    y1_nocross, _ = ref_block(y0, P, "layers.1.", a, fc)
    assert (y1_nocross - y1).abs().max() > 1e-3


@pytest.mark.parametrize("gate", ["dense", "kron"])
@pytest.mark.parametrize("grouped", [True, False])
def test_lax_transformer_logits_and_grads_match_reference(gate, grouped):
    a = small_args("lax", 2, n_layers=3, lax_gate=gate, group_linears=grouped)
    m = build(a, seed=8)
    tokens = torch.randint(0, a.vocab_size, (2, 10))
    logits = m(tokens)
    w = torch.randn_like(logits)
    (logits * w).sum().backward()
    P = leaf_params(m)
    ref = ref_transformer(tokens, P, a, m.freqs_cis)
    assert_rel_close(logits.detach(), ref.detach(), what="LaX logits")
    g = ref_grads(P, (ref * w).sum())
    for n, p in m.named_parameters():
        assert g[n] is not None, n
        assert_rel_close(p.grad, g[n], tol=3e-5, what=f"LaX grad {n}")


# ----------------------------------------------------------------------------- init statistics
def test_cola_init_statistics():
    din = dout = 2048
    r = 512
    torch.manual_seed(12)
    layer = Bottleneck(din, dout, r, "silu")
    layer.init_weights()
    A, B = layer.down.weight.detach().double(), layer.up.weight.detach().double()
    std = r**-0.25 * (din + dout) ** -0.25
    assert abs(A.std().item() / std - 1) < 0.01
    assert abs(B.std().item() / std - 1) < 0.01
    assert abs(A.mean().item()) < 0.01 * std and abs(B.mean().item()) < 0.01 * std
    W = B @ A  # the effective dense weight, [out, in]
    assert W.shape == (dout, din)
    assert abs(W.var().item() * (din + dout) - 1) < 0.05


def test_cola_init_statistics_rectangular():
    din, dout, r = 1024, 2752, 256
    torch.manual_seed(13)
    layer = Bottleneck(din, dout, r, "silu")
    layer.init_weights()
    W = layer.up.weight.detach().double() @ layer.down.weight.detach().double()
    assert abs(W.var().item() * (din + dout) - 1) < 0.05


# ----------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("rank", [0, -3, 65])
def test_bad_rank_raises(rank):
    a = small_args("cola", rank=rank)  # min(in, out) over the projections is 64
    with pytest.raises(ValueError, match=rf"rank {rank}\b"):
        a.validate()
    with pytest.raises(ValueError, match=rf"rank {rank}\b"):
        Transformer(small_args("cola", rank=rank))


def test_bad_kv_rank_raises():
    a = small_args("svd", 2, kv_rank=33)  # kv_dim = 32
    with pytest.raises(ValueError, match=r"rank 33\b.*wk"):
        a.validate()


def test_kron_gate_prime_rank_raises():
    a = small_args("lax", rank=61, lax_gate="kron")
    with pytest.raises(ValueError, match=r"61"):
        a.validate()
    small_args("lax", rank=61, lax_gate="dense").validate()  # dense gate: any rank is fine


def test_unknown_architecture_raises():
    for call in (lambda: small_args("lora").validate(), lambda: flavors_for("lora")):
        with pytest.raises(ValueError, match="lora") as e:
            call()
        for valid in ("dense", "svd", "cola", "lax"):
            assert valid in str(e.value)


@pytest.mark.parametrize(
    "field,value,valid",
    [
        ("tp_plan", "megatron", ["auto", "fullrank", "btp", "vanilla"]),
        ("rmsnorm", "fast", ["online", "sync"]),
        ("lax_gate", "lowrank", ["kron", "dense"]),
        ("latent_act", "relu", ["default", "silu", "none"]),
    ],
)
def test_bad_boost_choice_raises_with_valid_choices(field, value, valid):
    with pytest.raises(ValueError, match=value) as e:
        validate_boost_config(Boost(**{field: value}))
    for v in valid:
        assert repr(v) in str(e.value) or v in str(e.value)


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"rank": -1}, "rank"),
        ({"kv_rank": -2}, "kv_rank"),
        ({"rank_ratio": 1.5}, "rank_ratio"),
        ({"rank_ratio": -0.1}, "rank_ratio"),
        ({"rank": 32, "rank_ratio": 0.25}, "rank"),
        ({"rope_theta": -1.0}, r"rope_theta = -1.0 must be a finite number > 0"),
        ({"rope_theta": float("nan")}, "rope_theta = nan"),
        ({"rope_theta": float("inf")}, "rope_theta = inf"),
    ],
)
def test_bad_boost_numbers_raise(kw, match):
    with pytest.raises(ValueError, match=match):
        validate_boost_config(Boost(**kw))


def fake_job(boost: Boost | None, seq_len=48, hf_assets_path="") -> SimpleNamespace:
    return SimpleNamespace(
        training=SimpleNamespace(seq_len=seq_len),
        model=SimpleNamespace(hf_assets_path=hf_assets_path),
        boost=boost,
    )


def test_update_from_config_overrides():
    a = small_args("cola", 2)
    a.update_from_config(
        fake_job(
            Boost(rank=32, kv_rank=8, lax_gate="dense", group_linears=False, latent_act="none")
        )
    )
    assert (a.max_seq_len, a.rank, a.kv_rank, a.effective_kv_rank) == (48, 32, 8, 8)
    assert (a.lax_gate, a.group_linears, a.activation) == ("dense", False, "none")
    assert a.rope_theta == 10000.0  # 0: the flavor's
    m = Transformer(a)
    assert m.layers["0"].attention.wq.down.weight.shape == (32, 64)
    assert m.layers["0"].attention.wk.down.weight.shape == (8, 64)

    b = small_args("svd")
    b.update_from_config(fake_job(Boost(rank_ratio=0.25)))
    assert b.rank == 16 and b.effective_kv_rank == 16  # round(0.25 * 64), MHA

    c = small_args("lax", 2)
    c.update_from_config(fake_job(Boost()))  # defaults: flavor's rank kept
    assert (c.rank, c.effective_kv_rank, c.max_seq_len) == (24, 16, 48)

    d = LlamaArgs(dim=64, n_heads=4, ffn_dim=96, vocab_size=97)  # dense ignores ranks
    d.update_from_config(fake_job(Boost(rank=32, rope_theta=500000.0)))
    assert d.rank == 0 and d.arch == "dense" and d.rope_theta == 500000.0
    # the table the model rotates with is the new base's: position 1's slowest pair
    # turns by 500000^(-(hd - 2) / hd) radians
    angle = torch.angle(Transformer(d)._precompute_freqs_cis()[1, -1]).item()
    assert angle == pytest.approx(500000.0 ** (-(16 - 2) / 16), rel=1e-5)

    e = small_args("cola")
    e.update_from_config(fake_job(None))  # no [boost] section at all
    assert e.rank == 24 and e.max_seq_len == 48


def test_rope_table_covers_longer_validation_sequences():
    """Validation may run longer sequences than training (the debug configs: 256 vs a
    user's --training.seq_len 128): the RoPE table covers both, and its first positions
    are the ones a training-length table holds (so training numerics do not change)."""
    job = fake_job(Boost(), seq_len=16)
    short = small_args("cola")
    short.update_from_config(job)
    job.validation = SimpleNamespace(enable=True, seq_len=40)
    long = small_args("cola")
    long.update_from_config(job)
    assert (short.max_seq_len, long.max_seq_len) == (16, 40)
    tokens = torch.randint(0, long.vocab_size, (1, 40))
    model = build(long, seed=3)
    model(tokens)  # a validation-length batch runs (it used to hit an AssertionError)
    table = Transformer(short).freqs_cis
    assert torch.equal(model.freqs_cis[:16], table)
    job.validation.enable = False
    off = small_args("cola")
    off.update_from_config(job)
    assert off.max_seq_len == 16


def test_update_from_config_rejects_bad_values():
    with pytest.raises(ValueError, match="rank 65"):
        small_args("cola").update_from_config(fake_job(Boost(rank=65)))
    with pytest.raises(ValueError, match="lax_gate"):
        small_args("lax").update_from_config(fake_job(Boost(lax_gate="full")))
    with pytest.raises(ValueError, match="61"):
        small_args("lax").update_from_config(fake_job(Boost(rank=61)))


def test_update_from_config_checks_tokenizer_vocab(tmp_path):
    tok = {
        "model": {"vocab": {f"t{i}": i for i in range(100)}},
        "added_tokens": [{"id": 120, "content": "<eos>"}],
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="121"):
        small_args("cola", vocab_size=97).update_from_config(
            fake_job(Boost(), hf_assets_path=str(tmp_path))
        )
    small_args("cola", vocab_size=121).update_from_config(
        fake_job(Boost(), hf_assets_path=str(tmp_path))
    )
