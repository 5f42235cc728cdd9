"""Planner: communication, GEMM shapes / arithmetic intensity and per-rank memory of
every tensor-parallel plan for a model, without running it.

    boost-titan plan --model cola_llama2 --flavor 7b --tp 4 --batch 4 --seq 4096

(the command and its report: :mod:`boost_titan.perf.plan_cli`)

Collectives are listed exactly as the plans issue them (tests compare them with the
counted ones). "Volume" is the all-reduce-equivalent payload the BOOST paper reports:
an all-reduce of n elements counts n, an all-gather or reduce-scatter of a tensor of n
elements counts n / 2 (on a ring, all-reduce = reduce-scatter + all-gather).

Memory per rank is traced, not estimated: each valid plan is built as the trainer
builds it and stepped under FakeTensorMode (``boost_titan.perf.dryrun.plans``: the dry run's
trace at TP alone, one micro-batch, no activation checkpointing, weights, gradients,
AdamW states and activations in ``--dtype``; ~15 s for a 7B model on 2 CPU cores).
Activations match the bytes autograd saves on real ranks (``boost-titan
bench``, checked in tests/test_plan.py); parameters, gradients and
optimizer states are exact. For a whole layout (FSDP, PP, mixed precision,
checkpointing) use ``boost-titan dryrun``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from boost_titan.config import LOW_RANK_TP_PLANS
from boost_titan.observability.comm_stats import allreduce_equivalent
from boost_titan.perf.dryrun.plans import PlanMemory, trace_plans

if TYPE_CHECKING:  # importing the model imports torchtitan: main() activates CPU mode first
    from boost_titan.models.args import LlamaArgs

GIB = 2**30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# baselines first, then BTP; btp_sp: BTP with [boost] sequence_parallel = true
PLANS = ("fullrank", *reversed(LOW_RANK_TP_PLANS), "btp_sp")


@dataclass
class Collective:
    op: str  # all_reduce | all_gather | reduce_scatter
    numel: int  # full logical tensor: reduced / gathered output / scattered input
    what: str
    elem_bytes: int = 0  # 0: the run's dtype

    @property
    def volume(self) -> float:
        return allreduce_equivalent(self.op, self.numel)


@dataclass
class Gemm:
    name: str
    m: int
    k: int
    n: int

    def intensity(self, nbytes: int) -> float:
        return (
            2
            * self.m
            * self.n
            * self.k
            / (nbytes * (self.m * self.k + self.k * self.n + self.m * self.n))
        )


@dataclass
class PlanReport:
    plan: str
    valid: bool
    why_invalid: str = ""
    forward: list[Collective] = field(default_factory=list)
    backward: list[Collective] = field(default_factory=list)
    gemms: list[Gemm] = field(default_factory=list)
    params_per_rank: int = 0
    memory: PlanMemory | None = None  # traced; None: not traced (invalid, or memory=False)


def block_collectives(
    args: LlamaArgs,
    plan: str,
    tp: int,
    tokens: int,
    grouped: bool = True,
    norm: str = "online",
    dtype: str = "float32",
) -> tuple[list[Collective], list[Collective]]:
    """One block's collectives in issue order, forward and backward (BTP's fused
    statistics: 1 column in fp32, 2T exact hi/lo columns in 16-bit dtypes)."""
    d, f, kv, q = args.dim, args.ffn_dim, args.kv_dim, args.n_heads * args.head_dim
    t = tokens
    if plan == "fullrank":  # torchtitan's Megatron + sequence parallel
        fwd = [
            Collective("all_gather", t * d, "attention_norm -> attention"),
            Collective("reduce_scatter", t * d, "wo"),
            Collective("all_gather", t * d, "ffn_norm -> feed_forward"),
            Collective("reduce_scatter", t * d, "w2"),
        ]
        bwd = [
            Collective("all_gather", t * d, "w2 grad"),
            Collective("reduce_scatter", t * d, "feed_forward grad"),
            Collective("all_gather", t * d, "wo grad"),
            Collective("reduce_scatter", t * d, "attention grad"),
        ]
        return fwd, bwd
    shapes = args.projection_shapes()
    r = {n: s[2] for n, s in shapes.items()}
    if plan == "vanilla":
        fwd, bwd = [], []
        lax = args.arch == "lax"
        outs = {"wq": q, "wk": kv, "wv": kv, "wo": d, "w1": f, "w3": f, "w2": d}
        for members in (["wq", "wk", "wv"], ["wo"], ["w1", "w3"], ["w2"]):
            if lax:  # LaX gathers whole latents for its gate and norm
                fwd += [
                    Collective("all_gather", t * r[n], f"{n} latent for the LaX crossing")
                    for n in members
                ]
            fwd += [Collective("all_reduce", t * outs[n], f"{n}.up output") for n in members]
        # backward, in reverse: per A group its input gradient (after the LaX latents' grads)
        groups = [
            ("w2", f, ["w2"]),
            ("w1|w3", d, ["w1", "w3"]),
            ("wo", d, ["wo"]),
            ("wq|wk|wv", d, ["wq", "wk", "wv"]),
        ]
        for label, width, members in groups:
            if lax:
                bwd += [
                    Collective("all_gather", t * r[m], f"{m} latent grad")
                    for m in reversed(members)
                ]
            bwd.append(Collective("all_reduce", t * width, f"{label}.down input grad"))
        return fwd, bwd
    if plan == "btp":
        s = (1 if dtype == "float32" else 2 * tp) if norm == "online" else 0
        sync_f = [Collective("all_reduce", t, "norm statistics")] if norm == "sync" else []
        sync_b = [Collective("all_reduce", t, "norm statistics grad")] if norm == "sync" else []
        if grouped:
            fwd = (
                sync_f
                + [
                    Collective(
                        "all_reduce", t * (r["wq"] + r["wk"] + r["wv"] + s), "A_q|A_k|A_v (+ stats)"
                    ),
                    Collective("all_reduce", t * r["wo"], "A_o"),
                ]
                + sync_f
                + [
                    Collective("all_reduce", t * (r["w1"] + r["w3"] + s), "A_gate|A_up (+ stats)"),
                    Collective("all_reduce", t * r["w2"], "A_down"),
                ]
            )
            bwd = (
                [
                    Collective("all_reduce", t * r["w2"], "B_down latent grad"),
                    Collective("all_reduce", t * (r["w1"] + r["w3"]), "B_gate,B_up latent grad"),
                ]
                + sync_b
                + [
                    Collective("all_reduce", t * r["wo"], "B_o latent grad"),
                    Collective(
                        "all_reduce", t * (r["wq"] + r["wk"] + r["wv"]), "B_q,B_k,B_v latent grad"
                    ),
                ]
                + sync_b
            )
        else:
            fwd = (
                sync_f
                + [
                    Collective("all_reduce", t * (r["wq"] + s), "A_q (+ stats)"),
                    Collective("all_reduce", t * r["wk"], "A_k"),
                    Collective("all_reduce", t * r["wv"], "A_v"),
                    Collective("all_reduce", t * r["wo"], "A_o"),
                ]
                + sync_f
                + [
                    Collective("all_reduce", t * (r["w1"] + s), "A_gate (+ stats)"),
                    Collective("all_reduce", t * r["w3"], "A_up"),
                    Collective("all_reduce", t * r["w2"], "A_down"),
                ]
            )
            bwd = (
                [Collective("all_reduce", t * r[n], f"{n} latent grad") for n in ("w2", "w3", "w1")]
                + sync_b
                + [
                    Collective("all_reduce", t * r[n], f"{n} latent grad")
                    for n in ("wo", "wv", "wk", "wq")
                ]
                + sync_b
            )
        return fwd, bwd
    if plan == "btp_sp":
        return _btp_sequence_parallel_collectives(r, tp, t, grouped, dtype)
    raise ValueError(f"unknown plan {plan!r}; valid: {list(PLANS)}")


def _btp_sequence_parallel_collectives(r: dict, tp: int, t: int, grouped: bool, dtype: str):
    """BTP with sequence-parallel latents (``BTPSequenceComm``): per latent group a
    reduce-scatter after A (with the statistics columns) and an all-gather before B;
    backward per group the B input rebuilt (all-gather), its gradient reduce-scattered,
    the A output's gradient all-gathered (16-bit: the fp32 statistic's gradient too)."""
    s = 1 if dtype == "float32" else 2 * tp
    chunks = [("q", "k", "v"), ("o",), ("gate", "up"), ("down",)]
    name = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w1", "up": "w3", "down": "w2"}
    fwd, bwd = [], []
    for chunk in chunks:
        # the A's of a chunk share its input: one latent each, or one for all (grouped);
        # the first carries the norm's statistics (q|k|v and gate|up)
        latents = [chunk] if grouped else [(a,) for a in chunk]
        stats = [len(chunk) > 1 and i == 0 for i in range(len(latents))]
        widths = [sum(r[name[a]] for a in latent) for latent in latents]
        labels = ["A_" + "|A_".join(latent) for latent in latents]
        fwd += [
            Collective("reduce_scatter", t * (w + (s if st else 0)), f"{lb}{' (+ stats)' * st}")
            for w, st, lb in zip(widths, stats, labels)
        ]
        fwd += [
            Collective("all_gather", t * w, f"{lb} latent -> B") for w, lb in zip(widths, labels)
        ]
    for chunk in reversed(chunks):
        latents = [chunk] if grouped else [(a,) for a in chunk]
        stats = [len(chunk) > 1 and i == 0 for i in range(len(latents))]
        widths = [sum(r[name[a]] for a in latent) for latent in latents]
        labels = ["A_" + "|A_".join(latent) for latent in latents]
        for w, lb in reversed(list(zip(widths, labels))):
            bwd += [
                Collective("all_gather", t * w, f"{lb} latent regathered for B's weight grad"),
                Collective("reduce_scatter", t * w, f"{lb} latent grad (B input)"),
            ]
        for w, st, lb in reversed(list(zip(widths, stats, labels))):
            if st and dtype != "float32":  # autograd reaches the statistic's slice first
                bwd.append(Collective("all_gather", t, "norm statistics grad (fp32)", elem_bytes=4))
            bwd.append(
                Collective("all_gather", t * (w + (s if st else 0)), f"{lb} partial latent grad")
            )
    return fwd, bwd


def block_gemms(args: LlamaArgs, plan: str, tp: int, tokens: int) -> list[Gemm]:
    """Per-rank forward GEMMs of one block: [m, k] x [k, n]."""
    m, T = tokens, tp
    out = []
    for name, (din, dout, r) in args.projection_shapes().items():
        if plan == "fullrank":
            if name in ("wo", "w2"):
                out.append(Gemm(name, m, din // T, dout))
            else:
                out.append(Gemm(name, m, din, dout // T))
        elif plan == "vanilla":
            out += [Gemm(f"{name}.A", m, din, r // T), Gemm(f"{name}.B", m, r // T, dout)]
        else:
            out += [Gemm(f"{name}.A", m, din // T, r), Gemm(f"{name}.B", m, r, dout // T)]
    return out


def _sequence_parallel_applies(args: LlamaArgs, tp: int, seq: int, norm: str) -> tuple[bool, str]:
    if args.arch == "lax":
        return False, "sequence-parallel latents do not support LaX"
    if norm != "online":
        return False, "sequence-parallel latents need rmsnorm = 'online'"
    if seq % tp:
        return False, f"seq {seq} is not divisible by TP {tp}"
    return True, ""


def params_per_rank(args: LlamaArgs, plan: str, tp: int) -> int:
    from boost_titan.models.args import kron_factors

    d, V, L = args.dim, args.vocab_size, args.n_layers
    shapes = args.projection_shapes()
    if plan == "fullrank":
        block = sum(i * o for i, o, _ in shapes.values()) // tp + 2 * d
    else:
        block = sum(r * (i + o) for i, o, r in shapes.values()) // tp
        block += 2 * d // tp if plan in ("btp", "btp_sp") else 2 * d
        if args.arch == "lax":
            gate = lambda r: (
                r * r if args.lax_gate == "dense" else sum(x * x for x in kron_factors(r))
            )
            block += (sum(gate(r) + 2 * r for _, _, r in shapes.values()) * (L - 1)) // L
    return L * block + 2 * V * d // tp + d


def analyse(
    args: LlamaArgs,
    tp: int,
    batch: int,
    seq: int,
    dtype: str = "bfloat16",
    grouped: bool = True,
    norm: str = "online",
    memory: bool = True,
    trace_in_process: bool = False,
) -> dict:
    """Every plan's collectives, GEMMs and parameters per rank; ``memory``: also its
    traced per-rank memory (see the module docstring), in a fresh process or, with
    ``trace_in_process``, in this one (see ``trace_plans``)."""
    from boost_titan.tp_plans import validate_tp_degree

    nbytes = DTYPE_BYTES[dtype]
    tokens = batch * seq
    dense_twin = args.with_overrides(arch="dense", rank=0)
    reports = {}
    for plan in PLANS:
        a = dense_twin if plan == "fullrank" else args
        if plan != "fullrank" and not args.low_rank:
            reports[plan] = PlanReport(plan, False, "plan needs a low-rank model")
            continue
        rep = PlanReport(plan, True)
        try:
            validate_tp_degree(a, tp, plan)
        except ValueError as e:
            rep.valid, rep.why_invalid = False, str(e)
        if plan == "btp_sp" and rep.valid:
            rep.valid, rep.why_invalid = _sequence_parallel_applies(args, tp, seq, norm)
        rep.forward, rep.backward = block_collectives(a, plan, tp, tokens, grouped, norm, dtype)
        rep.gemms = block_gemms(a, plan, tp, tokens)
        rep.params_per_rank = params_per_rank(a, plan, tp)
        reports[plan] = rep
    if memory:
        traced = trace_plans(
            {
                p: (dense_twin if p == "fullrank" else args.with_overrides(group_linears=grouped))
                for p, rep in reports.items()
                if rep.valid
            },
            tp,
            batch,
            seq,
            "bfloat16" if dtype == "float16" else dtype,  # no float16 training: same bytes
            norm,
            in_process=trace_in_process,
        )
        for p, m in traced.items():
            reports[p].memory = m

    def vol(cs):
        return sum(c.volume * (c.elem_bytes or nbytes) for c in cs)

    out = {
        "model": {
            "arch": args.arch,
            "dim": args.dim,
            "ffn_dim": args.ffn_dim,
            "n_layers": args.n_layers,
            "n_heads": args.n_heads,
            "n_kv_heads": args.kv_heads,
            "rank": args.rank,
            "kv_rank": args.effective_kv_rank,
        },
        "tp": tp,
        "batch": batch,
        "seq": seq,
        "dtype": dtype,
        "memory": (
            f"traced (TP{tp} alone, one micro-batch of {batch} x {seq}, no activation "
            f"checkpointing; weights, gradients, AdamW states and activations in {dtype})"
            if memory
            else "not traced"
        ),
        "plans": {},
    }
    for plan, rep in reports.items():
        entry = {"valid": rep.valid, "why_invalid": rep.why_invalid}
        if rep.forward or rep.backward:
            entry.update(
                block_forward=[asdict(c) for c in rep.forward],
                block_backward=[asdict(c) for c in rep.backward],
                block_forward_bytes=vol(rep.forward),
                block_backward_bytes=vol(rep.backward),
                step_forward_bytes=vol(rep.forward) * args.n_layers,
                step_backward_bytes=vol(rep.backward) * args.n_layers,
                gemms=[dict(asdict(g), intensity=round(g.intensity(nbytes), 1)) for g in rep.gemms],
                params_per_rank=rep.params_per_rank,
                **_memory_entry(rep.memory),
            )
        out["plans"][plan] = entry
    low_rank = [p for p in LOW_RANK_TP_PLANS if out["plans"][p]["valid"]]
    if low_rank:
        best = min(
            low_rank,
            key=lambda p: (
                out["plans"][p]["block_forward_bytes"] + out["plans"][p]["block_backward_bytes"]
            ),
        )
        out["recommended"] = best
        out["why"] = (
            f"least communication among valid low-rank plans "
            f"({', '.join(low_rank)}); GEMMs keep full reduction dims"
        )
    else:
        out["recommended"] = "fullrank" if out["plans"]["fullrank"]["valid"] else None
        out["why"] = "no low-rank plan applies" if args.low_rank else "dense model"
    return out


def _memory_entry(m: PlanMemory | None) -> dict:
    """Per-rank bytes in the JSON report (None where not traced)."""
    keys = ("params", "grads", "optimizer", "activation", "total")
    if m is None:
        return {f"{k}_bytes_per_rank": None for k in keys} | {"activation_breakdown": None}
    values = (m.params, m.grads, m.optimizer, m.activations, m.total)
    return {f"{k}_bytes_per_rank": v for k, v in zip(keys, values)} | {
        "activation_breakdown": m.activation_breakdown
    }
