"""Small, reusable ParallelStyles used by the BOOST plans."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from boost_titan.models.bottleneck import LatentComm


class ShardParameters(ParallelStyle):
    """Turn a module's parameters into DTensors: ``placements`` by parameter FQN
    (relative to the module), every other parameter ``Replicate()``. No input/output
    hooks: modules that run on local shards read them with ``.to_local()``."""

    def __init__(self, placements: dict[str, Placement] | None = None):
        super().__init__()
        self.placements = placements or {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        unknown = set(self.placements) - {n for n, _ in module.named_parameters()}
        if unknown:
            raise ValueError(f"{type(module).__name__} has no parameters {sorted(unknown)}")
        for fqn, param in list(module.named_parameters()):
            if isinstance(param, DTensor):
                continue
            owner_name, _, pname = fqn.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            placement = self.placements.get(fqn, Replicate())
            dparam = nn.Parameter(
                distribute_tensor(param, device_mesh, [placement]),
                requires_grad=param.requires_grad,
            )
            owner.register_parameter(pname, dparam)
        return module


class ReplicatedModule(ParallelStyle):
    """Run a module (e.g. the final norm) replicated, params ``Replicate()``, output a
    local tensor. ``input_layout=Shard(-1)``: the input arrives as a local shard of the
    last dim and is all-gathered first (one collective)."""

    def __init__(self, input_layout: Placement | None = None):
        super().__init__()
        self.input_layout = input_layout or Replicate()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layout = self.input_layout

        def input_fn(mod, inputs, mesh):
            (x,) = inputs
            return DTensor.from_local(x, mesh, [layout], run_check=False).redistribute(
                mesh, [Replicate()]
            )

        def output_fn(mod, output, mesh):
            return output.to_local()

        return distribute_module(module, device_mesh, None, input_fn, output_fn)


class LowRankBlockParallel(ParallelStyle):
    """One low-rank block under a plan: its two norms and seven bottlenecks placed by
    ``norms`` and ``bottlenecks``, and the plan's collectives attached: ``comm(mesh)``
    is the block's :class:`~boost_titan.models.bottleneck.LatentComm`, every
    collective of the block in one object."""

    def __init__(
        self,
        norms: ParallelStyle,
        bottlenecks: ParallelStyle,
        comm: Callable[[DeviceMesh], LatentComm],
    ):
        super().__init__()
        self.norms, self.bottlenecks, self.comm = norms, bottlenecks, comm

    def _apply(self, block: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from boost_titan.models.model import ATTN_PROJS, FFN_PROJS

        plan = {"attention_norm": self.norms, "ffn_norm": self.norms}
        plan.update({f"attention.{n}": self.bottlenecks for n in ATTN_PROJS})
        plan.update({f"feed_forward.{n}": self.bottlenecks for n in FFN_PROJS})
        parallelize_module(block, device_mesh, plan)
        block.comm = self.comm(device_mesh)
        return block
