"""Low-rank factors of dense projections: the math of ``boost-titan checkpoint
from-dense`` (no file I/O; ``boost_titan/checkpoint/from_dense/`` reads and writes,
``boost_titan/data/calibration.py`` gives the calibration tokens).

A dense projection ``W`` ``[out, in]`` becomes a bottleneck (``bottleneck.py``):
``down.weight`` = A ``[r, in]``, ``up.weight`` = B ``[out, r]``, ``y = B act(A x)``.

**Plain SVD** (:func:`svd_factors`). ``W = U S V^T``; keep the top ``r`` singular
triplets and split each singular value evenly between the factors::

    B = U_r S_r^(1/2)        A = S_r^(1/2) V_r^T        B A = U_r S_r V_r^T

so ``B^T B = A A^T = S_r`` (balanced factors: equal Frobenius and spectral norms, the
point LORO's exact step retracts to, and the same gradient scale for both factors:
AdamW's per-parameter steps treat them alike). ``B A`` is the best rank-``r``
approximation (Eckart-Young): ``||W - B A||_F / ||W||_F = sqrt(sum_{i>r} s_i^2) / ||W||_F``
(:func:`eckart_young_tail`). At ``r = min(in, out)`` the factors reproduce ``W`` to the
SVD's rounding. The SVD runs in ``float64`` by default (exact to fp32 rounding; one
1B-sized matrix costs seconds) and the factors are returned in ``float32``.

**Activation-aware fit** (:func:`fit_bottleneck`), for bottlenecks with a nonlinearity
inside (CoLA's ``B silu(A x)``, LaX's ``B act(LayerNorm_r(A x + gate))``), where the SVD is
only a start. Given the dense projection's inputs ``X`` ``[n, in]`` on calibration tokens
and its outputs ``Y`` ``[n, out]`` (``X W^T``, or what the converted model must reproduce
instead, e.g. ``silu(X W1^T)`` when the target drops SwiGLU's outer SiLU), minimise::

    f(A, p) = ||Y - Z(A, p) B^T||_F^2 / ||Y||_F^2      Z = latent(X A^T; p)

``B`` is eliminated in closed form (least squares, ``B^T = (Z^T Z)^{-1} Z^T Y`` with a
tiny ridge for conditioning: variable projection), and ``A`` (with the latent
LayerNorm's affine ``p`` for LaX) is optimised by L-BFGS with a strong-Wolfe line search
on the reduced objective (its gradient is the partial gradient at the optimal ``B``).
Starting point: the SVD factors, so the first evaluation is "SVD, then ``B`` refitted".
Directions of ``A`` outside the span of the calibration inputs keep their SVD values.

**Linear bottlenecks after a fit** (:func:`balance`): ``B A`` refactored into balanced
factors again (QR of both, SVD of the ``r x r`` core).

**LaX gates** (:func:`zero_gate_`): the crossing contributes nothing at step 0 but can
learn: a dense gate is all zeros (its gradient ``dL/dy h_prev^T`` is not); a Kronecker
gate ``G1^T H G0`` gets ``G1 = 0`` and a kaiming-uniform ``G0`` (as the authors' init),
so ``G1``'s gradient ``H G0 (dL/dy)^T`` is non-zero (both zero would be a saddle where
neither moves).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .bottleneck import DenseGate, KroneckerGate

# the closed-form B's ridge, relative to the mean diagonal of Z^T Z: conditioning only
RIDGE = 1e-6


@dataclass
class Factors:
    down: torch.Tensor  # A [r, in]
    up: torch.Tensor  # B [out, r]
    singular_values: torch.Tensor  # every singular value of W, descending (float64)


def svd_factors(w: torch.Tensor, rank: int, dtype: torch.dtype = torch.float64) -> Factors:
    """Balanced rank-``rank`` factors of ``w`` ``[out, in]`` (module docstring); computed
    on ``w``'s device in ``dtype``, returned as ``float32`` on that device."""
    out_f, in_f = w.shape
    if not 1 <= rank <= min(out_f, in_f):
        raise ValueError(f"rank {rank} of a {out_f} x {in_f} matrix must be in [1, {min(w.shape)}]")
    u, s, vh = torch.linalg.svd(w.to(dtype), full_matrices=False)
    root = s[:rank].sqrt()
    up = (u[:, :rank] * root).float().contiguous()
    down = (root[:, None] * vh[:rank]).float().contiguous()
    return Factors(down, up, s.double())


def eckart_young_tail(singular_values: torch.Tensor, rank: int) -> float:
    """``sqrt(sum_{i>rank} s_i^2) / sqrt(sum_i s_i^2)``: the least relative Frobenius error
    of any rank-``rank`` approximation."""
    s2 = singular_values.double().pow(2)
    return math.sqrt(float(s2[rank:].sum()) / float(s2.sum()))


def weight_error(w: torch.Tensor, down: torch.Tensor, up: torch.Tensor) -> float:
    """``||W - B A||_F / ||W||_F``, in float64."""
    w64 = w.double()
    return float(torch.linalg.matrix_norm(w64 - up.double() @ down.double()) / w64.norm())


def balance(down: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same product ``B A`` as balanced factors (``B^T B = A A^T`` diagonal)."""
    qb, rb = torch.linalg.qr(up.double())
    qa, ra = torch.linalg.qr(down.double().t())
    u, s, vh = torch.linalg.svd(rb @ ra.t())
    root = s.sqrt()
    new_up = (qb @ u) * root
    new_down = root[:, None] * (vh @ qa.t())
    return new_down.float().contiguous(), new_up.float().contiguous()


# ----------------------------------------------------------------------------- latents
@dataclass(frozen=True)
class Latent:
    """What sits between A and B: an optional LayerNorm over r (LaX blocks >= 1, the
    crossing's gate contributing zero) then the activation ("silu" or "none")."""

    act: str = "none"
    norm: bool = False
    eps: float = 1e-6

    def __call__(
        self, u: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.norm:
            u = F.layer_norm(u, (u.shape[-1],), weight, bias, self.eps)
        return F.silu(u) if self.act == "silu" else u

    @property
    def linear(self) -> bool:
        return self.act == "none" and not self.norm


def activation_error(
    x: torch.Tensor,
    y: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    latent: Latent,
    norm_weight: torch.Tensor | None = None,
    norm_bias: torch.Tensor | None = None,
) -> float:
    """``||Y - B latent(A X)||_F / ||Y||_F`` over the rows (tokens) of ``x`` and ``y``."""
    with torch.no_grad():
        z = latent(x @ down.t(), norm_weight, norm_bias)
        return float((y - z @ up.t()).norm() / y.norm())


def _solve_up(z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``B = argmin ||Y - Z B^T||`` (+ a tiny ridge), ``[out, r]``; in float64."""
    z64 = z.double()
    gram = z64.t() @ z64
    ridge = RIDGE * float(gram.diagonal().mean()) + 1e-30
    gram.diagonal().add_(ridge)
    rhs = z64.t() @ y.double()
    return torch.linalg.solve(gram, rhs).t().to(z.dtype).contiguous()


@dataclass
class Fit:
    down: torch.Tensor
    up: torch.Tensor
    norm_weight: torch.Tensor | None
    norm_bias: torch.Tensor | None
    error_start: float  # the SVD factors as they are
    error_refit: float  # the SVD's A, B by least squares
    error_fitted: float  # after the L-BFGS iterations on A (and the norm's affine)
    evaluations: int


def fit_bottleneck(
    x: torch.Tensor,
    y: torch.Tensor,
    down: torch.Tensor,
    up: torch.Tensor,
    latent: Latent,
    steps: int = 20,
) -> Fit:
    """Fit ``B latent(A X) ~ Y`` from the factors ``down``, ``up`` (module docstring).

    ``x`` ``[n, in]``, ``y`` ``[n, out]``: float32, any device (the fit runs there).
    ``steps``: L-BFGS iterations (each evaluates the objective once or a few times for
    the line search); 0 only refits ``B``. The result never has a larger calibration
    error than the least-squares ``B`` on the SVD's ``A``: L-BFGS's best point is kept."""
    r = down.shape[0]
    w0 = torch.ones(r, device=x.device) if latent.norm else None
    b0 = torch.zeros(r, device=x.device) if latent.norm else None
    error_start = activation_error(x, y, down, up, latent, w0, b0)
    y_norm2 = float(y.double().pow(2).sum()) or 1.0

    a = down.detach().clone().requires_grad_(True)
    params = [a]
    nw = nb = None
    if latent.norm:
        nw = w0.clone().requires_grad_(True)
        nb = b0.clone().requires_grad_(True)
        params += [nw, nb]
    best: dict = {}
    evaluations = 0

    def objective() -> torch.Tensor:
        nonlocal evaluations
        evaluations += 1
        z = latent(x @ a.t(), nw, nb)
        with torch.no_grad():
            b = _solve_up(z, y)
        loss = (y - z @ b.t()).pow(2).sum() / y_norm2
        value = float(loss.detach())
        if math.isfinite(value) and value < best.get("loss", math.inf):
            best.update(
                loss=value,
                down=a.detach().clone(),
                up=b,
                nw=None if nw is None else nw.detach().clone(),
                nb=None if nb is None else nb.detach().clone(),
            )
        return loss

    with torch.no_grad():
        objective()
    error_refit = math.sqrt(best["loss"])
    if steps > 0:
        opt = torch.optim.LBFGS(
            params,
            lr=1.0,
            max_iter=steps,
            history_size=10,
            tolerance_grad=1e-9,
            tolerance_change=1e-12,
            line_search_fn="strong_wolfe",
        )

        def closure():
            opt.zero_grad()
            loss = objective()
            loss.backward()
            return loss

        opt.step(closure)
    return Fit(
        down=best["down"].contiguous(),
        up=best["up"],
        norm_weight=best["nw"],
        norm_bias=best["nb"],
        error_start=error_start,
        error_refit=error_refit,
        error_fitted=math.sqrt(best["loss"]),
        evaluations=evaluations,
    )


# ----------------------------------------------------------------------------- LaX gates
def zero_gate_(gate: nn.Module, generator: torch.Generator | None = None) -> None:
    """Make a LaX gate contribute zero while keeping it trainable (module docstring)."""
    with torch.no_grad():
        if isinstance(gate, DenseGate):
            gate.weight.zero_()
        elif isinstance(gate, KroneckerGate):
            gate.g1.zero_()
            bound = 1.0 / math.sqrt(gate.g0.shape[1])  # kaiming_uniform_(a=sqrt(5))'s bound
            gate.g0.copy_(torch.rand(gate.g0.shape, generator=generator) * 2 * bound - bound)
        else:
            raise TypeError(f"not a LaX gate: {type(gate).__name__}")


def zero_gate_tensors(
    kind: str, rank: int, generator: torch.Generator | None = None
) -> dict[str, torch.Tensor]:
    """The state of a zero-contribution gate of ``kind`` ("dense" / "kron") and ``rank``,
    by the gate's parameter names."""
    gate = DenseGate(rank) if kind == "dense" else KroneckerGate(rank)
    zero_gate_(gate, generator)
    return {k: v.detach().clone() for k, v in gate.state_dict().items()}
