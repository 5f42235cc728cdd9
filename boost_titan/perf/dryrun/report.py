"""What a dry run reports per rank role, and whether it fits."""

from __future__ import annotations

from dataclasses import dataclass, field

GIB = 2**30


@dataclass
@dataclass
class RoleReport:
    role: str
    rank: int  # the representative global rank traced
    ranks: int  # how many ranks share this role
    stages: list[int]
    params_bytes: int
    grads_bytes: int
    optimizer_bytes: int
    stage_activation_bytes: list[int]  # one microbatch, per stage of this rank
    microbatches_in_flight: list[int]  # at the activation peak, per stage
    activation_peak_bytes: int
    peak_bytes: int
    tp_bytes_per_step: int
    tp_collectives_per_step: int
    notes: list[str] = field(default_factory=list)
    # the bytes autograd saves in one microbatch's forward of each stage, per block by
    # role and outside the blocks (``breakdown.ActivationBreakdown.to_json``); traced,
    # its saved_total may differ slightly from stage_activation_bytes (MemTracker's
    # allocations alive at the forward's end)
    activation_breakdown: dict | None = None


def budget_bytes(gpu_gib: float, headroom: float) -> float:
    """What the traced tensors may use: the GPU less ``headroom`` (a fraction) for what
    the trace does not see: CUDA context, NCCL buffers, allocator fragmentation."""
    return gpu_gib * GIB * (1 - headroom)


def fits(reports: list[RoleReport], gpu_gib: float, headroom: float = 0.1) -> bool:
    return all(r.peak_bytes <= budget_bytes(gpu_gib, headroom) for r in reports)


def format_reports(reports: list[RoleReport], gpu_gib: float, headroom: float) -> str:
    big = max(r.peak_bytes for r in reports) >= GIB
    unit, div = ("G", GIB) if big else ("M", 2**20)

    def b(n: int) -> str:
        return f"{n / div:8.2f}{unit}"

    lines = [
        f"{'role':14s} {'ranks':>5s} {'params':>9s} {'grads':>9s} {'optim':>9s} "
        f"{'act/mb':>9s} {'in flight':>10s} {'act peak':>9s} {'peak':>9s} {'TP/step':>9s}  fits"
    ]
    for r in reports:
        lines.append(
            f"{r.role:14s} {r.ranks:5d} {b(r.params_bytes)} {b(r.grads_bytes)} "
            f"{b(r.optimizer_bytes)} {b(max(r.stage_activation_bytes))} "
            f"{','.join(map(str, r.microbatches_in_flight)):>10s} "
            f"{b(r.activation_peak_bytes)} {b(r.peak_bytes)} {b(r.tp_bytes_per_step)}  "
            f"{'yes' if r.peak_bytes <= budget_bytes(gpu_gib, headroom) else 'NO'}"
        )
    lines += _format_breakdowns(reports, div, f"{unit}iB")
    return "\n".join(lines)


def _format_breakdowns(reports: list[RoleReport], div: int, unit: str) -> list[str]:
    """Per role: one microbatch's saved bytes per block by role, and at the stack's
    ends; where their sum differs from the traced act/mb (MemTracker), both."""
    from boost_titan.perf.dryrun.breakdown import ActivationBreakdown, format_breakdown

    lines = []
    for r in reports:
        if r.activation_breakdown is None:
            continue
        b = ActivationBreakdown.from_json(r.activation_breakdown)
        lines.append(f"activation per block ({r.role}): {format_breakdown(b, div, unit)}")
        act = sum(r.stage_activation_bytes)
        if b.saved_total != act:
            lines.append(
                f"  saved {b.saved_total} B vs act/mb {act} B ({b.saved_total - act:+d} B): "
                f"autograd's saved storages vs allocations alive at the forward's end"
            )
    return lines
