"""LORO's exact step on row-sharded factors: W = M N^T kept on the rank-r manifold.

A factor pair is seen as two tall-skinny matrices, ``M = up.weight`` [d_out, r] and
``N = down.weight^T`` [d_in, r]. Under BTP both are split by rows (B is ``Shard(0)`` on
d_out, A is ``Shard(1)`` on d_in), so every step below is row-local except:

==============================  ==========================  ==========================
what                            collective (row group)      elements per rank
==============================  ==========================  ==========================
TSQR of M, N, Y1, Y2 (4x)       all-gather of r x r R's     4 * P * r^2 (received)
K0 = (U^T G) V, U^T (G V)       all-reduce of r x r         2 * r^2
core 2r x 2r SVD                none (replicated inputs)    -
==============================  ==========================  ==========================

A mesh dimension that shards the rank dimension instead (FSDP2's ``Shard(0)`` of A,
vanilla TP) is all-gathered once per exact step and re-sharded locally after it; the
rows it leaves sharded stay sharded. The step is equivariant to row permutations, so
``_StridedShard`` rows (FSDP2 x TP) need no reordering.

Signs: QR and SVD are unique only up to the sign of each column. Every QR here returns
R with a non-negative diagonal and every SVD pair has the largest-magnitude entry of
its left vector positive, so the result does not depend on how rows are split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

Group = tuple[DeviceMesh, int]


def _all_gather_rows(x: torch.Tensor, group: Group) -> torch.Tensor:
    return funcol.wait_tensor(funcol.all_gather_single(x.contiguous(), 0, group))


def all_reduce(x: torch.Tensor, groups: list[Group]) -> torch.Tensor:
    """Sum of an r x r product over every mesh dimension that splits the rows."""
    for group in groups:
        x = funcol.wait_tensor(funcol.all_reduce(x.contiguous(), "sum", group))
    return x


def tsqr(x: torch.Tensor, groups: list[Group]) -> tuple[torch.Tensor, torch.Tensor]:
    """QR of a matrix whose rows are split over ``groups``: local QR, the small R factors
    all-gathered, one small QR per mesh dimension. Returns (local rows of Q, R)."""
    k = x.shape[1]
    q, r = torch.linalg.qr(x)
    if q.shape[1] < k:  # fewer local rows than columns: pad to k x k (zero rows of R)
        q = torch.nn.functional.pad(q, (0, k - q.shape[1]))
        r = torch.nn.functional.pad(r, (0, 0, 0, k - r.shape[0]))
    for mesh, dim in groups:
        q_stack, r = torch.linalg.qr(_all_gather_rows(r, (mesh, dim)))
        i = mesh.get_local_rank(dim)
        q = q @ q_stack[i * k : (i + 1) * k]
    sign = torch.where(r.diagonal() < 0, -1.0, 1.0).to(r.dtype)
    return q * sign, r * sign[:, None]


def svd_signed(core: torch.Tensor):
    u, s, vh = torch.linalg.svd(core)
    pick = u.abs().argmax(dim=0, keepdim=True)
    sign = torch.where(u.gather(0, pick) < 0, -1.0, 1.0).to(u.dtype)
    return u * sign, s, vh * sign.T


def retract(M, N, dM, dN, lr: float, m_groups: list[Group], n_groups: list[Group]):
    """One exact LORO step on local rows (float64 from the caller): project the gradient
    implied by the factor gradients onto the tangent space of the rank-r manifold at
    W = M N^T, step by ``lr``, retract with a 2r x 2r SVD; returns balanced (M, N) rows."""
    r = M.shape[1]
    U, Rm = tsqr(M, m_groups)
    V, Rn = tsqr(N, n_groups)
    # dM = G N = G V Rn, dN = G^T M = (U^T G)^T Rm: recover G V and (U^T G)^T rows
    GV = torch.linalg.solve_triangular(Rn, dM, upper=True, left=False)
    GtU = torch.linalg.solve_triangular(Rm, dN, upper=True, left=False)
    K0 = all_reduce(GtU.T @ V, n_groups)  # U^T G V
    Y1 = GtU - V @ K0.T  # (U^T G (I - V V^T))^T
    Y2 = GV - U @ all_reduce(U.T @ GV, m_groups)  # (I - U U^T) G V
    Q1, K1 = tsqr(Y1, n_groups)
    Q2, K2 = tsqr(Y2, m_groups)
    core = torch.zeros(2 * r, 2 * r, dtype=M.dtype, device=M.device)
    core[:r, :r] = Rm @ Rn.T - lr * K0
    core[:r, r:] = -lr * K1.T
    core[r:, :r] = -lr * K2
    u, s, vh = svd_signed(core)
    root = s[:r].sqrt()
    M_new = torch.cat([U, Q2], dim=1) @ (u[:, :r] * root)
    N_new = torch.cat([V, Q1], dim=1) @ (vh[:r].T * root)
    return M_new, N_new


@dataclass
class TallLayout:
    """How a factor's tall matrix (rows x r) is laid out over the mesh: ``rows`` are
    the mesh dimensions that split its rows (TSQR groups), ``gather`` those that split
    r (all-gathered for the exact step)."""

    rows: list[Group]
    gather: list[int]


def tall_layout(p: torch.Tensor, row_dim: int, name: str) -> TallLayout:
    if not isinstance(p, DTensor):
        return TallLayout([], [])
    rows, gather = [], []
    for i, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            continue
        dim = getattr(pl, "dim", None)  # Shard and _StridedShard
        if dim is None:
            raise ValueError(f"LORO: factor {name} has placement {pl} on mesh dim {i}")
        (rows if dim == row_dim else gather).append(i)
    return TallLayout([(p.device_mesh, i) for i in rows], gather)


def gathered(t: torch.Tensor, like: DTensor, dims: list[int]) -> torch.Tensor:
    """Local tensor of ``t`` (laid out as ``like``) with mesh ``dims`` all-gathered."""
    dt = DTensor.from_local(
        t, like.device_mesh, like.placements, shape=like.shape, stride=like.stride()
    )
    placements = [Replicate() if i in dims else pl for i, pl in enumerate(like.placements)]
    return dt.redistribute(like.device_mesh, placements).to_local()


def scattered(t: torch.Tensor, like: DTensor, dims: list[int]) -> torch.Tensor:
    """Inverse of :func:`gathered`: keep this rank's shard (a local slice, no comm)."""
    placements = [Replicate() if i in dims else pl for i, pl in enumerate(like.placements)]
    dt = DTensor.from_local(t, like.device_mesh, placements, shape=like.shape, stride=like.stride())
    return dt.redistribute(like.device_mesh, like.placements).to_local()
