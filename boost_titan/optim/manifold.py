"""LORO's exact step on row-sharded factors: W = M N^T kept on the rank-r manifold.

A factor pair is seen as two tall-skinny matrices, ``M = up.weight`` [d_out, r] and
``N = down.weight^T`` [d_in, r]. Under BTP both are split by rows (B is ``Shard(0)`` on
d_out, A is ``Shard(1)`` on d_in), so every step below is row-local except:

==============================  ==========================  ==========================
what                            collective (row group)      elements per rank
==============================  ==========================  ==========================
TSQR of M, N, Y1, Y2 (4x)       all-gather of r x r R's     4 * P * r^2 (received)
K0 = (U^T G) V, U^T (G V)       all-reduce of r x r         2 * r^2
core 2r x 2r SVD, spread        all-gather of 2 (2r x r)    4 * r^2 (received)
==============================  ==========================  ==========================

The core is the same on every rank that holds the pair (``share_groups``: the row
groups, the gathered dimensions, replicas), so its SVD, the largest replicated piece, is
spread: with G such ranks, G pairs at a time, each rank factors one core and one
all-gather per mesh dimension exchanges the results (``shared_core_factors``).

A mesh dimension that shards the rank dimension instead (FSDP2's ``Shard(0)`` of A,
vanilla TP) is all-gathered once per exact step and re-sharded locally after it; the
rows it leaves sharded stay sharded. The step is equivariant to row permutations, so
``_StridedShard`` rows (FSDP2 x TP) need no reordering.

Signs: QR and SVD are unique only up to the sign of each column. Every QR here returns
R with a non-negative diagonal and every SVD pair has the largest-magnitude entry of
its left vector positive, so the result does not depend on how rows are split.
"""

from __future__ import annotations

import math
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


def tangent_core(M, N, dM, dN, lr: float, m_groups: list[Group], n_groups: list[Group]):
    """The exact step up to its SVD, on local rows: project the gradient implied by the
    factor gradients onto the tangent space of the rank-r manifold at W = M N^T and step
    by ``lr``. Returns ``(U, Q2, V, Q1, core)``: W_new = [U Q2] core [V Q1]^T, where
    the 2r x 2r ``core`` is the same on every rank of the row groups."""
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
    return U, Q2, V, Q1, core


def core_factors(core: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The core's rank-r truncation as two balanced 2r x r factors (u_r s_r^1/2, v_r s_r^1/2)."""
    r = core.shape[0] // 2
    u, s, vh = svd_signed(core)
    root = s[:r].sqrt()
    return u[:, :r] * root, vh[:r].T * root


def group_size(groups: list[Group]) -> int:
    return math.prod(mesh.size(dim) for mesh, dim in groups)


def shared_core_factors(cores: list[torch.Tensor], groups: list[Group]):
    """:func:`core_factors` of each core, each computed on ONE rank of ``groups``: the
    cores (identical on every rank of the groups, at most one per rank, all of one shape)
    are taken round-robin, rank i (row-major over the groups) factors core i, and one
    all-gather per mesh dimension hands every rank all the results. Bitwise equal to
    factoring every core on every rank (same op on the same input, then a copy); ranks
    past the last core repeat it (they would wait for the all-gather anyway)."""
    size = group_size(groups)
    if not 0 < len(cores) <= size:
        raise ValueError(f"shared_core_factors: {len(cores)} cores for {size} ranks")
    i = 0
    for mesh, dim in groups:
        i = i * mesh.size(dim) + mesh.get_local_rank(dim)
    padded = cores + [cores[-1]] * (size - len(cores))
    if isinstance(i, int):
        mine = padded[i]
    else:  # LocalTensorMode (tests): the rank is per-rank symbolic, pick by slicing
        n = cores[0].shape[0]
        mine = torch.cat(padded)[i * n : (i + 1) * n].clone()
    out = torch.stack(core_factors(mine))  # [2, 2r, r]
    for group in reversed(groups):  # innermost first: row-major rank order
        out = _all_gather_rows(out, group)
    # clones: fresh tensors like core_factors' own results (same alignment downstream)
    return [(out[2 * j].clone(), out[2 * j + 1].clone()) for j in range(len(cores))]


def finish(U, Q2, V, Q1, Fm, Fn):
    """New factor rows from the bases and the core's factors: [U Q2] Fm, [V Q1] Fn."""
    return torch.cat([U, Q2], dim=1) @ Fm, torch.cat([V, Q1], dim=1) @ Fn


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


def share_groups(up: torch.Tensor, down: torch.Tensor, name: str) -> list[Group]:
    """The mesh dimensions whose ranks all hold (shards or copies of) this factor pair and
    so compute the same 2r x 2r core: every dimension of size > 1 of the factors' mesh."""
    if not isinstance(up, DTensor):
        return []
    mesh = up.device_mesh
    if not isinstance(down, DTensor) or down.device_mesh != mesh:
        raise ValueError(f"LORO: the factors of {name} do not live on one device mesh")
    return [(mesh, i) for i in range(mesh.ndim) if mesh.size(i) > 1]


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
