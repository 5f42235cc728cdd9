"""Simulated tensor parallelism in one process (fake process group + LocalTensorMode).

Forward/backward numerics and collective counts are exact at any TP degree; optimizer
steps are not (see ../shared/design/torchtitan-cpu.md), those run on real gloo ranks.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._local_tensor import LocalTensorMode
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore

from boost_titan.models.args import LlamaArgs
from boost_titan.models.model import Transformer


@contextlib.contextmanager
def fake_world(tp: int):
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=tp, store=FakeStore())
    try:
        yield init_device_mesh("cpu", (tp,))
    finally:
        dist.destroy_process_group()


def small_args(base: LlamaArgs, **overrides) -> LlamaArgs:
    """A 2-block, d=128 copy of a debug flavor (heads and kv heads kept): big enough
    for every shard to be non-trivial at TP 8, small enough for LocalTensorMode."""
    args = copy.deepcopy(base)
    args.n_layers = 2
    args.max_seq_len = 32
    args.dim, args.ffn_dim, args.vocab_size = 128, 344, 512
    if args.low_rank:
        args.rank = 32
    for k, v in overrides.items():
        setattr(args, k, v)
    return args


def reference_model(args: LlamaArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    with torch.no_grad():
        model.init_weights()
    return model


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor / LocalTensor gradient or parameter as one ordinary tensor."""
    if isinstance(t, DTensor):
        t = t.full_tensor()
    if hasattr(t, "reconcile"):
        t = t.reconcile()
    return t


def max_rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def run_parallel(ref: Transformer, tp: int, apply_plan, tokens, labels, counter_cls=None):
    """Copy ``ref``, parallelize it with ``apply_plan(model, mesh)`` at degree ``tp``
    inside LocalTensorMode, run forward+backward; returns (loss, {name: grad}, counter)."""
    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    with fake_world(tp) as mesh, LocalTensorMode(tp):
        apply_plan(model, mesh)
        ctx = counter_cls() if counter_cls else contextlib.nullcontext()
        with ctx as counter:
            loss = lm_loss(model(tokens), labels)
            loss.backward()
        loss = plain(loss.detach())
        grads = {n: plain(p.grad) for n, p in model.named_parameters()}
    return loss, grads, counter


def plan_fn(plan: str, loss_parallel: bool = False, norm_mode: str = "online"):
    """``apply(model, mesh)`` for a named TP plan."""
    from torchtitan.models.llama3.infra.parallelize import apply_tp

    from boost_titan.tp_plans.btp import apply_btp
    from boost_titan.tp_plans.vanilla import apply_vanilla

    return {
        "btp": lambda m, mesh: apply_btp(m, mesh, loss_parallel, norm_mode=norm_mode),
        "vanilla": lambda m, mesh: apply_vanilla(m, mesh, loss_parallel),
        "fullrank": lambda m, mesh: apply_tp(
            m, mesh, loss_parallel, enable_float8_tensorwise_tp=False
        ),
    }[plan]
