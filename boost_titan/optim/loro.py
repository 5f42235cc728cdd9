"""LORO: low-rank Riemannian optimizer (Mo et al., ICLR 2025) for W = B A models.

Every factor pair (A = ``down.weight``, B = ``up.weight`` of a bottleneck without an
activation inside) is trained as one point on the rank-r manifold; every other
parameter (embeddings, norms, head) gets the reference's AdamW.

=================  =============================================================
step               update
=================  =============================================================
every step         Adam moments of every parameter; direction = m / (sqrt(v) + eps),
                   step size = lr * sqrt(1 - b2^t) / (1 - b1^t) (t counts from the
                   last refresh)
lazy (t % K != 0)  factor -= step * lr_scaler * direction (lr_scaler -1: r / d)
exact (t % K == 0) W = B A moved along the tangent-space projection of the gradient
                   implied by the two directions and retracted with a 2r x 2r SVD
                   (:mod:`boost_titan.optim.manifold`); then the Adam states of
                   ``refresh`` are zeroed and the next ``restart_warmup`` steps ramp
                   the learning rate up from ~0 again
=================  =============================================================

Weight decay follows the reference: after the update, ``p -= step * wd * p`` for factors
(lazy steps only) and ``p -= lr * wd * p`` for the rest. The step counter lives in the
param groups (``loro_step``) so that a DCP checkpoint resumes the exact-step schedule.

Parameters and states may be DTensors of any layout: elementwise work runs on local
shards; the exact step runs on row shards with small collectives (see manifold.py), and
each pair's 2r x 2r SVD on one rank of the ranks that hold the pair (``spread``; bitwise
the same as every rank doing it). ``exact_dtype`` "float64" (default): its QRs,
triangular solves and SVD are then exact to fp32 rounding whatever the layout (in fp32,
TP4 and one device differed by 3e-5 in the factors); "float32" is the reference's
(within ~1e-6 of float64 on the debug model) and cheaper, at a cost paid once every K
steps.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from boost_titan.models.bottleneck import Bottleneck
from boost_titan.optim import manifold

REFRESH = {
    "all": ("regular", "factor"),
    "factors": ("factor",),
    "regular": ("regular",),
    "none": (),
}
EXACT_DTYPES = {"float64": torch.float64, "float32": torch.float32}
RESTART_FLOOR = 1e-6  # lr multiplier right after an exact step (the reference's eps)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class FactorPair:
    name: str
    up: nn.Parameter  # B = M, [d_out, r]: rows are d_out
    down: nn.Parameter  # A = N^T, [r, d_in]: rows of N are d_in
    lr_scaler: float


def factor_pairs(model: nn.Module, lr_scaler: float, model_dim: int) -> list[FactorPair]:
    pairs = []
    for name, mod in model.named_modules():
        if not isinstance(mod, Bottleneck):
            continue
        if mod.act != "none" or mod.cross is not None:
            raise ValueError(
                f"LORO needs W = B A, but bottleneck {name} has "
                f"{'a latent cross' if mod.cross is not None else f'activation {mod.act!r}'} "
                "between A and B; use svd_llama2 (latent_act none) or [optimizer] name = AdamW"
            )
        scaler = lr_scaler if lr_scaler >= 0 else mod.rank / model_dim
        pairs.append(FactorPair(name, mod.up.weight, mod.down.weight, scaler))
    if not pairs:
        raise ValueError(
            "LORO found no factor pairs (low-rank bottlenecks) in the model; it trains "
            "svd_llama2. Use [optimizer] name = AdamW for dense models"
        )
    return pairs


class LORO(torch.optim.Optimizer):
    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        exact_every: int,
        lr_scaler: float,
        refresh: str,
        restart_warmup: int,
        model_dim: int,
        exact_dtype: str = "float64",
        spread: bool = True,
    ):
        if exact_dtype not in EXACT_DTYPES:
            raise ValueError(
                f"LORO: exact_dtype {exact_dtype!r} is not valid; choose one of "
                f"{list(EXACT_DTYPES)}"
            )
        self.pairs = factor_pairs(model, lr_scaler, model_dim)
        factor_ids = {id(p) for pair in self.pairs for p in (pair.up, pair.down)}
        params = [p for p in model.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if id(p) not in factor_ids], "kind": "regular"},
            {"params": [p for p in params if id(p) in factor_ids], "kind": "factor"},
        ]
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, loro_step=0)
        super().__init__([g for g in groups if g["params"]], defaults)
        self.exact_every, self.refresh_kinds = exact_every, REFRESH[refresh]
        self.restart_warmup = restart_warmup
        self.exact_dtype = EXACT_DTYPES[exact_dtype]
        self.spread = spread  # exact step: each pair's core SVD on one rank of its group
        self.last_exact: tuple[int, float] | None = None  # (pairs, seconds) of the last one
        # states exist from the start: a checkpoint loads into them, and DCP never has
        # to run a dummy step to discover their shapes
        self._refresh(("regular", "factor"))

    @property
    def loro_step(self) -> int:
        return self.param_groups[0]["loro_step"]

    def is_exact(self, step: int) -> bool:
        return step % self.exact_every == 0

    def restart_factor(self, step: int) -> float:
        """The reference's lr jag: after an exact step the lr restarts near 0 and
        ramps linearly back over ``restart_warmup`` steps."""
        since = (step - 1) % self.exact_every
        if step - 1 < self.exact_every or since >= self.restart_warmup:
            return 1.0
        return max(since / self.restart_warmup, RESTART_FLOOR)

    def _refresh(self, kinds) -> None:
        for group in self.param_groups:
            if group["kind"] in kinds:
                for p in group["params"]:
                    self.state[p] = {
                        "step": 0,
                        "exp_avg": torch.zeros_like(p),
                        "exp_avg_sq": torch.zeros_like(p),
                    }

    def _adam(self, p: torch.Tensor, group: dict, lr: float):
        """Update p's moments; return (local direction, bias-corrected step size)."""
        grad = p.grad
        if isinstance(grad, DTensor) and grad.placements != p.placements:
            grad = grad.redistribute(p.device_mesh, p.placements)
        state, (beta1, beta2) = self.state[p], group["betas"]
        state["step"] += 1
        m, v, g = _local(state["exp_avg"]), _local(state["exp_avg_sq"]), _local(grad)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        t = state["step"]
        step_size = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
        return m / (v.sqrt() + group["eps"]), step_size

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group["loro_step"] += 1
        step = self.loro_step
        exact, factor = self.is_exact(step), self.restart_factor(step)
        directions = {}
        for group in self.param_groups:
            lr, wd = group["lr"] * factor, group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction, step_size = self._adam(p, group, lr)
                if group["kind"] == "factor":
                    directions[p] = (direction, step_size, wd)
                    continue
                w = _local(p)
                w.add_(direction, alpha=-step_size)
                if wd > 0:
                    w.add_(w, alpha=-lr * wd)
        todo = []
        for pair in self.pairs:
            if pair.up not in directions or pair.down not in directions:
                continue
            (d_up, step_up, wd), (d_down, _, _) = directions[pair.up], directions[pair.down]
            if exact:
                todo.append((pair, d_up, d_down, step_up))
                continue
            for p, d in ((pair.up, d_up), (pair.down, d_down)):
                w = _local(p)
                w.add_(d, alpha=-step_up * pair.lr_scaler)
                if wd > 0:
                    w.add_(w, alpha=-step_up * wd)
        started = time.perf_counter()
        for batch in self._batches(todo):
            self._exact(batch)
        if exact:
            self._refresh(self.refresh_kinds)
            # what the exact step cost this rank (the container logs it)
            self.last_exact = (len(todo), time.perf_counter() - started)
        return loss

    def _batches(self, todo: list) -> list[tuple[list[manifold.Group], list]]:
        """Consecutive exact-step pairs that share one rank group and one r, at most
        one per rank of the group (one batch per pair when not spread)."""
        batches = []
        for item in todo:
            pair = item[0]
            groups = manifold.share_groups(pair.up, pair.down, pair.name) if self.spread else []
            key = (groups, pair.up.shape[1])
            last = batches[-1] if batches else None
            if last and last[0] == key and len(last[2]) < manifold.group_size(groups):
                last[2].append(item)
            else:
                batches.append((key, groups, [item]))
        return [(groups, items) for _, groups, items in batches]

    def _exact(self, batch: tuple[list[manifold.Group], list]) -> None:
        groups, items = batch
        staged = []
        for pair, d_up, d_down, lr in items:
            up, down = pair.up, pair.down
            m_layout = manifold.tall_layout(up, 0, f"{pair.name}.up.weight")
            n_layout = manifold.tall_layout(down, 1, f"{pair.name}.down.weight")
            M, dM = _local(up), d_up
            Nt, dNt = _local(down), d_down
            if m_layout.gather:
                M, dM = (manifold.gathered(t, up, m_layout.gather) for t in (M, dM))
            if n_layout.gather:
                Nt, dNt = (manifold.gathered(t, down, n_layout.gather) for t in (Nt, dNt))
            x = self.exact_dtype
            *bases, core = manifold.tangent_core(
                M.to(x), Nt.T.to(x), dM.to(x), dNt.T.to(x), lr, m_layout.rows, n_layout.rows
            )
            staged.append((pair, m_layout, n_layout, M.dtype, bases, core))
        cores = [core for *_, core in staged]
        if manifold.group_size(groups) > 1:
            factors = manifold.shared_core_factors(cores, groups)
        else:
            factors = [manifold.core_factors(core) for core in cores]
        for (pair, m_layout, n_layout, dtype, bases, _), fm_fn in zip(staged, factors):
            M_new, N_new = manifold.finish(*bases, *fm_fn)
            M_new, Nt_new = M_new.to(dtype), N_new.T.to(dtype)
            if m_layout.gather:
                M_new = manifold.scattered(M_new, pair.up, m_layout.gather)
            if n_layout.gather:
                Nt_new = manifold.scattered(Nt_new, pair.down, n_layout.gather)
            _local(pair.up).copy_(M_new)
            _local(pair.down).copy_(Nt_new)
