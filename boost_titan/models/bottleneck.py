"""Bottleneck layers and the latent-side machinery shared by every low-rank block.

A dense projection ``W: in -> out`` becomes ``up(act(down(x)))`` with ``down`` = A
(in -> r) and ``up`` = B (r -> out). Parameters stay per projection (stable FQNs
``<proj>.down.weight`` / ``<proj>.up.weight``); grouping (one GEMM for A_q|A_k|A_v,
batched GEMMs for the B's) happens at compute time, so a checkpoint does not depend on
``group_linears``.

Blocks never talk to other ranks themselves: they call a :class:`LatentComm` at the
seven hooks where a tensor-parallel plan may need a collective. Single device, all of
them are identities; ``boost_titan/tp_plans`` supplies the parallel ones.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from .args import kron_factors


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (possibly distributed) parameter; differentiable."""
    return t.to_local() if isinstance(t, DTensor) else t


class KroneckerGate(nn.Module):
    """LaX Kronecker gate: h (r = a*b) viewed as H [a, b] -> G1^T H G0, flattened."""

    def __init__(self, r: int):
        super().__init__()
        self.a, self.b = kron_factors(r)
        self.g1 = nn.Parameter(torch.empty(self.a, self.a))
        self.g0 = nn.Parameter(torch.empty(self.b, self.b))

    def init_weights(self) -> None:
        # kaiming-uniform as in the authors' code (nn.Linear's default rule)
        for g in (self.g1, self.g0):
            nn.init.kaiming_uniform_(g, a=5**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        H = h.unflatten(-1, (self.a, self.b))
        out = local(self.g1).t() @ H @ local(self.g0)
        return out.flatten(-2)


class DenseGate(nn.Module):
    def __init__(self, r: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(r, r))

    def init_weights(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, local(self.weight))


class LatentCross(nn.Module):
    """LaX crossing: norm_r(latent + gate(previous block's latent of this type))."""

    def __init__(self, r: int, gate: str, eps: float):
        super().__init__()
        self.gate = KroneckerGate(r) if gate == "kron" else DenseGate(r)
        self.norm = nn.LayerNorm(r, eps=eps)

    def init_weights(self) -> None:
        self.gate.init_weights()
        self.norm.reset_parameters()

    def forward(self, latent: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        w, b = local(self.norm.weight), local(self.norm.bias)
        return F.layer_norm(latent + self.gate(prev), (latent.shape[-1],), w, b, self.norm.eps)


class Bottleneck(nn.Module):
    """``y = B act(A x)``; ``cross`` (LaX, blocks >= 1) acts on the latent before act."""

    def __init__(self, din: int, dout: int, rank: int, act: str, cross: LatentCross | None = None):
        super().__init__()
        self.din, self.dout, self.rank = din, dout, rank
        self.down = nn.Linear(din, rank, bias=False)
        self.up = nn.Linear(rank, dout, bias=False)
        self.act = act
        self.cross = cross

    def init_weights(self) -> None:
        # CoLA init: A, B ~ N(0, 1) r^-1/4 (in+out)^-1/4, so A.B has variance 1/(in+out)
        std = self.rank**-0.25 * (self.din + self.dout) ** -0.25
        nn.init.normal_(self.down.weight, std=std)
        nn.init.normal_(self.up.weight, std=std)
        if self.cross is not None:
            self.cross.init_weights()

    def activate(self, latent: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        if self.cross is not None:
            latent = self.cross(latent, prev)
        return F.silu(latent) if self.act == "silu" else latent

    def forward(self, x: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Stand-alone single-device use (blocks use the grouped helpers below)."""
        return self.up(self.activate(self.down(x), prev))


class LatentComm:
    """The collective points of a bottleneck block; identities on a single device.

    ``enter_down``: before a group of down-projections A (vanilla TP: A is
        column-parallel on a replicated input, so its input gradient is a partial sum).
    ``reduce_down``: after the down-projections A (input d- or f-sharded under BTP, so
        the latent is a partial sum), with the RMSNorm statistics riding along.
    ``up_input`` / ``up_input_grad``: what the up-projections B consume, and the
        mirror for its gradient (plain tensors, no autograd: both are called from
        :class:`LatentUp`'s forward and backward). BTP: identity / the all-reduce of
        the column-parallel B's partial input gradient; sequence-parallel BTP: an
        all-gather over the sequence / a reduce-scatter. ``enter_up`` is the same
        pair as an autograd op, for latents that are not recomputed (LaX).
    ``leave_up``: after an up-projection (vanilla TP's output all-reduce).
    ``normalize_input``: where the RMSNorm of a down-projection group's input is
        applied. Online-RMSNorm (default) leaves the input unscaled and its statistics
        pending, to ride in ``reduce_down``; a plan that normalises first (vanilla, the
        BTP ``sync`` ablation) scales it here and returns no statistics.
    ``full_latent`` / ``local_latent``: LaX's gate and latent norm need the whole
        latent; a plan that splits r gathers it and hands B back its slice.

    Every call site sits in a :meth:`scope` named ``<plan>/layer<i>/<point>_<group>``
    (e.g. ``btp/layer3/reduce_down_qkv``), so a profiler trace names each collective by
    its block and chunk; its backward collectives inherit the name through autograd's
    sequence numbers (``boost_titan.observability.step_profile``).
    """

    label = ""  # "<plan>/layer<i>", set by tp_plans.apply_tp_plan
    keep_gathered = False  # LatentUp saves up_input's output instead of rebuilding it

    def scope(self, point: str):
        """A profiler range around a collective point; nothing when compiling (Dynamo
        drops profiler ranges, with a warning), unlabelled (one device) or when no
        profiler runs (a range costs a dispatcher call even then: not on every step).

        ``is_compiling()`` comes first: Dynamo guards on every Python value a compiled
        frame reads, and each block's label differs, so reading it under compile made
        every block its own graph (recompile limit 8: deeper TP models died at block 9)."""
        if (
            torch.compiler.is_compiling()
            or not self.label
            or not torch.autograd.profiler._is_profiler_enabled
        ):
            return contextlib.nullcontext()
        return torch.profiler.record_function(f"{self.label}/{point}")

    def enter_down(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def full_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return latent

    def local_latent(self, latent: torch.Tensor) -> torch.Tensor:
        return latent

    def normalize_input(self, x: torch.Tensor, stats: torch.Tensor, eps: float, dim: int):
        return x, stats

    def reduce_down(self, latent: torch.Tensor, stats: torch.Tensor | None):
        return latent, stats

    def up_input(self, latent: torch.Tensor) -> torch.Tensor:
        return latent

    def up_input_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return grad

    def enter_up(self, latent: torch.Tensor) -> torch.Tensor:
        return _UpInput.apply(latent, self)

    def leave_up(self, out: torch.Tensor) -> torch.Tensor:
        return out


class _UpInput(torch.autograd.Function):
    """``comm.up_input`` forward, ``comm.up_input_grad`` backward."""

    @staticmethod
    def forward(ctx, latent: torch.Tensor, comm: LatentComm) -> torch.Tensor:
        ctx.comm = comm
        return comm.up_input(latent)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.comm.up_input_grad(grad), None


SINGLE_DEVICE = LatentComm()


def rms_normalize(x: torch.Tensor, stats: torch.Tensor, eps: float, dim: int) -> torch.Tensor:
    """RMSNorm without its gain, from the per-token sum of squares over all ``dim``."""
    return (x.float() * torch.rsqrt(stats / dim + eps)).type_as(x)


class _SumOfSquares(torch.autograd.Function):
    """``x.float().pow(2).sum(-1, keepdim=True)``, saving ``x`` itself: through plain
    autograd a 16-bit ``x`` is kept a second time as its fp32 copy (pow's input),
    while ``x`` is saved anyway (the norm gain's multiply). Backward is autograd's
    (pow's ``grad * 2 x`` on the fp32 copy, then the cast back), bitwise."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x.float().pow(2).sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        xf = x.float()
        return (grad * (2.0 * xf)).to(x.dtype)


# A group of down-projections A sharing one input runs in three steps:
# ``down_partial`` (local) -> ``down_reduce`` (the collective) -> ``down_finish`` (local).
# With a norm this is Online-RMSNorm: RMSNorm(x) A^T = ((x * g) A^T) / rms(x), so the
# per-token sum of squares is reduced together with the partial latent; ``dim`` is the
# full hidden size (x may be a d/T shard).


def down_partial(x, projs, comm, grouped, norm=None, dim=0, group=""):
    """Per-rank partial latents (one tensor when grouped) and the norm's partial
    statistics. No forward collective in online mode, so it can be recomputed in
    backward for free (latent checkpointing)."""
    stats = None
    if norm is not None:
        stats = _SumOfSquares.apply(x)
        with comm.scope(f"normalize_{group}"):
            x, stats = comm.normalize_input(x, stats, norm.eps, dim)
        x = x * local(norm.weight)
    with comm.scope(f"enter_down_{group}"):
        x = comm.enter_down(x)
    if grouped:
        weight = torch.cat([local(p.down.weight) for p in projs], 0)
        return [F.linear(x, weight)], stats
    return [F.linear(x, local(p.down.weight)) for p in projs], stats


def down_reduce(partials, stats, comm, group=""):
    """The collective of a down-projection group: reduce the partial latents (the statistics
    ride with the first). Returns the reduced latents and statistics, un-normalised:
    they are all latent checkpointing keeps of a chunk boundary."""
    latents, pending = [], stats
    for partial in partials:
        with comm.scope(f"reduce_down_{group}"):
            latent, reduced = comm.reduce_down(partial, pending)
        if pending is not None:
            stats, pending = reduced, None
        latents.append(latent)
    return latents, stats


def down_finish(latents, stats, projs, norm=None, dim=0) -> list[torch.Tensor]:
    """The local tail of a down-projection group: Online-RMSNorm's 1/rms scale, then one latent
    per A (a grouped GEMM's latent is split)."""
    if stats is not None:  # Online-RMSNorm: the input was left unscaled
        scale = torch.rsqrt(stats / dim + norm.eps)
        latents = [(l.float() * scale).type_as(l) for l in latents]
    if len(latents) == 1 and len(projs) > 1:  # grouped: one latent for all A's
        return list(latents[0].split([local(p.down.weight).shape[0] for p in projs], -1))
    return latents


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous.

    ``bmm(z, w.transpose(1, 2))`` gives ``w`` (the stacked B's, [n, out, r]) a gradient
    with transposed strides, and each B's slice of it keeps them. Autograd copies such a
    gradient into the parameter's layout when it accumulates it, but pipeline schedules
    with a split backward (zero-bubble) assign ``weight.grad = dw`` as it comes, and
    torch's fused AdamW on CPU misreads a non-contiguous gradient: CoLA/LaX trained
    silently wrong from step 2. One copy here, the one autograd would make anyway."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def up_group(
    latents: list[torch.Tensor],
    projs: list[Bottleneck],
    comm: LatentComm,
    grouped: bool,
    group: str = "",
) -> list[torch.Tensor]:
    """The B's of ``projs`` applied to their (activated) latents.

    Grouped: one ``enter_up`` for all latents (one backward all-reduce under BTP) and
    one batched GEMM per run of equally shaped B's.
    """
    enter, leave = comm.scope(f"enter_up_{group}"), comm.scope(f"leave_up_{group}")
    if not grouped:
        outs = []
        for z, p in zip(latents, projs):
            with enter:
                z = comm.enter_up(z)
            y = F.linear(z, local(p.up.weight))
            with leave:
                outs.append(comm.leave_up(y))
        return outs
    with enter:
        z = comm.enter_up(torch.cat(latents, -1) if len(latents) > 1 else latents[0])
    zs = z.split([local(p.up.weight).shape[1] for p in projs], -1)  # r, or r/T if split
    outs: list[torch.Tensor] = []
    i = 0
    while i < len(projs):
        j = i + 1
        while j < len(projs) and local(projs[j].up.weight).shape == local(projs[i].up.weight).shape:
            j += 1
        if j - i == 1:
            outs.append(F.linear(zs[i], local(projs[i].up.weight)))
        else:
            w = _ContiguousGrad.apply(torch.stack([local(p.up.weight) for p in projs[i:j]]))
            lead = zs[i].shape[:-1]
            zb = torch.stack([t.reshape(-1, t.shape[-1]) for t in zs[i:j]])  # [n, N, r]
            yb = torch.bmm(zb, w.transpose(1, 2))
            outs.extend(y.view(*lead, -1) for y in yb.unbind(0))
        i = j
    with leave:
        return [comm.leave_up(o) for o in outs]


def _equal_shape_runs(weights: list[torch.Tensor]) -> list[tuple[int, int]]:
    """[i, j) index runs of consecutive equally shaped B's: one batched GEMM each."""
    runs, i = [], 0
    while i < len(weights):
        j = i + 1
        while j < len(weights) and weights[j].shape == weights[i].shape:
            j += 1
        runs.append((i, j))
        i = j
    return runs


def _scaled_act(latent: torch.Tensor, scale: torch.Tensor | None, act: str) -> torch.Tensor:
    """B's input from a reduced latent: Online-RMSNorm's 1/rms, then the activation
    (the ops of ``down_finish`` + ``Bottleneck.activate``, in the same order)."""
    if scale is not None:
        latent = (latent.float() * scale).type_as(latent)
    return F.silu(latent) if act == "silu" else latent


class LatentUp(torch.autograd.Function):
    """``B act(latent / rms)`` for a group of B's, keeping one copy of the latent.

    Through plain autograd a reduced latent is saved up to four times: in fp32 by the
    1/rms scale, as the activation's input, as the activated latent each B's GEMM keeps
    for its weight gradient (stacked, for a batched GEMM). Here only the reduced latent
    (and the per-token scale) is saved; backward rebuilds the B input with the same
    elementwise ops and ``comm.up_input`` (sequence-parallel BTP: the all-gather again,
    Megatron-SP's trade; ``comm.keep_gathered`` saves the gathered latent instead) and
    runs each op's derivative as autograd would (same kernels, same layouts: gradients
    equal plain autograd's bitwise, ``tests/test_btp.py``, where each B's rank is a
    multiple of the SIMD width; else the activation, applied here to the grouped
    latent and by plain autograd per B, can differ by an ulp in a vector loop's scalar
    tail). Every op is a plain aten op, so Dynamo traces forward and backward.

    Forward: ``z = up_input(act(latent * scale))``, then per run of equally shaped B's
    one batched GEMM (a lone B: one GEMM); outputs are per B. Backward: the B input
    gradient goes through ``comm.up_input_grad`` (BTP: the all-reduce of the
    column-parallel B's partial sums; SP: a reduce-scatter)."""

    @staticmethod
    def forward(ctx, latent, scale, act: str, comm: LatentComm, *weights):
        z = comm.up_input(_scaled_act(latent, scale, act))
        widths = [w.shape[1] for w in weights]
        zs = z.split(widths, -1)
        lead = z.shape[:-1]
        outs = []
        for i, j in _equal_shape_runs(list(weights)):
            if j - i == 1:
                outs.append(F.linear(zs[i], weights[i]))
                continue
            zb = torch.stack([t.reshape(-1, t.shape[-1]) for t in zs[i:j]])  # [n, N, r]
            yb = torch.bmm(zb, torch.stack(weights[i:j]).transpose(1, 2))
            outs.extend(y.view(*lead, -1) for y in yb.unbind(0))
        ctx.act, ctx.comm, ctx.widths = act, comm, widths
        # backward runs the GEMMs under forward's autocast (as torch.amp.custom_bwd)
        device = latent.device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.has_scale = scale is not None
        kept = z if comm.keep_gathered else latent
        ctx.save_for_backward(kept, latent, scale if scale is not None else latent, *weights)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        device, dtype, enabled = ctx.autocast
        with torch.autocast(device_type=device, dtype=dtype, enabled=enabled):
            return LatentUp._backward(ctx, *grads)

    @staticmethod
    def _backward(ctx, *grads):
        kept, latent, scale, *weights = ctx.saved_tensors
        scale = scale if ctx.has_scale else None
        scaled = latent if scale is None else (latent.float() * scale).type_as(latent)
        if ctx.comm.keep_gathered:
            z = kept
        else:
            z = ctx.comm.up_input(F.silu(scaled) if ctx.act == "silu" else scaled)
        zs = z.split(ctx.widths, -1)
        dzs: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
        dws: list[torch.Tensor] = [None] * len(weights)  # type: ignore[list-item]
        for i, j in _equal_shape_runs(weights):
            dys = grads[i:j]  # autograd materialises unused outputs' gradients as zeros
            if j - i == 1:
                # mm's derivatives for a column-major weight (F.linear's W^T)
                dy = dys[0].reshape(-1, dys[0].shape[-1])
                zi = zs[i].reshape(-1, zs[i].shape[-1])
                dzs[i] = dy.mm(weights[i]).view(zs[i].shape)
                dws[i] = dy.t().mm(zi).to(weights[i].dtype)
                continue
            zb = torch.stack([t.reshape(-1, t.shape[-1]) for t in zs[i:j]])
            dyb = torch.stack([d.reshape(-1, d.shape[-1]) for d in dys])
            wb = torch.stack(weights[i:j])
            dzb = dyb.bmm(wb)
            # bmm's derivative for mat2 = wb^T, then contiguous (see _ContiguousGrad)
            dwb = zb.transpose(1, 2).bmm(dyb).to(wb.dtype).transpose(1, 2).contiguous()
            for k in range(i, j):
                dzs[k] = dzb[k - i].view(zs[k].shape)
                dws[k] = dwb[k - i]
        dz = ctx.comm.up_input_grad(torch.cat(dzs, -1) if len(dzs) > 1 else dzs[0])
        # the elementwise chain's derivatives, each as autograd computes it
        if ctx.act == "silu":
            dz = torch.ops.aten.silu_backward(dz, scaled)
        if scale is None:
            return (dz, None, None, None, *dws)
        g = dz.float()  # through type_as
        d_latent = (g * scale).to(latent.dtype)
        d_scale = (g * latent.float()).sum(-1, keepdim=True)
        return (d_latent, d_scale, None, None, *dws)


def latent_up(
    reduced: list[torch.Tensor],
    stats: torch.Tensor | None,
    projs: list[Bottleneck],
    comm: LatentComm,
    norm=None,
    dim: int = 0,
    group: str = "",
) -> list[torch.Tensor]:
    """The B's of ``projs`` on their reduced latents (one per B, or one grouped
    latent for all), through :class:`LatentUp`: Online-RMSNorm's scale (``stats``
    pending), the activation and the B GEMMs, one saved copy of each latent."""
    scale = None if stats is None else torch.rsqrt(stats / dim + norm.eps)
    pairs = (
        [([latent], [p]) for latent, p in zip(reduced, projs)]
        if len(reduced) == len(projs)
        else [(reduced, projs)]
    )
    outs: list[torch.Tensor] = []
    for (latent,), ps in pairs:
        with comm.scope(f"enter_up_{group}"):
            weights = [local(p.up.weight) for p in ps]
            outs.extend(LatentUp.apply(latent, scale, ps[0].act, comm, *weights))
    with comm.scope(f"leave_up_{group}"):
        return [comm.leave_up(o) for o in outs]
