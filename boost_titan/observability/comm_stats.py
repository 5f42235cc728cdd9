"""Communication accounting: every collective's count and bytes, per module and phase.

    with CommCounter() as comm:
        loss = model(tokens).sum(); loss.backward()
    comm.summary()                  # {(phase, op): (count, bytes)}
    comm.block_records("layers.1", "forward")   # one block's collectives, in order

    with CollectiveHook(timed=True) as timer:   # time only: no module tracking, no records
        ...
    timer.seconds                   # wall time inside c10d ops, waits included

Both are one dispatch-mode hook, :class:`CollectiveHook`: every op of the c10d namespaces
passes through it (optionally timed), and each collective among them is handed to
``on_collective``, which :class:`CommCounter` overrides to record it. Compiled code
refuses dispatch modes; :func:`profiler_op` names the same collectives from torch.profiler
events instead.

Bytes are the logical payload of each collective on one rank: the tensor reduced by an
all-reduce, the gathered output of an all-gather, the input of a reduce-scatter. It is
independent of the algorithm the backend uses on the wire, which is what the planner's
closed forms count too. Works on real process groups and under LocalTensorMode.

Reports state volumes in one convention, the BOOST paper's and the planner's
*all-reduce-equivalent* bytes (:func:`allreduce_equivalent`): an all-reduce counts its
payload, an all-gather or reduce-scatter half of it (on a ring an all-reduce is a
reduce-scatter plus an all-gather, each moving half as much per rank).
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass

from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "c10d"}
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def allreduce_equivalent(op: str, nbytes: float) -> float:
    """``nbytes`` of payload of collective ``op`` in all-reduce-equivalent bytes. ``op``
    in any spelling: 'all_gather', 'all_gather_into_tensor', 'reduce_scatter_tensor'..."""
    return nbytes / 2 if op.startswith(("all_gather", "reduce_scatter")) else nbytes


@dataclass(frozen=True)
class CommRecord:
    phase: str  # "forward" | "backward"
    module: str  # innermost module FQN ("Global" outside any module)
    op: str  # e.g. "all_reduce"
    nbytes: int
    numel: int

    @property
    def volume(self) -> float:
        """All-reduce-equivalent bytes."""
        return allreduce_equivalent(self.op, self.nbytes)


_C10D_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "allgather_base": "all_gather",
    "reduce_scatter_base": "reduce_scatter",
    "alltoall": "all_to_all",
    "alltoall_base": "all_to_all",
    "allreduce_coalesced": "all_reduce",
}


def canonical_op(name: str) -> str:
    """functional and c10d spellings of one collective -> one name."""
    name = name.strip("_")
    return _C10D_NAMES.get(name, name)


def _payload(op: str, args, out) -> tuple[int, int]:
    tensor = out if op.startswith("all_gather") else args[0]
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0]
    return tensor.numel() * tensor.element_size(), tensor.numel()


def profiler_op(event_name: str) -> str:
    """A torch.profiler event of a functional collective -> its canonical name, e.g.
    '_c10d_functional::all_reduce_' -> 'all_reduce'; 'wait_tensor' for waits, '' for
    anything else (other namespaces, autograd wrappers)."""
    namespace, _, op = event_name.partition("::")
    if namespace != "_c10d_functional":
        return ""
    op = canonical_op(op)
    return op if op.startswith(COLLECTIVES) or op == "wait_tensor" else ""


# dtype names as torch.profiler records them -> bytes per element
_PROFILER_DTYPE_BYTES = {
    "float": 4,
    "double": 8,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "long int": 8,
    "int": 4,
    "signed char": 1,
    "unsigned char": 1,
    "bool": 1,
}


def profiled_bytes(name: str, shapes: list, dtypes: list, concrete: list) -> int:
    """Payload of one functional collective recorded by ``torch.profiler`` (with
    ``record_shapes``: its input shapes, dtypes and concrete inputs), as
    :class:`CommCounter` counts it: the input, an all-gather's gathered output (its
    input times the group size, the op's second argument)."""
    dtype = dtypes[0]
    if dtype not in _PROFILER_DTYPE_BYTES:
        raise ValueError(f"collective {name} on dtype {dtype!r}: add it to _PROFILER_DTYPE_BYTES")
    shape = shapes[0]
    if shape and isinstance(shape[0], list):  # coalesced: a list of tensors
        numel = sum(math.prod(s) for s in shape)
    else:
        numel = math.prod(shape)
    nbytes = numel * _PROFILER_DTYPE_BYTES[dtype]
    if "all_gather" in name:  # (input, group_size, group_name)
        nbytes *= int(concrete[1])
    return nbytes


class CollectiveHook(TorchDispatchMode):
    """Dispatch-mode hook on collectives: every op of the c10d namespaces (collectives
    and their waits) passes here; with ``timed=True`` the wall time spent in them adds
    up in ``seconds``; each collective proper goes to :meth:`on_collective`."""

    def __init__(self, timed: bool = False) -> None:
        super().__init__()
        self.timed = timed
        self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Modes run before tensor subclasses: let DTensor desugar an op first, so the
        # collectives it issues inside (redistributions, loss-parallel) come back here.
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        if func.namespace not in _COLLECTIVE_NAMESPACES:
            return func(*args, **(kwargs or {}))
        if self.timed:
            t0 = time.perf_counter()
            out = func(*args, **(kwargs or {}))  # wait_tensor is timed too
            self.seconds += time.perf_counter() - t0
        else:
            out = func(*args, **(kwargs or {}))
        op = canonical_op(func.__name__.split(".")[0])
        if op.startswith(COLLECTIVES):
            self.on_collective(op, args, out)
        return out

    def on_collective(self, op: str, args, out) -> None:
        """Called once per collective (canonical ``op``), after it ran."""


class CommCounter(CollectiveHook):
    """Records every collective with its module (innermost FQN), phase and payload."""

    def __init__(self, timed: bool = False) -> None:
        super().__init__(timed)
        self.records: list[CommRecord] = []
        self._tracker = ModTracker()

    def __enter__(self):
        self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._tracker.__exit__(*exc)

    def on_collective(self, op: str, args, out) -> None:
        nbytes, numel = _payload(op, args, out)
        module = max(self._tracker.parents, key=lambda n: (n != "Global", n.count("."), len(n)))
        phase = "backward" if self._tracker.is_bw else "forward"
        self.records.append(CommRecord(phase, module, op, nbytes, numel))

    # ------------------------------------------------------------------ views
    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            out[(r.phase, r.op)][0] += 1
            out[(r.phase, r.op)][1] += r.nbytes
        return {k: tuple(v) for k, v in sorted(out.items())}

    def block_records(self, block_prefix: str, phase: str) -> list[CommRecord]:
        """Collectives issued inside one block (e.g. "layers.1"), in issue order."""
        return [r for r in self.records if r.phase == phase and _inside(r.module, block_prefix)]

    def total(self, phase: str | None = None) -> tuple[int, int]:
        rs = [r for r in self.records if phase is None or r.phase == phase]
        return len(rs), sum(r.nbytes for r in rs)

    def report(self) -> dict:
        """JSON-able figures: totals per phase, per op, and the first block's detail."""
        totals = {}
        for phase in ("forward", "backward"):
            count, nbytes = self.total(phase)
            totals[f"{phase}_collectives"] = count
            totals[f"{phase}_bytes"] = nbytes
        blocks = sorted({_block_of(r.module) for r in self.records} - {None})
        first = blocks[0] if blocks else None
        return {
            "totals": totals,
            "by_op": {
                f"{p}/{op}": {"count": c, "bytes": b} for (p, op), (c, b) in self.summary().items()
            },
            "block": first,
            "block_detail": {
                phase: [
                    {"op": r.op, "bytes": r.nbytes, "numel": r.numel}
                    for r in self.block_records(first, phase)
                ]
                for phase in ("forward", "backward")
            }
            if first
            else {},
        }

    def format(self) -> str:
        lines = [f"{'phase':9s} {'op':22s} {'count':>6s} {'MiB':>10s}"]
        for (phase, op), (count, nbytes) in self.summary().items():
            lines.append(f"{phase:9s} {op:22s} {count:6d} {nbytes / 2**20:10.3f}")
        return "\n".join(lines)


def _block_of(module: str) -> str | None:
    parts = module.split(".")
    for i in range(len(parts) - 1):
        if parts[i] == "layers" and parts[i + 1].isdigit():
            return f"layers.{parts[i + 1]}"
    return None


def _inside(module: str, prefix: str) -> bool:
    # ModTracker names modules from the root's class, e.g. "Transformer.layers.1.attention"
    return ("." + prefix + ".") in ("." + module + ".")
