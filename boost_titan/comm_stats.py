"""Communication accounting: every collective's count and bytes, per module and phase.

    with CommCounter() as comm:
        loss = model(tokens).sum(); loss.backward()
    comm.summary()                  # {(phase, op): (count, bytes)}
    comm.per_module("forward")      # {module fqn: {op: (count, bytes)}}

Bytes are the logical payload of each collective on one rank: the tensor reduced by an
all-reduce, the gathered output of an all-gather, the input of a reduce-scatter. It is
independent of the algorithm the backend uses on the wire, which is what the planner's
closed forms count too. Works on real process groups and under LocalTensorMode.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._python_dispatch import TorchDispatchMode

_COLLECTIVE_NAMESPACES = {"_c10d_functional", "c10d_functional", "c10d"}
_COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


@dataclass(frozen=True)
class CommRecord:
    phase: str  # "forward" | "backward"
    module: str  # innermost module FQN ("Global" outside any module)
    op: str  # e.g. "all_reduce"
    nbytes: int
    numel: int


def _payload(op: str, args, out) -> tuple[int, int]:
    tensor = out if op.startswith("all_gather") else args[0]
    if isinstance(tensor, (list, tuple)):
        tensor = tensor[0]
    return tensor.numel() * tensor.element_size(), tensor.numel()


class CommCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[CommRecord] = []
        self._tracker = ModTracker()

    def __enter__(self):
        self._tracker.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._tracker.__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace in _COLLECTIVE_NAMESPACES:
            op = func.__name__.split(".")[0].rstrip("_")
            if op.startswith(_COLLECTIVES):
                nbytes, numel = _payload(op, args, out)
                module = max(self._tracker.parents, key=lambda n: (n != "Global", n.count("."), len(n)))
                phase = "backward" if self._tracker.is_bw else "forward"
                self.records.append(CommRecord(phase, module, op, nbytes, numel))
        return out

    # ------------------------------------------------------------------ views
    def summary(self) -> dict[tuple[str, str], tuple[int, int]]:
        out: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
        for r in self.records:
            out[(r.phase, r.op)][0] += 1
            out[(r.phase, r.op)][1] += r.nbytes
        return {k: tuple(v) for k, v in sorted(out.items())}

    def per_module(self, phase: str) -> dict[str, dict[str, tuple[int, int]]]:
        out: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        for r in self.records:
            if r.phase == phase:
                out[r.module][r.op][0] += 1
                out[r.module][r.op][1] += r.nbytes
        return {m: {op: tuple(v) for op, v in ops.items()} for m, ops in out.items()}

    def block_records(self, block_prefix: str, phase: str) -> list[CommRecord]:
        """Collectives issued inside one block (e.g. "layers.1"), in issue order."""
        return [r for r in self.records if r.phase == phase and _inside(r.module, block_prefix)]

    def total(self, phase: str | None = None) -> tuple[int, int]:
        rs = [r for r in self.records if phase is None or r.phase == phase]
        return len(rs), sum(r.nbytes for r in rs)

    def format(self) -> str:
        lines = [f"{'phase':9s} {'op':22s} {'count':>6s} {'MiB':>10s}"]
        for (phase, op), (count, nbytes) in self.summary().items():
            lines.append(f"{phase:9s} {op:22s} {count:6d} {nbytes / 2**20:10.3f}")
        return "\n".join(lines)


def _inside(module: str, prefix: str) -> bool:
    # ModTracker names modules from the root's class, e.g. "Transformer.layers.1.attention"
    return ("." + prefix + ".") in ("." + module + ".")
