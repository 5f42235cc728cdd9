"""Where the activation memory goes: the bytes autograd saves in a forward, per block and
by role (``residual``, ``latent``, ``attention``, ``mlp``, ``other``), and outside
the blocks (``stack_ends``: embedding, final norm, output head, loss).

:class:`SavedBreakdown` records every tensor autograd saves while a forward runs
(``saved_tensors_hooks``), each storage once (the bytes of the whole storage, as
``bench.activations`` counts them; storages of parameters and buffers excluded). A
storage belongs to the block that first saves it (forward pre/post hooks on
``model.layers[*]``; e.g. block i keeps block i-1's output as the input of its norm),
and gets the role of that first saved view (:class:`BlockRoles`). Storages are keyed
by their ``StorageImpl`` (``untyped_storage()._cdata``): FakeTensor storages all report
``data_ptr() == 0``, real ones may too when empty; the recorder holds each storage
while it records, so no key is reused.

Blocks run under activation checkpointing save through the checkpoint's own hooks,
which shadow these: the breakdown then counts what is saved outside them only.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

ROLES = ("residual", "latent", "attention", "mlp", "other")

# autograd nodes of a GEMM; their last input is the weight-side operand
_MATMUL_NODES = {"MmBackward0", "BmmBackward0", "AddmmBackward0", "BaddbmmBackward0"}


class BlockRoles:
    """The role of a tensor a block saves, from its shape and, where that cannot tell,
    the autograd graph (a heuristic, exact for the
    three plans' blocks; tests/test_plan.py pins it). Rules, first match wins, on the
    saved view's local shape (a DTensor's local shard), ``T`` the TP degree, ``w`` the
    last dim:

    0. ``other``: a copy of weights only (the grouped A's concatenated, the B's
       stacked for the batched GEMM), found on the autograd graph: every leaf it
       derives from is a parameter. Batch-independent, never an activation.
    1. ``mlp``: ``w`` = the local FFN width: ``f/T`` where the plan shards f (btp,
       fullrank's Megatron plan), ``f`` under vanilla (SwiGLU replicated) or at T = 1.
    2. ``attention``: 4-D (heads x sequence), or 3-D with dim 1 = the local query head
       count (the kernel's log-sum-exp), or an integer tensor (the kernel's RNG state).
    3. ``latent``: ``w`` is a latent width (rule 6) and the tensor derives, on the
       autograd graph, from a down-projection A's output with no up-projection B in
       between. This settles widths shared with rules 4 and 5 (7B at TP4 under btp:
       d/T = r = 1024; the debug model at TP2: d/T = nh/T x hd = 2r = 128).
    4. ``residual``: ``w`` = the local residual width, ``d/T`` under btp (the d-sharded
       stream: block input, normalised input, attention output before A_o, their fp32
       copies), ``d`` under vanilla and fullrank (replicated or sequence-sharded).
    5. ``attention``: ``w`` = the local width of q or of k/v (heads x head_dim; under
       fullrank the attention output before wo, ``d/T``).
    6. ``latent``: ``w`` is a latent width: each projection's rank r (under vanilla
       also ``r/T``, its slice), each grouped A's sum (``r_q+r_k+r_v``, ``r_1+r_3``,
       or ``/T``), those plus the Online-RMSNorm statistics columns (1 in fp32, 2T
       in 16-bit), and 1 (norm statistics: under btp they ride with the latent). Under fullrank
       (no latent) width 1 is the RMSNorm's ``rstd``: ``residual``.
    7. ``other``: anything else (reported, never dropped).

    The sequence length never enters: sequence-parallel shards ``[b, s/T, w]`` classify
    as their full-sequence counterparts."""

    def __init__(self, args, plan: str, tp: int):
        from boost_titan.models.model import PROJ_ORDER

        T = tp
        d, f, hd = args.dim, args.ffn_dim, args.head_dim
        shards_heads = plan in ("btp", "fullrank") and T > 1
        self.mlp = f // T if shards_heads else f
        self.q_heads = args.n_heads // T if shards_heads else args.n_heads
        kv_heads = args.kv_heads // T if shards_heads else args.kv_heads
        self.head_widths = {self.q_heads * hd, kv_heads * hd}
        self.residual = d // T if plan == "btp" and T > 1 else d
        self.latent: set[int] = set()
        if args.low_rank and plan != "fullrank":
            r = {n: args.projection_shapes()[n][2] for n in PROJ_ORDER}
            groups = [r[n] for n in PROJ_ORDER]
            groups += [r["wq"] + r["wk"] + r["wv"], r["w1"] + r["w3"]]
            if plan == "btp":
                stats_columns = (1, 2 * T)
                self.latent |= set(groups)
                self.latent |= {g + c for g in groups[-2:] for c in stats_columns}
            else:  # vanilla: r split across ranks; LaX gathers whole latents
                self.latent |= set(groups) | {g // T for g in groups}
            self.latent.add(1)

    def role(self, t, graph: _Provenance) -> str:
        from torch.distributed.tensor import DTensor

        if graph.weights_only(t):
            return "other"
        local = t._local_tensor if isinstance(t, DTensor) else t  # widths are local
        shape, w = local.shape, (local.shape[-1] if local.ndim else 0)
        if local.ndim and w == self.mlp:
            return "mlp"
        if (
            local.ndim == 4
            or (local.ndim == 3 and shape[1] == self.q_heads)
            or not (local.is_floating_point() or local.is_complex())
        ):
            return "attention"
        if w in self.latent and graph.from_latent(t):
            return "latent"
        if w == self.residual:
            return "residual"
        if w in self.head_widths:
            return "attention"
        if w in self.latent:
            return "latent"
        if w == 1:  # fullrank's RMSNorm rstd (no latent widths)
            return "residual"
        return "other"


class _Provenance:
    """What a saved tensor derives from, read off the autograd graph (memoised per
    node): only parameters (a weight copy), or a down-projection A's output."""

    def __init__(self, modules):
        from torch.distributed.tensor import DTensor

        from boost_titan.models.bottleneck import Bottleneck

        self.params = {id(p) for m in modules for p in m.parameters()}
        bottlenecks = [b for m in modules for b in m.modules() if isinstance(b, Bottleneck)]
        self.down = {id(b.down.weight) for b in bottlenecks}
        self.up = {id(b.up.weight) for b in bottlenecks}
        self._dtensor = DTensor
        self._weights_only: dict = {}
        self._latent: dict = {}

    def weights_only(self, t) -> bool:
        if t.grad_fn is None:
            return id(t) in self.params
        return self._fold(t.grad_fn, self._weights_only, self._weights_only_node)

    def from_latent(self, t) -> bool:
        return t.grad_fn is not None and self._fold(t.grad_fn, self._latent, self._latent_node)

    @staticmethod
    def _children(node):
        return [c for c, _ in node.next_functions if c is not None]

    def _fold(self, root, memo: dict, rule) -> bool:
        """``rule(node, value_of_child)`` over the graph below ``root``, each node once
        (iterative: a stack's graph is deeper than Python's recursion limit)."""
        todo = [root]
        while todo:
            node = todo[-1]
            if node in memo:
                todo.pop()
                continue
            missing = [c for c in self._children(node) if c not in memo]
            if missing:
                todo += missing
                continue
            memo[node] = rule(node, memo.__getitem__)
            todo.pop()
        return memo[root]

    def _weights_only_node(self, node, value) -> bool:
        name = type(node).__name__
        if name == "AccumulateGrad":
            return id(node.variable) in self.params
        if name.startswith("Embedding"):  # the token ids are its other input
            return False
        children = self._children(node)
        return bool(children) and all(value(c) for c in children)

    def _leaf_params(self, node) -> set[int]:
        """The parameters reachable from ``node`` through anything but another GEMM."""
        found, todo, seen = set(), [node], set()
        while todo:
            n = todo.pop()
            if n in seen:
                continue
            seen.add(n)
            if type(n).__name__ == "AccumulateGrad":
                found.add(id(n.variable))
            elif type(n).__name__ not in _MATMUL_NODES:
                todo += self._children(n)
        return found

    def _latent_node(self, node, value) -> bool:
        name = type(node).__name__
        if name == "AccumulateGrad" or name == "LatentUpBackward":
            return False  # LatentUp: the B's (what it saves itself is the reduced latent)
        if name in _MATMUL_NODES and node.next_functions[-1][0] is not None:
            weights = self._leaf_params(node.next_functions[-1][0])
            if weights & self.down:
                return True
            if weights & self.up:
                return False
        return any(value(c) for c in self._children(node))


@dataclass
class ActivationBreakdown:
    """Saved bytes of one micro-batch's forward: ``block_total`` by role summed over
    ``blocks`` blocks, and ``stack_ends``; ``saved_total`` is their sum."""

    block_total: dict[str, int] = field(default_factory=lambda: dict.fromkeys(ROLES, 0))
    stack_ends: int = 0
    blocks: int = 0

    @property
    def saved_total(self) -> int:
        return sum(self.block_total.values()) + self.stack_ends

    def per_block(self) -> dict[str, float]:
        n = max(self.blocks, 1)
        return {k: v / n for k, v in self.block_total.items()}

    def __add__(self, other: ActivationBreakdown) -> ActivationBreakdown:
        return ActivationBreakdown(
            {k: self.block_total[k] + other.block_total[k] for k in ROLES},
            self.stack_ends + other.stack_ends,
            self.blocks + other.blocks,
        )

    def to_json(self) -> dict:
        """``{"per_block": {role: bytes}, "stack_ends", "blocks", "block_total",
        "saved_total"}``; per_block is block_total / blocks (a float where it does not
        divide)."""
        per = {k: (int(v) if v == int(v) else v) for k, v in self.per_block().items()}
        return {
            "per_block": per,
            "stack_ends": self.stack_ends,
            "blocks": self.blocks,
            "block_total": dict(self.block_total),
            "saved_total": self.saved_total,
        }

    @classmethod
    def from_json(cls, j: dict) -> ActivationBreakdown:
        return cls(dict(j["block_total"]), j["stack_ends"], j["blocks"])


def format_breakdown(b: ActivationBreakdown | dict, div: int = 2**30, unit: str = "GiB") -> str:
    """``residual 1.23GiB  latent ...  other 0.00GiB  | stack ends 0.50GiB`` (per block)."""
    if isinstance(b, dict):
        b = ActivationBreakdown.from_json(b)
    per = b.per_block()
    roles = "  ".join(f"{k} {per[k] / div:.2f}{unit}" for k in ROLES)
    return f"{roles}  | stack ends {b.stack_ends / div:.2f}{unit} ({b.blocks} blocks)"


class SavedBreakdown:
    """Context manager: records what autograd saves while it is open, in ``parts``
    (the model chunks of this rank), into ``self.result`` (:class:`ActivationBreakdown`).
    ``roles``: a :class:`BlockRoles`."""

    def __init__(self, parts, roles: BlockRoles):
        self.parts, self.roles = parts, roles
        self.result = ActivationBreakdown()
        # one row per saved storage: (block or None, role, the first saved view's shape
        # and dtype, the storage's bytes, the autograd node that made the view)
        self.records: list[tuple] = []

    @staticmethod
    def _storage(t):
        from torch.distributed.tensor import DTensor

        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()

    @contextlib.contextmanager
    def _recording(self):
        import torch

        owned = {
            self._storage(t)._cdata
            for m in self.parts
            for t in list(m.parameters()) + list(m.buffers())
        }
        graph = _Provenance(self.parts)
        # storage key -> [nbytes, block, role]. Keys only: holding the storages would
        # keep them alive past their use and inflate the traced peak. A saved storage
        # lives until backward, so its key is not reused while the forward runs.
        kept: dict[int, list] = {}
        current: list[int | None] = [None]
        entered: set[int] = set()

        def pre(i):
            def hook(module, args):
                current[0] = i
                entered.add(i)
                # FSDP2 registers the all-gathered (unsharded) parameters on the block
                # for its forward: weights, not activations
                owned.update(self._storage(p)._cdata for p in module.parameters())

            return hook

        def post(module, args, out):
            current[0] = None

        handles = []
        for k, part in enumerate(self.parts):
            for name, block in part.layers.items() if part.layers is not None else []:
                if block is None:
                    continue
                handles.append(block.register_forward_pre_hook(pre((k, name))))
                handles.append(block.register_forward_hook(post))

        def pack(t):
            st = self._storage(t)
            key = st._cdata
            if key in owned:
                return t
            if key in kept:
                kept[key][0] = max(kept[key][0], st.nbytes())
                return t
            block = current[0]
            role = "stack_ends" if block is None else self.roles.role(t, graph)
            kept[key] = [st.nbytes(), block, role]
            self.records.append(
                (block, role, tuple(t.shape), t.dtype, key, type(t.grad_fn).__name__)
            )
            return t

        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                yield
        finally:
            for h in handles:
                h.remove()
        out = ActivationBreakdown(blocks=len(entered))
        nbytes_of = {key: v[0] for key, v in kept.items()}
        self.records = [(*r[:4], nbytes_of[r[4]], r[5]) for r in self.records]
        for nbytes, block, role in kept.values():
            if block is None:
                out.stack_ends += nbytes
            else:
                out.block_total[role] += nbytes
        self.result = out

    def __enter__(self):
        self._cm = self._recording()
        return self._cm.__enter__()

    def __exit__(self, *exc):
        return self._cm.__exit__(*exc)
