"""The two baseline plans: vanilla low-rank TP and full-rank TP, exact against a single
device at simulated TP 4, and vanilla's collectives equal the paper's closed form."""

from __future__ import annotations

import pytest
import torch
from tp_sim import lm_loss, max_rel_err, plan_fn, reference_model, run_parallel, small_args

from boost_titan.models.flavors import flavors_for
from boost_titan.observability.comm_stats import CommCounter


def _data(args, b, s):
    g = torch.Generator().manual_seed(3)
    return (
        torch.randint(0, args.vocab_size, (b, s), generator=g),
        torch.randint(0, args.vocab_size, (b, s), generator=g),
    )


@pytest.mark.parametrize(
    "plan,arch,flavor,tp,grouped",
    [
        ("vanilla", "svd", "debugmodel", 4, True),
        ("vanilla", "cola", "debugmodel_gqa", 4, False),
        ("vanilla", "lax", "debugmodel", 4, True),
        ("fullrank", "dense", "debugmodel", 4, True),
        ("fullrank", "dense", "debugmodel_gqa", 2, True),
    ],
)
def test_baseline_plan_matches_single_device(plan, arch, flavor, tp, grouped):
    args = small_args(flavors_for(arch)[flavor], group_linears=grouped)
    ref = reference_model(args)
    tokens, labels = _data(args, 2, 32)
    ref_loss = lm_loss(ref(tokens), labels)
    ref_loss.backward()
    loss, grads, _ = run_parallel(ref, tp, plan_fn(plan), tokens, labels)
    assert abs(loss.item() - ref_loss.item()) < 1e-5 * ref_loss.item()
    for name, p in ref.named_parameters():
        assert max_rel_err(grads[name], p.grad) < 2e-5, name


@pytest.mark.parametrize("flavor,tp,b,s", [("debugmodel", 2, 2, 16), ("debugmodel_gqa", 4, 1, 32)])
def test_vanilla_collectives_match_closed_form(flavor, tp, b, s):
    args = small_args(flavors_for("cola")[flavor], max_seq_len=s)
    ref = reference_model(args)
    tokens, labels = _data(args, b, s)
    _, _, counter = run_parallel(
        ref, tp, plan_fn("vanilla"), tokens, labels, counter_cls=CommCounter
    )
    d, f, kv, tok = args.dim, args.ffn_dim, args.kv_dim, b * s
    # forward: an all-reduce of [b, s, out] after every B (q, k, v, o, gate, up, down)
    fwd = [tok * o for o in (d, kv, kv, d, f, f, d)]
    # backward: the input gradient of each A group (ffn mid, h, attention out, x)
    bwd = [tok * f, tok * d, tok * d, tok * d]
    for layer in ("layers.0", "layers.1"):
        got_f = counter.block_records(layer, "forward")
        got_b = counter.block_records(layer, "backward")
        assert {r.op for r in got_f + got_b} == {"all_reduce"}
        assert [r.numel for r in got_f] == fwd
        assert [r.numel for r in got_b] == bwd
    if flavor == "debugmodel":  # MHA: the paper's b s (5d + 2f) per block forward
        assert sum(fwd) == tok * (5 * d + 2 * f)
