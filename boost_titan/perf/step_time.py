"""Step-time model: the time of one training step of a layout, term by term, from the
planner's exact shapes (``boost_titan.perf.plan``: per-rank GEMMs, collectives) and a GPU
of :mod:`boost_titan.perf.hardware`.

    boost-titan step-time --model cola_llama2 --flavor 7b --gpu a100-40 --tp 4
    boost-titan step-time --paper            # the calibration table (A100)
    boost-titan step-time --paper --calibrate outputs/gpu_check/gpu_check.json

(the command: :mod:`boost_titan.perf.step_time_cli`)

Terms, per rank (every one printed in the breakdown):

* GEMMs: each per-rank GEMM ``[m,k] x [k,n]`` of a block (``plan.block_gemms``) and the
  LM head, forward once and backward twice (input and weight gradient: the same m, n,
  k), on a roofline whose two limits add (no overlap of a GEMM's operand traffic with
  its math): ``t = 2mnk / (e_gemm peak) + 2(mk + kn + mn) / (e_hbm HBM)``. The plain
  ``min(peak, AI x HBM)`` puts every GEMM of these models above the A100's ridge (153
  FLOP/byte) and so gives vanilla's r/T-thin GEMMs (AI ~250) BTP's efficiency (AI ~700),
  against the paper's measured 62% vs 74% HFU; the sum gives 0.62 vs 0.82 of e_gemm.
* attention: flash attention's FLOPs (causal: half of ``4 b s^2 h_local hd`` forward,
  2.5x that backward) at ``e_gemm peak``. Under vanilla every rank runs every head.
* elementwise: the bytes each memory-bound op of a block reads and writes (RMSNorms,
  residual adds, RoPE, SwiGLU, latent SiLU, LaX's latent norm and crossing; backward
  twice the forward) and the loss's fp32 logits, at ``e_hbm HBM``.
* TP collectives: each of ``plan.block_collectives`` on a ring, not overlapped (they sit
  on the critical path between GEMMs): all-reduce ``2(n-1)/n B/bw + 2(n-1) alpha``,
  all-gather / reduce-scatter ``(n-1)/n B/bw + (n-1) alpha``, ``bw = e_link x`` the
  one-way NVLink figure (the network's, when the group leaves a node).
* recompute: the chunks latent checkpointing re-runs in backward (no collective; with
  sequence-parallel latents the re-gathers), or torchtitan's full AC (the whole block
  forward, its collectives included).
* CP: each rank holds ``s/cp`` of every sequence (every term above on ``b s/cp``
  tokens) and runs ``1/cp`` of the causal attention tiles (torch's load-balanced
  shards). The ring is torch's default ("allgather", torchtitan's
  ``context_parallel_rotate_method``): forward all-gathers K and V over the CP group,
  backward all-gathers them again and passes the fp32 dK/dV partial sums around the ring
  (``cp - 1`` hops). Each gather overlaps the local shard's tile, each dK/dV hop one
  tile's backward; only the excess is exposed. FSDP shards over ``dp_shard x cp``
  (torchtitan's ``dp_shard_cp`` mesh). CP's group is the ``cp`` ranks ``tp`` apart.
* PP: the bubble of the schedule (1F1B/GPipe ``(p-1)`` stage-microbatch times,
  Interleaved1F1B ``(p-1)/v``) and the send/recv of each stage boundary.
* FSDP: per block, the all-gather of its bf16 parameters (forward; backward again when
  resharded after forward) and the reduce-scatter of its fp32 gradients (HSDP: plus
  the all-reduce across replicas), overlapped with that block's compute as torchtitan's
  prefetch schedules them: only ``max(0, comm - compute)`` per block, the first
  all-gather and the last reduce-scatter, and the stack ends' (embedding, LM head),
  are exposed. Under PP parameters stay gathered across the step's microbatches
  (torchtitan: no reshard after forward) and gradients reduce once.
* optimizer: AdamW over the local parameter shard, 32 bytes per parameter (fp32
  parameter, gradient, two moments read; parameter, moments written; the gradient
  norm's read) at ``e_hbm HBM``.

Free parameters, each a physical fraction (fitted; ``--paper`` shows the fit):
``e_gemm`` the fraction of peak bf16 a large GEMM reaches, ``e_hbm`` the fraction of HBM
bandwidth memory-bound kernels reach, ``e_link`` the fraction of the link's one-way
bandwidth a ring collective reaches. ``alpha``, the latency of one ring step, is fixed
at 5 us (the order of NCCL's per-hop latency over NVLink), not fitted: at the paper's
points it is 2-7% of the TP time, too little for the times to pin it down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from boost_titan.perf.hardware import GPU

BF16 = 2
FP32 = 4
ADAMW_BYTES_PER_PARAM = 32
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
CHECKPOINTS = ("none", "mlp", "attention", "both", "full")


@dataclass(frozen=True)
class Efficiency:
    """The model's free parameters (see the module docstring)."""

    gemm: float = 0.80
    hbm: float = 0.80
    link: float = 0.80
    alpha_s: float = 5e-6

    def fitted(self) -> tuple[float, float, float]:
        return self.gemm, self.hbm, self.link


@dataclass(frozen=True)
class Layout:
    """One training layout. ``microbatches``: per step per data-parallel replica (PP:
    the schedule's microbatches; without PP: gradient accumulation steps)."""

    plan: str  # fullrank | vanilla | btp | btp_sp
    tp: int = 1
    pp: int = 1
    dp_shard: int = 1
    dp_replicate: int = 1
    micro_batch: int = 4
    seq: int = 4096
    microbatches: int = 1
    schedule: str = "1F1B"
    stages_per_rank: int = 1
    checkpoint: str = "none"  # none | mlp | attention | both (latent) | full (torchtitan AC)
    gpus_per_node: int = 8
    cp: int = 1  # context parallel: each rank holds seq / cp of every sequence

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp_shard * self.dp_replicate

    @property
    def fsdp(self) -> int:
        """The ranks FSDP shards parameters over: torchtitan folds CP into it."""
        return self.dp_shard * self.cp

    @property
    def local_seq(self) -> int:
        return self.seq // self.cp

    @property
    def tokens_per_step(self) -> int:
        return self.micro_batch * self.seq * self.microbatches * self.dp_shard * self.dp_replicate

    def describe(self) -> str:
        parts = [f"TP{self.tp}"] + ([f"CP{self.cp}"] if self.cp > 1 else [])
        if self.pp > 1:
            v = f" v{self.stages_per_rank}" if self.stages_per_rank > 1 else ""
            parts.append(f"PP{self.pp} {self.schedule}{v}")
        if self.dp_replicate > 1:
            parts.append(f"HSDP{self.dp_replicate}x{self.dp_shard}")
        elif self.dp_shard > 1:
            parts.append(f"FSDP{self.dp_shard}")
        return (
            " x ".join(parts)
            + f", {self.plan}, mb {self.micro_batch} x {self.microbatches}, ckpt {self.checkpoint}"
        )


@dataclass
class Breakdown:
    """Seconds per step by term; ``step_s`` their sum."""

    terms: dict[str, float] = field(default_factory=dict)
    layout: Layout | None = None
    ring_bytes_per_step: float = 0.0  # CP: what one rank receives in the ring, per step

    @property
    def step_s(self) -> float:
        return sum(self.terms.values())

    def tokens_per_s(self) -> float:
        return self.layout.tokens_per_step / self.step_s

    def format(self) -> str:
        total = self.step_s
        lines = [f"{k:34s} {v * 1e3:10.1f} ms  {v / total:6.1%}" for k, v in self.terms.items()]
        lines.append(f"{'step':34s} {total * 1e3:10.1f} ms")
        if self.ring_bytes_per_step:
            lines.append(
                f"CP ring bytes per step per rank {self.ring_bytes_per_step / 2**30:.2f} GiB"
            )
        return "\n".join(lines)


# ----------------------------------------------------------------------------- pieces


def ring_time(op: str, nbytes: float, n: int, bw: float, alpha: float) -> float:
    """Ring collective of a tensor of ``nbytes`` (all-reduce: the reduced tensor;
    all-gather: the gathered output; reduce-scatter: the scattered input) on ``n``
    ranks at ``bw`` bytes/s per rank, ``alpha`` seconds per step."""
    if n <= 1:
        return 0.0
    steps = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1}[op] * (n - 1)
    return steps / n * nbytes / bw + steps * alpha


def gemm_time(m: int, k: int, n: int, hw: GPU, eff: Efficiency) -> float:
    flops = 2 * m * k * n
    nbytes = BF16 * (m * k + k * n + m * n)
    return flops / (eff.gemm * hw.peak_bf16_flops) + nbytes / (eff.hbm * hw.hbm_bytes_per_s)


def _local_widths(args, plan: str, tp: int) -> dict:
    """Per-rank widths of a block's tensors (the token count aside)."""
    d, f = args.dim, args.ffn_dim
    q, kv = args.n_heads * args.head_dim, args.kv_dim
    ranks = {n: s[2] for n, s in args.projection_shapes().items()} if plan != "fullrank" else {}
    if plan == "fullrank":  # Megatron + sequence parallel: the residual stream is s/T
        return dict(res=d / tp, q=q / tp, kv=kv / tp, f=f / tp, heads=args.n_heads / tp, lat={})
    if plan == "vanilla":  # residual, attention and SwiGLU replicated; latents split on r
        return dict(
            res=d, q=q, kv=kv, f=f, heads=args.n_heads, lat={n: r / tp for n, r in ranks.items()}
        )
    lat_div = tp if plan == "btp_sp" else 1  # BTP: latents whole on every rank
    return dict(
        res=d / tp,
        q=q / tp,
        kv=kv / tp,
        f=f / tp,
        heads=args.n_heads / tp,
        lat={n: r / lat_div for n, r in ranks.items()},
    )


_ATTN_PROJ = ("wq", "wk", "wv", "wo")
_MLP_PROJ = ("w1", "w3", "w2")


def _elementwise_bytes(args, w: dict, t: int, part: str = "all") -> float:
    """Forward bytes of a block's memory-bound ops (read + write, bf16), ``part``:
    all | attention (norm, RoPE, attention-side latents) | mlp."""
    res = w["res"]
    b = 0.0
    if part in ("all", "attention"):
        b += 2 * res + 3 * res  # attention_norm (read, write) + residual add (2 reads, write)
        b += 2 * (w["q"] + w["kv"])  # RoPE on q, k
    if part in ("all", "mlp"):
        b += 2 * res + 3 * res  # ffn_norm + residual add
        b += (5 if args.swiglu else 3) * w["f"]  # silu(gate) * up, or gate * up
    for name, r in w["lat"].items():
        if part != "all" and (name in _ATTN_PROJ) != (part == "attention"):
            continue
        if args.activation != "none":
            b += 2 * r  # SiLU on the latent
        if args.arch == "lax":
            b += 2 * r + 3 * r  # the latent's LayerNorm and the crossing's add
    return BF16 * t * b


def _gemms(args, plan: str, tp: int, t: int, part: str = "all") -> list:
    from boost_titan.perf.plan import block_gemms

    gs = block_gemms(args, plan, tp, t)
    if part == "all":
        return gs
    names = _ATTN_PROJ if part == "attention" else _MLP_PROJ
    return [g for g in gs if g.name.split(".")[0] in names]


def _lax_gate_flops(args, w: dict, t: int) -> float:
    if args.arch != "lax":
        return 0.0
    # the crossing gate runs on each latent (under vanilla on the gathered whole latent)
    return 2 * t * sum(args.gate_macs(int(r)) for r in w["lat"].values())


def _attention_flops(args, w: dict, b: int, s: int) -> float:
    """Flash attention forward, causal (half the tiles)."""
    return 0.5 * 4 * b * s * s * w["heads"] * args.head_dim


# ------------------------------------------------------------------------------ model


def block_plan_args(args, plan: str):
    """The model a plan runs: full-rank is the dense twin of a low-rank model."""
    return args.with_overrides(arch="dense", rank=0) if plan == "fullrank" else args


def step_time(args, layout: Layout, hw: GPU, eff: Efficiency) -> Breakdown:
    """One step's time per rank, term by term (see the module docstring)."""
    from boost_titan.perf.plan import block_collectives, params_per_rank

    L = layout
    plan = L.plan
    a = block_plan_args(args, plan)
    base_plan = "btp" if plan == "btp_sp" else plan
    b, s, T = L.micro_batch, L.seq, L.tp
    if s % (2 * L.cp * T):
        raise ValueError(f"seq {s}: must be divisible by 2 x cp {L.cp} x tp {T}")
    t = b * L.local_seq  # tokens this rank holds (CP: its 1/cp of each sequence)
    w = _local_widths(a, plan, T)
    link = _link_bw(hw, eff, L, span=T, n=T)
    alpha = eff.alpha_s

    # --- one block, one microbatch
    g_fwd = sum(gemm_time(g.m, g.k, g.n, hw, eff) for g in _gemms(a, base_plan, T, t))
    g_fwd += _lax_gate_flops(a, w, t) / (eff.gemm * hw.peak_bf16_flops)
    attn_fwd = _attention_flops(a, w, b, s) / L.cp / (eff.gemm * hw.peak_bf16_flops)
    ew_fwd = _elementwise_bytes(a, w, t) / (eff.hbm * hw.hbm_bytes_per_s)
    fwd_c, bwd_c = block_collectives(a, plan, T, t, dtype="bfloat16")

    def comm(cs) -> float:
        return sum(ring_time(c.op, c.numel * (c.elem_bytes or BF16), T, link, alpha) for c in cs)

    tp_fwd, tp_bwd = comm(fwd_c), comm(bwd_c)
    recompute = _recompute(a, plan, L, w, t, hw, eff, g_fwd, attn_fwd, ew_fwd, tp_fwd, comm)
    block_fwd = g_fwd + attn_fwd + ew_fwd
    block_bwd = 2 * g_fwd + 2.5 * attn_fwd + 2 * ew_fwd

    # --- the stack's ends, one microbatch: LM head (vocab-parallel) and the fp32 loss
    V, d = a.vocab_size, a.dim
    head = 3 * gemm_time(t, d, math.ceil(V / T), hw, eff)
    loss = t * V / T * 24 / (eff.hbm * hw.hbm_bytes_per_s)  # bf16 logits -> fp32, softmax, grad
    ends_tp = 0.0
    if T > 1:  # the hidden state into the head gathered, the embedding's output reduced
        ends_tp = 2 * (
            ring_time("all_gather", t * d * BF16, T, link, alpha)
            + ring_time("reduce_scatter", t * d * BF16, T, link, alpha)
        )

    # --- per rank per microbatch: this rank's share of the layers (stages balanced)
    layers = a.n_layers / L.pp
    per_mb = {
        "GEMMs (fwd + 2x bwd)": layers * 3 * g_fwd + head / L.pp,
        "attention (flash, fwd + bwd)": layers * 3.5 * attn_fwd,
        "elementwise (HBM-bound)": layers * 3 * ew_fwd + loss / L.pp,
        "TP collectives (exposed)": layers * (tp_fwd + tp_bwd) + ends_tp / L.pp,
        "CP ring attention (exposed)": layers * _ring_exposed(L, w, t, hw, eff, attn_fwd),
        "recompute (checkpointing)": layers * recompute,
    }
    n = L.microbatches
    terms = {k: n * v for k, v in per_mb.items()}
    mb_time = sum(per_mb.values())
    terms["PP bubble"] = _bubble(L) * mb_time
    terms["PP send/recv"] = _p2p(a, L, w, t, hw, eff)

    # --- FSDP / HSDP, overlapped per block with that block's compute
    params_tp = params_per_rank(a, base_plan, T)
    ends_params = 2 * V * d / T + d
    block_params = (params_tp - ends_params) / a.n_layers
    terms["FSDP/HSDP comm (exposed)"] = _fsdp_exposed(
        L, hw, eff, block_params, ends_params, layers, block_fwd, block_bwd
    )
    local_params = params_tp / L.pp / L.fsdp
    terms["optimizer (AdamW)"] = (
        local_params * ADAMW_BYTES_PER_PARAM / (eff.hbm * hw.hbm_bytes_per_s)
    )
    ring = ring_bytes(L, w, t)
    ring_step = 2 * ring["kv_all_gather"] + (L.cp - 1) * ring["dkv_hop"]
    return Breakdown(terms, layout, layers * n * ring_step)


def _link_bw(hw: GPU, eff: Efficiency, L: Layout, span: int, n: int) -> float:
    """A group of ``n`` ranks whose first and last are ``span`` ranks apart (counting
    both): NVLink within a node, the network per GPU across nodes."""
    if span > L.gpus_per_node:
        return eff.link * hw.internode_bytes_per_s
    return eff.link * hw.nvlink_group_one_way(n)


def ring_bytes(L: Layout, w: dict, t: int) -> dict[str, float]:
    """One block, one microbatch, CP's traffic per rank (bytes received): the K/V
    all-gather (forward, and again in backward) and the fp32 dK/dV ring hops."""
    if L.cp == 1:
        return {"kv_all_gather": 0.0, "dkv_hop": 0.0}
    kv = 2 * t * w["kv"]  # this rank's K and V elements
    return {"kv_all_gather": (L.cp - 1) * kv * BF16, "dkv_hop": kv * FP32}


def _ring_exposed(L: Layout, w: dict, t: int, hw: GPU, eff: Efficiency, attn_fwd: float) -> float:
    """Per block per microbatch: the ring's time not hidden behind attention tiles
    (see the module docstring); ``attn_fwd``: this rank's whole forward attention."""
    if L.cp == 1:
        return 0.0
    nb = ring_bytes(L, w, t)
    bw = _link_bw(hw, eff, L, span=L.tp * L.cp, n=L.cp)
    gather = nb["kv_all_gather"] / bw + (L.cp - 1) * eff.alpha_s
    hop = nb["dkv_hop"] / bw + eff.alpha_s
    tile_fwd, tile_bwd = attn_fwd / L.cp, 2.5 * attn_fwd / L.cp
    return (
        max(0.0, gather - tile_fwd)  # forward
        + max(0.0, gather - tile_bwd)  # backward's re-gather
        + (L.cp - 1) * max(0.0, hop - tile_bwd)
    )


def _recompute(a, plan, L, w, t, hw, eff, g_fwd, attn_fwd, ew_fwd, tp_fwd, comm) -> float:
    """Per block, the forward work checkpointing runs again in backward."""
    if L.checkpoint == "none":
        return 0.0
    if L.checkpoint == "full":  # torchtitan AC: the whole block, collectives too
        return g_fwd + attn_fwd + ew_fwd + tp_fwd
    base = "btp" if plan == "btp_sp" else plan
    parts = ("attention", "mlp") if L.checkpoint == "both" else (L.checkpoint,)
    out = 0.0
    for part in parts:
        # latent_checkpoint_keep = "attention" (the default): attention's kernel output is
        # kept, so no part re-runs the kernel
        out += sum(gemm_time(g.m, g.k, g.n, hw, eff) for g in _gemms(a, base, L.tp, t, part))
        out += _elementwise_bytes(a, w, t, part) / (eff.hbm * hw.hbm_bytes_per_s)
        if plan == "btp_sp":  # the re-forward all-gathers its latents again
            from boost_titan.perf.plan import Collective

            lat = sum(r for n, r in w["lat"].items() if (n in _ATTN_PROJ) == (part == "attention"))
            out += comm([Collective("all_gather", int(t * lat * L.tp), "re-gather")])
    return out


def _bubble(L: Layout) -> float:
    """Idle time of the pipeline in units of one microbatch's time on a rank."""
    if L.pp == 1:
        return 0.0
    if L.schedule in ("1F1B", "GPipe"):
        return L.pp - 1
    if L.schedule == "Interleaved1F1B":
        return (L.pp - 1) / L.stages_per_rank
    raise ValueError(f"unknown pipeline schedule {L.schedule!r}; valid: {list(SCHEDULES)}")


def _p2p(a, L: Layout, w: dict, t: int, hw: GPU, eff: Efficiency) -> float:
    """Each microbatch: this rank sends one activation per local stage forward and one
    gradient backward (the local hidden state, as the dry run's stage inputs: d/T
    under btp and sequence-parallel full-rank, all of d under vanilla)."""
    if L.pp == 1:
        return 0.0
    # LaX hands its carried latents on whole with the hidden state (every plan)
    lax = sum(s[2] for s in a.projection_shapes().values()) if a.arch == "lax" else 0
    width = w["res"] + lax
    nbytes = t * width * BF16
    stride = L.world // L.pp  # ranks of consecutive stages are this far apart
    bw = _link_bw(hw, eff, L, span=stride + 1, n=2)
    return L.microbatches * 2 * L.stages_per_rank * (nbytes / bw + eff.alpha_s)


def _fsdp_exposed(L, hw, eff, block_params, ends_params, layers, block_fwd, block_bwd) -> float:
    if L.fsdp * L.dp_replicate == 1:
        return 0.0
    shard = L.fsdp  # dp_shard x cp ranks, tp apart
    bw_shard = _link_bw(hw, eff, L, span=L.tp * shard, n=shard)
    bw_rep = _link_bw(hw, eff, L, span=L.world // L.pp, n=L.dp_replicate)
    a_s = eff.alpha_s

    def ag(p):
        return ring_time("all_gather", p * BF16, shard, bw_shard, a_s)

    def rs(p):  # fp32 gradients; HSDP: the shard's all-reduce across replicas
        return ring_time("reduce_scatter", p * FP32, shard, bw_shard, a_s) + ring_time(
            "all_reduce", p * FP32 / shard, L.dp_replicate, bw_rep, a_s
        )

    ag_b, rs_b = ag(block_params), rs(block_params)
    reshard = L.pp == 1  # torchtitan: reshard after forward unless PP
    # per pass over the stack: the first all-gather and the last reduce-scatter are
    # exposed, every other block's hides behind its neighbour's compute where it can
    fwd = ag_b + max(0.0, ag_b - block_fwd) * (layers - 1)
    bwd_comm = rs_b + (ag_b if reshard else 0.0)
    bwd = rs_b + max(0.0, bwd_comm - block_bwd) * (layers - 1)
    ends = ag(ends_params / L.pp) + rs(ends_params / L.pp)
    if L.pp == 1:  # every microbatch gathers and reduces again (no no-sync in torchtitan)
        return L.microbatches * (fwd + bwd + ends)
    return fwd + bwd + ends  # gathered once per step, reduced at the last microbatch
