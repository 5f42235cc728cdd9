"""Communication-free low-rank activation checkpointing (``[boost] latent_checkpoint``):
bitwise-identical gradients, identical collectives, less saved activation memory."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tp_sim import plan_fn, reference_model, run_parallel, small_args

from boost_titan.models.flavors import flavors_for
from boost_titan.models.model import Transformer
from boost_titan.observability.comm_stats import CommCounter, _block_of
from boost_titan.parallel.latent_checkpoint import ATTENTION_OPS, apply_latent_checkpointing


def _btp_with(mode, every=1, keep="attention"):
    def apply(model, mesh):
        plan_fn("btp")(model, mesh)
        apply_latent_checkpointing(model, mode, every, keep=keep, plan="btp")

    return apply


@pytest.mark.parametrize(
    "arch,flavor,mode,every,keep",
    [
        ("cola", "debugmodel", "both", 1, "attention"),
        ("cola", "debugmodel", "both", 1, "none"),
        ("lax", "debugmodel_gqa", "attention", 1, "attention"),
        ("svd", "debugmodel", "mlp", 2, "attention"),
    ],
)
def test_latent_checkpoint_is_bitwise_and_adds_no_collective(arch, flavor, mode, every, keep):
    args = small_args(flavors_for(arch)[flavor])
    ref = reference_model(args)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    base = run_parallel(ref, 4, _btp_with("none"), tokens, labels, CommCounter)
    ckpt = run_parallel(ref, 4, _btp_with(mode, every, keep), tokens, labels, CommCounter)
    assert torch.equal(base[0], ckpt[0])
    for name in base[1]:
        assert torch.equal(base[1][name], ckpt[1][name]), name

    # the same collectives in the same order, in the same block; in backward the
    # innermost-module label is ModTracker's guess among the modules whose backward
    # is pending (LaX: w1 vs w2 cross gates can swap), so blocks are compared there
    def records(run, phase):
        return [
            (r.op, r.numel, r.module if phase == "forward" else _block_of(r.module))
            for r in run[2].records
            if r.phase == phase
        ]

    for phase in ("forward", "backward"):
        assert records(ckpt, phase) == records(base, phase), phase


def _saved_bytes(model, tokens) -> int:
    """Activation bytes autograd keeps for backward (parameters and buffers it saves
    are references, not memory)."""
    total = 0
    owned = {
        p.untyped_storage().data_ptr() for p in list(model.parameters()) + list(model.buffers())
    }

    def pack(t):
        nonlocal total
        if t.untyped_storage().data_ptr() not in owned:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens)
    return total


def test_latent_checkpoint_saves_activation_memory():
    args = flavors_for("cola")["debugmodel"]
    args.max_seq_len = 128
    torch.manual_seed(0)
    model = Transformer(args)
    tokens = torch.randint(0, args.vocab_size, (2, 128))
    saved = {}
    for mode in ("none", "attention", "mlp", "both"):
        apply_latent_checkpointing(model, mode, keep="none")  # replaces the previous mode
        saved[mode] = _saved_bytes(model, tokens)
    assert saved["attention"] < saved["none"] and saved["mlp"] < saved["none"]
    # both = the savings of the two added up (the chunks are disjoint)
    assert saved["none"] - saved["both"] == (saved["none"] - saved["attention"]) + (
        saved["none"] - saved["mlp"]
    )
    # what a block still keeps: its residual stream (x, h: 2d), one copy of each
    # latent (7r: the reduced ones, what LatentUp saves) and per-token norm
    # statistics -- well under half of what checkpointing freed
    tokens, d, r = 2 * 128, args.dim, args.rank
    head = 2 * tokens * d * 4  # final norm input and LM head input, outside the blocks
    per_block_left = (saved["both"] - head) / args.n_layers
    assert per_block_left <= tokens * 4 * (3 * d + 7 * r + 16)
    assert per_block_left < 0.5 * (saved["none"] - saved["both"]) / args.n_layers


class _AttentionCalls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in ATTENTION_OPS
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("keep,recomputed", [("attention", 0), ("none", 1)])
def test_latent_checkpoint_keep_attention_skips_its_recompute(keep, recomputed):
    """keep = "attention": backward re-runs the chunk but not the attention kernel
    (its outputs are kept); "none": once per checkpointed block."""
    args = flavors_for("cola")["debugmodel"]
    torch.manual_seed(0)
    model = Transformer(args)
    apply_latent_checkpointing(model, "attention", 2, keep=keep)
    tokens = torch.randint(0, args.vocab_size, (2, 32))
    loss = model(tokens).float().logsumexp(-1).mean()
    with _AttentionCalls() as counter:
        loss.backward()
    checkpointed = len(range(0, args.n_layers, 2))
    assert checkpointed >= 2 and counter.calls == recomputed * checkpointed


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(mode="both", plan="vanilla"), "tp_plan 'vanilla' communicates inside its chunks"),
        (dict(mode="mlp", plan="btp", norm_mode="sync"), "rmsnorm = 'sync'"),
        (dict(mode="attention", torchtitan_ac="full"), "mode = 'full' is also set"),
        (dict(mode="both", keep="outputs"), "latent_checkpoint_keep = 'outputs' is not valid"),
    ],
)
def test_latent_checkpoint_bad_combinations(kwargs, message):
    args = flavors_for("cola")["debugmodel"]
    with torch.device("meta"):
        model = Transformer(args)
    mode = kwargs.pop("mode")
    with pytest.raises(ValueError, match=message):
        apply_latent_checkpointing(model, mode, **kwargs)


def test_latent_checkpoint_rejects_dense_model_and_unknown_mode():
    from boost_titan.config import Boost, validate_boost_config

    with torch.device("meta"):
        model = Transformer(flavors_for("dense")["debugmodel"])
    with pytest.raises(ValueError, match="the model is dense"):
        apply_latent_checkpointing(model, "both")
    with pytest.raises(ValueError, match="latent_checkpoint = 'some' is not valid"):
        validate_boost_config(Boost(latent_checkpoint="some"))


def test_latent_checkpoint_with_sequence_parallel_latents_regathers_in_its_reforward():
    """With ``[boost] sequence_parallel`` a chunk's B input is all-gathered inside the
    chunk, so a recomputed chunk gathers it again: gradients stay bitwise those of the
    same run without checkpointing, forward collectives are identical, backward has
    exactly one more all-gather per latent group re-forwarded (q|k|v in the attention
    chunk; o and gate|up in the MLP chunk; down is outside both)."""
    from boost_titan.tp_plans.btp import apply_btp

    def sp_with(mode):
        def apply(model, mesh):
            apply_btp(model, mesh, False, sequence_parallel=True)
            apply_latent_checkpointing(model, mode, keep="attention", plan="btp")

        return apply

    args = small_args(flavors_for("cola")["debugmodel_gqa"])
    ref = reference_model(args)
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    labels = torch.randint(0, args.vocab_size, (2, 32), generator=g)
    base = run_parallel(ref, 2, sp_with("none"), tokens, labels, CommCounter)
    ckpt = run_parallel(ref, 2, sp_with("both"), tokens, labels, CommCounter)
    assert torch.equal(base[0], ckpt[0])
    for name in base[1]:
        assert torch.equal(base[1][name], ckpt[1][name]), name

    def ops(run, phase):
        return [(r.op, r.numel) for r in run[2].records if r.phase == phase]

    assert ops(ckpt, "forward") == ops(base, "forward")
    extra = list(ops(ckpt, "backward"))
    for rec in ops(base, "backward"):
        extra.remove(rec)
    t, r = 2 * 32, {n: s[2] for n, s in args.projection_shapes().items()}
    per_block = [t * (r["wq"] + r["wk"] + r["wv"]), t * r["wo"], t * (r["w1"] + r["w3"])]
    assert sorted(extra) == sorted(("all_gather_into_tensor", n) for n in per_block * 2)
