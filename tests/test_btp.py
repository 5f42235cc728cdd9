"""BTP exactness, communication and Online-RMSNorm (simulated TP 2/4/8 in one process)."""

from __future__ import annotations

import pytest
import torch
from tp_sim import fake_world, lm_loss, max_rel_err, reference_model, run_parallel, small_args

from boost_titan.models.bottleneck import (
    SINGLE_DEVICE,
    Bottleneck,
    down_finish,
    down_partial,
    down_reduce,
)
from boost_titan.models.flavors import flavors_for
from boost_titan.observability.comm_stats import CommCounter
from boost_titan.tp_plans import apply_tp_plan, resolve_tp_plan, validate_tp_degree
from boost_titan.tp_plans.btp import apply_btp

GRAD_TOL = 2e-5


def _data(args, b=2, s=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, args.vocab_size, (b, s), generator=g)
    return tokens, labels


def _btp(norm_mode="online"):
    return lambda model, mesh: apply_btp(model, mesh, loss_parallel=False, norm_mode=norm_mode)


CASES = [
    # arch, flavor, tp, grouped, norm
    ("svd", "debugmodel", 2, True, "online"),
    ("cola", "debugmodel", 4, True, "online"),
    ("lax", "debugmodel", 8, True, "online"),
    ("cola", "debugmodel_gqa", 4, True, "online"),
    ("lax", "debugmodel_gqa", 2, False, "online"),
    ("svd", "debugmodel", 4, False, "sync"),
    ("cola", "debugmodel", 8, True, "sync"),
]


@pytest.mark.parametrize("arch,flavor,tp,grouped,norm", CASES)
def test_btp_matches_single_device(arch, flavor, tp, grouped, norm):
    args = small_args(flavors_for(arch)[flavor], group_linears=grouped)
    ref = reference_model(args)
    tokens, labels = _data(args)
    ref_loss = lm_loss(ref(tokens), labels)
    ref_loss.backward()

    loss, grads, _ = run_parallel(ref, tp, _btp(norm), tokens, labels)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for name, p in ref.named_parameters():
        assert max_rel_err(grads[name], p.grad) < GRAD_TOL, name


# ----------------------------------------------------------------------------- comms
def _expected_block(args, b, s, grouped, norm):
    """Closed form: element counts of one block's collectives, forward and backward,
    in issue order (fp32 -> 4 bytes each)."""
    r, rkv = args.rank, args.effective_kv_rank
    tok = b * s
    stats = 1 if norm == "online" else 0
    sync = [tok] if norm == "sync" else []
    # backward runs the block in reverse: B_down, B_gate/B_up, (ffn stats), B_o,
    # B_q/B_k/B_v, (attention stats)
    if grouped:
        fwd = (
            sync + [tok * (r + 2 * rkv + stats), tok * r] + sync + [tok * (2 * r + stats), tok * r]
        )
        bwd = [tok * r, tok * 2 * r] + sync + [tok * r, tok * (r + 2 * rkv)] + sync
    else:
        fwd = sync + [tok * (r + stats), tok * rkv, tok * rkv, tok * r]
        fwd += sync + [tok * (r + stats), tok * r, tok * r]
        bwd = [tok * r, tok * r, tok * r] + sync + [tok * r, tok * rkv, tok * rkv, tok * r] + sync
    return fwd, bwd


@pytest.mark.parametrize(
    "arch,flavor,tp,b,s,grouped,norm,rank",
    [
        ("cola", "debugmodel", 2, 2, 32, True, "online", 32),
        ("cola", "debugmodel", 4, 1, 16, True, "online", 16),
        ("svd", "debugmodel_gqa", 2, 2, 16, True, "online", 24),
        ("lax", "debugmodel", 2, 2, 16, False, "online", 36),
        ("cola", "debugmodel_gqa", 4, 1, 32, False, "online", 32),
        ("cola", "debugmodel", 2, 2, 16, True, "sync", 32),
        ("svd", "debugmodel", 4, 1, 16, False, "sync", 16),
    ],
)
def test_btp_collectives_match_closed_form(arch, flavor, tp, b, s, grouped, norm, rank):
    args = small_args(flavors_for(arch)[flavor], group_linears=grouped, rank=rank, max_seq_len=s)
    ref = reference_model(args)
    tokens, labels = _data(args, b, s)
    _, _, counter = run_parallel(ref, tp, _btp(norm), tokens, labels, counter_cls=CommCounter)
    fwd, bwd = _expected_block(args, b, s, grouped, norm)
    for layer in ("layers.0", "layers.1"):
        got_f = counter.block_records(layer, "forward")
        got_b = counter.block_records(layer, "backward")
        assert [r.op for r in got_f + got_b] == ["all_reduce"] * (len(fwd) + len(bwd)), layer
        assert [r.numel for r in got_f] == fwd, (layer, "forward")
        assert [r.numel for r in got_b] == bwd, (layer, "backward")
        assert sum(r.nbytes for r in got_f) == 4 * sum(fwd)
    # outside the stack: the final norm's all-gather of [b, s, d] and the replicated
    # LM head's gather of the logits (loss_parallel=False) forward; in backward the LM
    # head input's all-reduce. Nothing else.
    outside_f = [
        r for r in counter.records if r.phase == "forward" and ".layers." not in r.module + "."
    ]
    assert sorted((r.op, r.numel) for r in outside_f) == sorted(
        [
            ("all_gather_into_tensor", b * s * args.dim),
            ("all_gather_into_tensor", b * s * args.vocab_size),
        ]
    )
    outside_b = [
        r for r in counter.records if r.phase == "backward" and ".layers." not in r.module + "."
    ]
    assert [(r.op, r.numel) for r in outside_b] == [("all_reduce", b * s * args.dim)]


def test_btp_forward_is_four_all_reduces_per_block_at_paper_shape_ratio():
    """Grouped + online: 4 all-reduces per block forward, 7 b s r elements in all."""
    args = small_args(flavors_for("cola")["debugmodel"])
    fwd, bwd = _expected_block(args, 2, 32, True, "online")
    assert len(fwd) == 4 and len(bwd) == 4
    assert sum(fwd) == 2 * 32 * (7 * args.rank + 2)


# ----------------------------------------------------------------------------- Online-RMSNorm
@pytest.mark.parametrize("scale", [1e-12, 1e-3, 1.0, 1e3, 1e12])
@pytest.mark.parametrize("grouped", [True, False])
def test_online_rmsnorm_equals_rmsnorm_then_linear(scale, grouped):
    torch.manual_seed(0)
    d, r = 96, 24
    norm = torch.nn.RMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(d) + 0.5)
    projs = [Bottleneck(d, d, r, "none") for _ in range(3)]
    x = torch.randn(2, 5, d, dtype=torch.float64).float() * scale
    x[0, 0] *= 1e3  # one token far louder than the rest
    partials, stats = down_partial(x, projs, SINGLE_DEVICE, grouped, norm, d)
    partials, stats = down_reduce(partials, stats, SINGLE_DEVICE)
    latents = down_finish(partials, stats, projs, norm, d)
    # reference in float64: RMSNorm, then each A
    x64, g64 = x.double(), norm.weight.double()
    normed = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * g64
    for lat, p in zip(latents, projs):
        expect = normed @ p.down.weight.double().t()
        assert max_rel_err(lat.double(), expect) < 1e-5


@pytest.mark.parametrize("norm_mode", ["online", "sync"])
def test_online_rmsnorm_sharded_equals_full(norm_mode):
    """d sharded over 4 simulated ranks, extreme scales: equals the unsharded norm."""
    args = small_args(flavors_for("svd")["debugmodel"])
    ref = reference_model(args)
    tokens, labels = _data(args)
    with torch.no_grad():  # very loud and very quiet embeddings
        ref.tok_embeddings.weight[: args.vocab_size // 2] *= 1e6
        ref.tok_embeddings.weight[args.vocab_size // 2 :] *= 1e-6
    ref_loss = lm_loss(ref(tokens), labels)
    ref_loss.backward()
    loss, grads, _ = run_parallel(ref, 4, _btp(norm_mode), tokens, labels)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for name, p in ref.named_parameters():
        assert max_rel_err(grads[name], p.grad) < 1e-4, name


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_online_rmsnorm_statistics_keep_fp32_accuracy_in_a_bf16_latent(tp, sequence_parallel):
    """A bf16 latent carries the statistics as exact hi/lo columns: 1/rms matches the
    float64 RMSNorm scale to ~1e-5, where one bf16 column (summed in bf16) is off by
    ~1e-3; the latent columns are the plain bf16 sum; the statistics' gradient is 1.
    Sequence-parallel: the same, each rank holding its s/T tokens (reduce-scatter)."""
    from torch.distributed._local_tensor import LocalTensorMode
    from tp_sim import plain

    from boost_titan.tp_plans.btp import BTPComm, BTPSequenceComm

    def whole(t):  # SP: the ranks' sequence shards, concatenated
        if not sequence_parallel:
            return plain(t)
        return torch.cat([t._local_tensors[rank] for rank in range(tp)], 1)

    b, s, r, d = 2, 64, 8, 32 * tp
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, s, d, generator=g) * torch.logspace(-3, 3, s).view(1, s, 1)  # 1e-3 .. 1e3
    shards = x.chunk(tp, -1)
    latents = [torch.randn(b, s, r, generator=g).bfloat16() for _ in range(tp)]
    ref_scale = torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6)
    with fake_world(tp) as mesh, LocalTensorMode(tp) as lm:
        stats = lm.rank_map(
            lambda rank: shards[rank].float().pow(2).sum(-1, keepdim=True)
        ).requires_grad_()
        latent = lm.rank_map(lambda rank: latents[rank])
        comm = BTPSequenceComm(mesh) if sequence_parallel else BTPComm(mesh)
        reduced_latent, total = comm.reduce_down(latent, stats)
        total.sum().backward()
        stats_grad = plain(stats.grad)
        total, reduced_latent = whole(total.detach()), whole(reduced_latent)
    err = ((torch.rsqrt(total.double() / d + 1e-6) - ref_scale).abs() / ref_scale).max().item()
    assert err < 1e-4, err
    assert torch.equal(stats_grad, torch.ones_like(stats_grad))
    expected = latents[0]
    for t in latents[1:]:
        expected = expected + t  # bf16 sums, in rank order
    assert reduced_latent.dtype == torch.bfloat16 and torch.equal(reduced_latent, expected)
    # the single bf16 column this replaces: summed in bf16, it misses 1e-3
    naive = shards[0].float().pow(2).sum(-1, keepdim=True).bfloat16()
    for shard in shards[1:]:
        naive = naive + shard.float().pow(2).sum(-1, keepdim=True).bfloat16()
    naive_err = (
        ((torch.rsqrt(naive.double() / d + 1e-6) - ref_scale).abs() / ref_scale).max().item()
    )
    assert naive_err > 1e-3, naive_err


# ----------------------------------------------------------------------------- bad input
def test_btp_rejects_dense_model_and_fullrank_rejects_low_rank():
    with pytest.raises(ValueError, match="does not apply to a dense model.*btp|valid plans"):
        resolve_tp_plan("btp", flavors_for("dense")["debugmodel"])
    with pytest.raises(ValueError, match="valid plans for it: \\['btp'"):
        resolve_tp_plan("fullrank", flavors_for("cola")["debugmodel"])
    assert resolve_tp_plan("auto", flavors_for("lax")["debugmodel"]) == "btp"
    assert resolve_tp_plan("auto", flavors_for("dense")["debugmodel"]) == "fullrank"


@pytest.mark.parametrize(
    "field,value,tp",
    [
        ("n_heads", 6, 4),
        ("n_kv_heads", 2, 4),
        ("dim", 260, 8),
        ("ffn_dim", 690, 4),
        ("vocab_size", 8190, 4),
    ],
)
def test_tp_degree_must_divide_shapes(field, value, tp):
    args = small_args(flavors_for("cola")["debugmodel"])
    setattr(args, field, value)
    with pytest.raises(
        ValueError, match=f"tensor_parallel_degree {tp} does not divide.*{field}={value}"
    ):
        validate_tp_degree(args, tp, "btp")


def test_bad_degree_fails_before_any_weight_is_allocated():
    args = small_args(flavors_for("cola")["debugmodel"], n_heads=6, dim=264)
    with torch.device("meta"):
        from boost_titan.models.model import Transformer

        model = Transformer(args)

    class _Cfg:
        class boost:
            rmsnorm = "online"

    with fake_world(4) as mesh:
        with pytest.raises(ValueError, match="n_heads=6"):
            apply_tp_plan("btp", model, mesh, loss_parallel=True, job_config=_Cfg)
    assert all(p.is_meta for p in model.parameters())
    assert not any(type(p).__name__ == "DTensor" for p in model.parameters())


# ----------------------------------------------------------------------------- one copy per latent
def _saved_storages(fn) -> dict:
    """{storage data_ptr: bytes} of what autograd saves while ``fn`` runs."""
    kept = {}

    def pack(t):
        st = t.untyped_storage()
        kept[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, kept


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grouped", [True, False])
@pytest.mark.parametrize("act", ["silu", "none"])
def test_latent_up_equals_plain_autograd_bitwise_and_saves_one_copy(dtype, grouped, act):
    """``latent_up`` (LatentUp) against the plain-autograd path it replaces
    (``down_finish`` -> ``activate`` -> ``up_group``): outputs and every gradient
    bitwise equal; saved: the reduced latent(s) and the 1/rms scale only."""
    from boost_titan.models.bottleneck import latent_up, up_group

    torch.manual_seed(0)
    d, n = 64, (2, 8)
    # a q-like B and two equal k/v-like B's: a lone GEMM and a batched run. Ranks are
    # multiples of the SIMD width: the plain path applies silu per B, LatentUp to the
    # grouped latent, and silu's vectorised loop and its scalar tail differ by an ulp
    # (32: twice AVX-512's 16 floats, the unit of torch's vectorised CPU loops)
    projs = [Bottleneck(d, 64, 32, act), Bottleneck(d, 32, 32, act), Bottleneck(d, 32, 32, act)]
    for p in projs:
        p.init_weights()
        p.to(dtype)
    norm = torch.nn.RMSNorm(d, eps=1e-5)
    widths = [32, 32, 32]
    full = torch.randn(*n, sum(widths), dtype=dtype)
    reduced = [full] if grouped else list(full.split(widths, -1))
    stats = torch.rand(*n, 1) * d + 1.0
    upstream = [torch.randn(*n, p.dout, dtype=dtype) for p in projs]

    def run(fused: bool):
        for p in projs:
            p.zero_grad(set_to_none=True)
        ins = [r.detach().clone().requires_grad_() for r in reduced]
        st = stats.clone().requires_grad_()

        def forward():
            if fused:
                return latent_up(ins, st, projs, SINGLE_DEVICE, norm, d)
            z = [p.activate(x, None) for p, x in zip(projs, down_finish(ins, st, projs, norm, d))]
            return up_group(z, projs, SINGLE_DEVICE, grouped)

        outs, saved = _saved_storages(forward)
        sum((o.float() * u.float()).sum() for o, u in zip(outs, upstream)).backward()
        grads = [x.grad for x in ins] + [st.grad] + [p.up.weight.grad for p in projs]
        weights = {p.up.weight.untyped_storage().data_ptr() for p in projs}
        return outs, grads, {k: v for k, v in saved.items() if k not in weights}

    plain_outs, plain_grads, plain_saved = run(fused=False)
    outs, grads, saved = run(fused=True)
    for a, b in zip(outs + grads, plain_outs + plain_grads):
        assert torch.equal(a, b)
    one_copy = sum(r.numel() for r in reduced) * full.element_size() + stats.numel() * 4
    assert sum(saved.values()) == one_copy
    assert sum(plain_saved.values()) > one_copy  # what it replaces kept more


# ----------------------------------------------------------------------------- sequence parallel
def _btp_sp(keep_gathered=False):
    return lambda model, mesh: apply_btp(
        model, mesh, loss_parallel=False, sequence_parallel=True, keep_gathered=keep_gathered
    )


SP_CASES = [
    # arch, flavor, tp, grouped, keep_gathered
    ("svd", "debugmodel", 2, True, False),
    ("cola", "debugmodel", 4, True, True),
    ("cola", "debugmodel", 8, True, False),
    ("cola", "debugmodel_gqa", 2, False, False),
    ("cola", "debugmodel_gqa", 4, True, False),
]


@pytest.mark.parametrize("arch,flavor,tp,grouped,keep", SP_CASES)
def test_sequence_parallel_btp_matches_single_device(arch, flavor, tp, grouped, keep):
    args = small_args(flavors_for(arch)[flavor], group_linears=grouped)
    ref = reference_model(args)
    tokens, labels = _data(args)
    ref_loss = lm_loss(ref(tokens), labels)
    ref_loss.backward()

    loss, grads, _ = run_parallel(ref, tp, _btp_sp(keep), tokens, labels)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    for name, p in ref.named_parameters():
        assert max_rel_err(grads[name], p.grad) < GRAD_TOL, name


@pytest.mark.parametrize(
    "flavor,tp,grouped,dtype,keep",
    [
        ("debugmodel", 2, True, "float32", False),
        ("debugmodel_gqa", 4, False, "float32", False),
        ("debugmodel", 4, True, "bfloat16", False),
        ("debugmodel", 2, True, "bfloat16", True),
    ],
)
def test_sequence_parallel_collectives_match_planner(flavor, tp, grouped, dtype, keep):
    """Counted per block, in issue order, against ``boost_titan.perf.plan``'s btp_sp closed
    form (keep_gathered: the same without the backward regathers)."""
    from boost_titan.perf.plan import block_collectives

    b, s = 2, 16
    args = small_args(flavors_for("cola")[flavor], group_linears=grouped, max_seq_len=s)
    ref = reference_model(args)
    for p in ref.parameters():  # parameters only: the RoPE table stays complex
        p.data = p.data.to(getattr(torch, dtype))
    tokens, labels = _data(args, b, s)
    _, _, counter = run_parallel(ref, tp, _btp_sp(keep), tokens, labels, counter_cls=CommCounter)
    fwd, bwd = block_collectives(args, "btp_sp", tp, b * s, grouped, "online", dtype)
    if keep:
        bwd = [c for c in bwd if "regathered" not in c.what]
    for layer in ("layers.0", "layers.1"):
        for phase, expected in (("forward", fwd), ("backward", bwd)):
            got = counter.block_records(layer, phase)
            assert [(r.op.split("_into")[0].split("_tensor")[0], r.numel) for r in got] == [
                (c.op, c.numel) for c in expected
            ], (layer, phase)


def test_sequence_parallel_refuses_lax_and_sync_norm():
    from boost_titan.tp_plans.btp import btp_comm

    args = small_args(flavors_for("lax")["debugmodel"])
    with fake_world(2) as mesh, pytest.raises(ValueError, match="does not support LaX"):
        apply_btp(reference_model(args), mesh, False, sequence_parallel=True)
    with pytest.raises(ValueError, match="needs rmsnorm = 'online'"):
        btp_comm("sync", True, False)
    with pytest.raises(ValueError, match="needs sequence_parallel = true"):
        btp_comm("online", False, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_statistics_save_no_fp32_copy_and_equal_plain_autograd(dtype):
    """Online-RMSNorm's per-token sum of squares (``down_partial``) saves its 16-bit
    input itself, not the fp32 copy plain autograd keeps for pow; gradients bitwise."""
    from boost_titan.models.bottleneck import _SumOfSquares

    x0 = torch.randn(2, 8, 64, dtype=dtype)
    upstream = torch.randn(2, 8, 1)

    def run(fn):
        x = x0.clone().requires_grad_()
        out, saved = _saved_storages(lambda: fn(x))
        (out * upstream).sum().backward()
        return out, x.grad, saved

    out, grad, saved = run(_SumOfSquares.apply)
    ref_out, ref_grad, ref_saved = run(lambda x: x.float().pow(2).sum(-1, keepdim=True))
    assert torch.equal(out, ref_out) and torch.equal(grad, ref_grad)
    assert sum(saved.values()) == x0.numel() * x0.element_size()
    assert sum(ref_saved.values()) == x0.numel() * 4  # the fp32 copy (x itself in fp32)
