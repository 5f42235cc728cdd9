"""Build one rank's share of a config as a real run does and step it: traced under
FakeTensorMode (the dry run) or on real tensors (``--measure``)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from boost_titan.perf.dryrun.breakdown import ActivationBreakdown, BlockRoles, SavedBreakdown
from boost_titan.perf.dryrun.report import RoleReport
from boost_titan.perf.dryrun.schedule import _in_flight


def _local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for t in tensors:
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def _optimizer_bytes(optimizers) -> int:
    import torch

    tensors = []
    for opt in optimizers.optimizers:
        for state in opt.state.values():
            tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    return _local_bytes(tensors)


def _stage_input(part, args, tp: int, plan: str, mb: int, seq: int, dtype, gen):
    """A stage's input: tokens for the first stage, else the local hidden state a block
    hands on: BTP the d/T residual shard (LaX: the carried latents, whole, appended);
    torchtitan's full-rank plan (sequence parallel) an s/T slice; vanilla all of it."""
    import torch

    if part.tok_embeddings is not None:
        return torch.randint(0, args.vocab_size, (mb, seq), generator=gen)
    width = args.dim // tp if plan == "btp" and tp > 1 else args.dim
    if plan == "fullrank" and tp > 1:
        seq //= tp
    h = torch.randn(mb, seq, width + _lax_width(args), generator=gen).to(dtype)
    return h.requires_grad_()


def _lax_width(args) -> int:
    from boost_titan.models.model import PROJ_ORDER

    if args.arch != "lax":
        return 0
    return sum(args.projection_shapes()[n][2] for n in PROJ_ORDER)


class _GroupCounter:
    """Counts collectives and their all-reduce-equivalent bytes by process group name
    (TP vs FSDP vs PP)."""

    def __init__(self):
        from boost_titan.observability.comm_stats import (
            CollectiveHook,
            _payload,
            allreduce_equivalent,
            canonical_op,
        )

        counter = self

        class Hook(CollectiveHook):
            def on_collective(self, op, args, out):
                # functional collectives end with the group's name; c10d ops take the
                # ProcessGroup itself
                names = [a for a in args if isinstance(a, str)]
                groups = [a.group_name for a in args if hasattr(a, "group_name")]
                group = names[-1] if names else (groups[0] if groups else None)
                nbytes, _ = _payload(op, args, out)
                # the planner's and the benchmark's convention: an all-gather or a
                # reduce-scatter counts half its payload (on a ring, an all-reduce
                # is one of each), so plans that mix them compare fairly
                volume = int(allreduce_equivalent(canonical_op(op), nbytes))
                c, b = counter.by_group.get(group, (0, 0))
                counter.by_group[group] = (c + 1, b + volume)

        self.by_group: dict[str | None, tuple[int, int]] = {}
        self.hook = Hook()


def _parallel_dims(config, world_size: int):
    from torchtitan.distributed import ParallelDims

    p = config.parallelism
    pd = ParallelDims(
        dp_shard=p.data_parallel_shard_degree,
        dp_replicate=p.data_parallel_replicate_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=1,
        etp=1,
        world_size=world_size,
    )
    pd.build_mesh()
    return pd


@dataclass
class Role:
    """One rank's share of a model as a run builds it, before any tensor is allocated."""

    args: object  # the model args
    plan: str  # the TP plan resolved for them
    schedule: object | None  # the pipeline schedule (None without PP)
    stages: list  # the schedule's stages on this rank (empty without PP)
    parts: list  # the model parts (one without PP), parallelized, on the meta device
    stage_ids: list[int]
    microbatch: int  # samples in one microbatch
    microbatches: int  # microbatches of a local batch


def build_role(config, pd, device, args=None) -> Role:
    """Build the model on the meta device and parallelize it as the trainer does:
    ``parallelize_boost`` (TP + FSDP2), through torchtitan's ``pipeline_llm`` with PP.
    ``args``: these model args instead of the config's model and flavor."""
    import torch
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.tools import utils as tt_utils

    from boost_titan.models.model import Transformer
    from boost_titan.parallel.parallelize import parallelize_boost
    from boost_titan.parallel.pipeline import build_loss_fn
    from boost_titan.tp_plans import resolve_tp_plan
    from boost_titan.train.config_check import config_args

    args = config_args(config) if args is None else args
    plan = resolve_tp_plan(config.boost.tp_plan, args)
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = Transformer(args)
    if not pd.pp_enabled:
        parts = [parallelize_boost(model, pd, config)]
        return Role(args, plan, None, [], parts, [0], config.training.local_batch_size, 1)
    schedule, parts, _, _ = pipeline_llm(
        model, pd, config, device, args, parallelize_boost, build_loss_fn(config)
    )
    stages = getattr(schedule, "_stages", None) or [schedule._stage]
    return Role(
        args,
        plan,
        schedule,
        stages,
        parts,
        [st.stage_index for st in stages],
        config.parallelism.pipeline_parallel_microbatch_size,
        schedule._n_microbatches,
    )


def _step_tracker():
    """torch's MemTracker, keeping only the whole-rank peak: its per-module peaks loop
    over every module on every op (half the dry run's time) and are not reported."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class StepMemTracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            for dev, dev_snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < dev_snap["Total"]:
                    self._peak_mem[dev] = dev_snap["Total"]
                    self._peak_mem_snap[dev] = dict(dev_snap)

    return StepMemTracker()


def _loss_context(pd):
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if pd.tp_enabled else contextlib.nullcontext()


def _activations(snapshot) -> int:
    (per_device,) = snapshot.values()
    return sum(v for k, v in per_device.items() if getattr(k, "name", "") == "ACT")


def _total(snapshot) -> int:
    (per_device,) = snapshot.values()
    return per_device["Total"]


@contextlib.contextmanager
def _fused_kernels_on_local_shards():
    """The fused Adam(W) kernels given each DTensor's local shard. Traced, the step only
    allocates the optimizer states (``zeros_like`` of each parameter, before the kernel
    runs; the kernel updates in place and allocates nothing), and it runs outside the
    memory tracker. On DTensors the kernel's one call over hundreds of parameters takes
    DTensor's uncached sharding propagation (strided-shard checks across every pair of
    inputs: ~a third of a 7B role's trace); on the local shards it is one fake kernel."""
    import torch
    from torch.distributed.tensor import DTensor

    local = lambda x: x.to_local() if isinstance(x, DTensor) else x  # noqa: E731

    def on_local(kernel):
        def call(*args, **kwargs):
            each = lambda a: [local(t) for t in a] if isinstance(a, list | tuple) else local(a)  # noqa: E731
            return kernel(*map(each, args), **{k: each(v) for k, v in kwargs.items()})

        return call

    kernels = {name: getattr(torch, name) for name in ("_fused_adam_", "_fused_adamw_")}
    for name, kernel in kernels.items():
        setattr(torch, name, on_local(kernel))
    try:
        yield
    finally:
        for name, kernel in kernels.items():
            setattr(torch, name, kernel)


def trace_role(config, pd, *, fake: bool, device=None, args=None) -> RoleReport:
    """Build this rank's share of the model as a real run does and step it twice.
    ``fake``: under FakeTensorMode with MemTracker (the dry run); else on real
    tensors, activations measured by autograd's saved-tensor hooks (``--measure``).
    ``args``: these model args instead of the config's model and flavor."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import TORCH_DTYPE_MAP

    from boost_titan.train.specs import build_optimizers

    pp_rank = pd.get_mesh("pp").get_local_rank() if pd.pp_enabled else 0
    device = device or torch.device("cpu")
    role = build_role(config, pd, device, args)
    args, plan, schedule, parts = role.args, role.plan, role.schedule, role.parts
    stages, stage_ids, mb, n_mb = role.stages, role.stage_ids, role.microbatch, role.microbatches
    # gradient accumulation: torchtitan runs the local batch (with PP: the schedule's
    # n_mb microbatches) this many times per optimizer step
    gbs, dp = config.training.global_batch_size, pd.dp_replicate * pd.dp_shard
    accum = gbs // (config.training.local_batch_size * dp) if gbs > 0 else 1
    step_mbs = n_mb * accum
    # context parallelism: each rank holds its 1/cp of the sequence (every activation
    # but attention's ring buffers, which the ring's own allocations add while traced)
    seq = config.training.seq_len // pd.cp
    act_dtype = TORCH_DTYPE_MAP[
        config.training.mixed_precision_param if pd.fsdp_enabled else config.training.dtype
    ]
    tp_group = pd.get_mesh("tp").get_group().group_name if pd.tp_enabled else None
    mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext()
    with mode:
        for part in parts:
            part.to_empty(device=device)
            if not fake:
                with torch.no_grad():
                    part.init_weights(buffer_device=device)
        optimizers = build_optimizers(parts, config.optimizer, pd)
        gen = torch.Generator().manual_seed(0)
        inputs = [_stage_input(part, args, pd.tp, plan, mb, seq, act_dtype, gen) for part in parts]
        labels = torch.randint(0, args.vocab_size, (mb, seq), generator=gen)

        def forward(k: int):
            out = parts[k](inputs[k])
            return cross_entropy_loss(out, labels) if parts[k].output is not None else out

        def backward(out) -> None:
            out.backward(None if out.ndim == 0 else torch.ones_like(out))

        def fwd_bwd(k: int) -> None:
            with _loss_context(pd):
                backward(forward(k))

        # step 1 allocates gradients and optimizer states (what every later step keeps);
        # traced, its gradients are zeros of each parameter's (sharded) shape
        for k, part in enumerate(parts):
            if fake:
                for q in part.parameters():
                    q.grad = torch.zeros_like(q)
            else:
                fwd_bwd(k)
        with _fused_kernels_on_local_shards() if fake else contextlib.nullcontext():
            optimizers.step()
        params = _local_bytes(q for part in parts for q in part.parameters())
        grads = _local_bytes(
            q.grad for part in parts for q in part.parameters() if q.grad is not None
        )
        opt_bytes = _optimizer_bytes(optimizers)
        # step 2, one microbatch per stage, gradients and optimizer states alive
        stage_act, stage_peak = [], []
        counter = _GroupCounter()
        # the bytes autograd saves, by block and role (both paths); measured, they are
        # the stage's activations
        breakdown, roles = ActivationBreakdown(), BlockRoles(args, plan, pd.tp)
        for k in range(len(parts)):
            saved = SavedBreakdown(parts, roles)
            if fake:
                tracker = _step_tracker()
                tracker.track_external(*parts, optimizers)
                with tracker, counter.hook, _loss_context(pd):
                    with saved:
                        out = forward(k)
                    # everything backward needs is alive now: the activation peak
                    stage_act.append(_activations(tracker.get_tracker_snapshot("current")))
                    backward(out)
                    del out
                stage_peak.append(_total(tracker.get_tracker_snapshot("peak")))
            else:
                with counter.hook, _loss_context(pd):
                    with saved:
                        out = forward(k)
                    stage_act.append(saved.result.saved_total)
                    backward(out)
                    del out
            breakdown += saved.result
        if not fake:
            # measured: the TP collectives of one whole step as the trainer runs it
            # (accum x the local batch, through the real schedule with PP), not the
            # per-microbatch count times step_mbs the dry run reports
            counter = _GroupCounter()
            if schedule is not None:
                # the schedule's first step infers the stages' shapes, running their
                # forwards once more: not part of a training step
                with _loss_context(pd):
                    _schedule_step(schedule, stages, args, config, gen)
            with counter.hook, _loss_context(pd):
                for _ in range(accum):
                    if schedule is None:
                        backward(forward(0))
                    else:
                        _schedule_step(schedule, stages, args, config, gen)
    act_of = dict(zip(stage_ids, stage_act))
    notes = []
    if schedule is None:
        in_flight, act_peak = [1], stage_act[0]
    else:
        in_flight, act_peak = _in_flight(schedule, pp_rank, stage_ids, n_mb, pd.pp, act_of)
        notes.append(f"{type(schedule).__name__}, {n_mb} microbatches of {mb}")
    tp_count, tp_bytes = counter.by_group.get(tp_group, (0, 0)) if tp_group else (0, 0)
    return RoleReport(
        role=f"PP rank {pp_rank}" if pd.pp_enabled else "every rank",
        rank=torch.distributed.get_rank(),
        ranks=pd.world_size // pd.pp,
        stages=stage_ids,
        params_bytes=params,
        grads_bytes=grads,
        optimizer_bytes=opt_bytes,
        stage_activation_bytes=stage_act,
        microbatches_in_flight=in_flight,
        activation_peak_bytes=act_peak,
        # traced: the peak with one microbatch in flight; add the others' activations
        peak_bytes=max(stage_peak) + act_peak - max(stage_act) if fake else 0,
        # traced: one microbatch per stage; a step runs step_mbs through each
        # (measured: counted over a whole step, above)
        tp_bytes_per_step=tp_bytes * step_mbs if fake else tp_bytes,
        tp_collectives_per_step=tp_count * step_mbs if fake else tp_count,
        notes=notes,
        activation_breakdown=breakdown.to_json(),
    )


def _schedule_step(schedule, stages, args, config, gen) -> None:
    """One pipelined forward/backward of the local batch on real ranks, as
    ``boost_titan.parallel.pipeline.pipeline_forward_backward`` runs it."""
    import torch

    shape = (
        config.training.local_batch_size,
        config.training.seq_len // config.parallelism.context_parallel_degree,
    )
    tokens = torch.randint(0, args.vocab_size, shape, generator=gen)
    labels = torch.randint(0, args.vocab_size, shape, generator=gen)
    last = any(st.is_last for st in stages)
    target, losses = (labels, []) if last else (None, None)
    if any(st.is_first for st in stages):
        schedule.step(tokens, target=target, losses=losses, return_outputs=False)
    else:
        schedule.step(target=target, losses=losses, return_outputs=False)
