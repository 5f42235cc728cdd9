"""Dry run at full scale on CPU: does a config build, shard and fit at its world size?

    python -m boost_titan.dryrun --config recipes/cola_llama2_7b.toml --ngpu 8
    python -m boost_titan.dryrun --config X.toml --ngpu 32 --gpu-memory 80 --json [--key value ...]

For every distinct rank role (each pipeline rank; without PP all ranks are alike) the
run joins a fake process group of ``--ngpu`` ranks as a representative rank of that
role, builds the model on the meta device and applies the same ``parallelize_boost``
and torchtitan ``pipeline_llm`` a real run applies; then, under ``FakeTensorMode`` (no
memory, no compute), it allocates the local shards, builds torchtitan's optimizers and
traces one microbatch forward + backward per stage at full shape, twice with an
optimizer step between, under torch's ``MemTracker``. Per rank it reports:

* parameters, gradients, optimizer states: exact, the local shard bytes after a step;
* activations of one microbatch per stage: what ``MemTracker`` holds at the stage's
  peak (equals the bytes autograd saves, ``bench.activations``, on real ranks);
* activation peak: with PP, the schedule's microbatches in flight on this rank times
  each stage's activations (1F1B: ``min(n_mb, stages - s)``; GPipe: all; multi-stage
  schedules: walked from their action order, activations freed at full backward, or at
  the weight gradient when the schedule splits it);
* peak: the traced peak (parameters, gradients, optimizer states, all-gathered FSDP
  parameters, gradient temporaries and one microbatch's activations) plus the other
  in-flight microbatches' activations;
* TP bytes per step: the collectives on the TP mesh, counted while tracing (logical
  payload, as ``comm_stats``), times the microbatches of a step.

Eager figures: ``[compile]`` is ignored here (compiled graphs may save less). Exit
code 1 when a role's peak exceeds ``--gpu-memory`` (GiB); 2 for a config that does not
parse.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

GIB = 2**30


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


def _in_flight(
    schedule, pp_rank: int, stage_ids: list[int], n_mb: int, pp: int, act: dict[int, int]
) -> tuple[list[int], int]:
    """Per local stage, the microbatches whose activations are alive at this rank's
    activation peak, and that peak."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    if not isinstance(schedule, PipelineScheduleSingle):
        return _walk_order(schedule.pipeline_order[pp_rank], stage_ids, act)
    name = type(schedule).__name__
    if name == "ScheduleGPipe":
        alive = n_mb
    elif name == "Schedule1F1B":  # warm-up forwards, then one backward per forward
        alive = min(n_mb, pp - stage_ids[0])
    else:
        raise ValueError(f"dry run: no in-flight rule for pipeline schedule {name}")
    return [alive], alive * act[stage_ids[0]]


def _walk_order(actions, stage_ids: list[int], act: dict[int, int]) -> tuple[list[int], int]:
    """Walk a multi-stage schedule's action list: F adds a microbatch to its stage; B
    frees it, or W when the schedule splits backward into I and W."""
    splits = any(a is not None and a.computation_type.value == "W" for a in actions)
    free_on = "W" if splits else "B"
    alive = dict.fromkeys(stage_ids, 0)
    best, best_alive = 0, dict(alive)
    for a in actions:
        if a is None:
            continue
        kind = a.computation_type.value
        if kind == "F":
            alive[a.stage_index] += 1
        elif kind == free_on:
            alive[a.stage_index] -= 1
        total = sum(alive[s] * act[s] for s in stage_ids)
        if total > best:
            best, best_alive = total, dict(alive)
    return [best_alive[s] for s in stage_ids], best


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
    """Counts collectives by process group name (TP vs FSDP vs PP)."""

    def __init__(self):
        from boost_titan.comm_stats import CollectiveHook, _payload

        counter = self

        class Hook(CollectiveHook):
            def on_collective(self, op, args, out):
                # functional collectives end with the group's name; c10d ops take the
                # ProcessGroup itself
                names = [a for a in args if isinstance(a, str)]
                groups = [a.group_name for a in args if hasattr(a, "group_name")]
                group = names[-1] if names else (groups[0] if groups else None)
                nbytes, _ = _payload(op, args, out)
                c, b = counter.by_group.get(group, (0, 0))
                counter.by_group[group] = (c + 1, b + nbytes)

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


def _saved_bytes(fn, modules) -> int:
    """Bytes autograd saves while ``fn`` runs: each storage once, storages of the
    modules' parameters and buffers excluded (weights saved by matmuls are no
    activation). The measured counterpart of MemTracker's activations."""
    import torch
    from torch.distributed.tensor import DTensor

    def storage(t):
        return (t.to_local() if isinstance(t, DTensor) else t).untyped_storage()

    owned = {
        storage(t).data_ptr() for m in modules for t in list(m.parameters()) + list(m.buffers())
    }
    kept: dict[int, int] = {}

    def pack(t):
        st = storage(t)
        if st.data_ptr() not in owned:
            kept[st.data_ptr()] = max(kept.get(st.data_ptr(), 0), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(kept.values())


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
    import contextlib

    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if pd.tp_enabled else contextlib.nullcontext()


def _activations(snapshot) -> int:
    (per_device,) = snapshot.values()
    return sum(v for k, v in per_device.items() if getattr(k, "name", "") == "ACT")


def _total(snapshot) -> int:
    (per_device,) = snapshot.values()
    return per_device["Total"]


def trace_role(config, pd, *, fake: bool, device=None) -> RoleReport:
    """Build this rank's share of the model as a real run does and step it twice.
    ``fake``: under FakeTensorMode with MemTracker (the dry run); else on real
    tensors, activations measured by autograd's saved-tensor hooks (``--measure``)."""
    import contextlib

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.tools import utils as tt_utils

    from boost_titan.config_check import config_args
    from boost_titan.models.model import Transformer
    from boost_titan.parallelize import parallelize_boost
    from boost_titan.pipeline import build_loss_fn
    from boost_titan.specs import build_optimizers
    from boost_titan.tp_plans import resolve_tp_plan

    p = config.parallelism
    pp_rank = pd.get_mesh("pp").get_local_rank() if pd.pp_enabled else 0
    args = config_args(config)
    plan = resolve_tp_plan(config.boost.tp_plan, args)
    with torch.device("meta"), tt_utils.set_default_dtype(TORCH_DTYPE_MAP[config.training.dtype]):
        model = Transformer(args)
    device = device or torch.device("cpu")
    if pd.pp_enabled:
        schedule, parts, _, _ = pipeline_llm(
            model, pd, config, device, args, parallelize_boost, build_loss_fn(config)
        )
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        stage_ids = [st.stage_index for st in stages]
        n_mb = schedule._n_microbatches
        mb, step_mbs = p.pipeline_parallel_microbatch_size, n_mb
    else:
        schedule, parts, stage_ids = None, [parallelize_boost(model, pd, config)], [0]
        mb, n_mb = config.training.local_batch_size, 1
        gbs, dp = config.training.global_batch_size, pd.dp_replicate * pd.dp_shard
        step_mbs = gbs // (mb * dp) if gbs > 0 else 1  # gradient accumulation
    seq = config.training.seq_len
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
        optimizers.step()
        params = _local_bytes(q for part in parts for q in part.parameters())
        grads = _local_bytes(
            q.grad for part in parts for q in part.parameters() if q.grad is not None
        )
        opt_bytes = _optimizer_bytes(optimizers)
        # step 2, one microbatch per stage, gradients and optimizer states alive
        stage_act, stage_peak = [], []
        counter = _GroupCounter()
        for k in range(len(parts)):
            if fake:
                tracker = _step_tracker()
                tracker.track_external(*parts, optimizers)
                with tracker, counter.hook, _loss_context(pd):
                    out = forward(k)
                    # everything backward needs is alive now: the activation peak
                    stage_act.append(_activations(tracker.get_tracker_snapshot("current")))
                    backward(out)
                    del out
                stage_peak.append(_total(tracker.get_tracker_snapshot("peak")))
            else:
                with counter.hook, _loss_context(pd):
                    outs = []
                    stage_act.append(_saved_bytes(lambda: outs.append(forward(k)), parts))  # noqa: B023
                    backward(outs[0])
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
        tp_bytes_per_step=tp_bytes * step_mbs,
        tp_collectives_per_step=tp_count * step_mbs,
        notes=notes,
    )


def dry_run_role(config, world_size: int, pp_rank: int) -> RoleReport:
    """Join a fake process group as the first rank of pipeline rank ``pp_rank``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    rank = pp_rank * (world_size // config.parallelism.pipeline_parallel_degree)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        return trace_role(config, _parallel_dims(config, world_size), fake=True)
    finally:
        dist.destroy_process_group()


def budget_bytes(gpu_gib: float, headroom: float) -> float:
    """What the traced tensors may use: the GPU less ``headroom`` (a fraction) for what
    the trace does not see: CUDA context, NCCL buffers, allocator fragmentation."""
    return gpu_gib * GIB * (1 - headroom)


def fits(reports: list[RoleReport], gpu_gib: float, headroom: float = 0.1) -> bool:
    return all(r.peak_bytes <= budget_bytes(gpu_gib, headroom) for r in reports)


def _role_worker(config_args: list[str], world_size: int, pp_rank: int) -> RoleReport:
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    quiet_warnings()
    from boost_titan.config_check import parse_config

    config = parse_config(config_args)
    config.compile.enable = False  # eager figures (see the module docstring)
    return dry_run_role(config, world_size, pp_rank)


def dry_run(config_args: list[str], world_size: int, pp: int) -> list[RoleReport]:
    """Each role in a fresh process (DTensor caches sharding decisions with their
    process groups, which a second fake world in one process would reuse stale);
    as many at a time as there are cores."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    workers = max(1, min(pp, os.cpu_count() or 1))
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), max_tasks_per_child=1
    ) as pool:
        futures = [pool.submit(_role_worker, config_args, world_size, s) for s in range(pp)]
        return [f.result() for f in futures]


def measure(config) -> list[RoleReport] | None:
    """The same figures on real ranks (run under torchrun): the ground truth the dry
    run is tested against. Returns the roles on rank 0 (None elsewhere)."""
    import os

    import torch
    import torch.distributed as dist
    from torchtitan.tools.utils import device_type

    if device_type == "cpu":
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    else:
        device = torch.device(device_type, int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group()
    try:
        pd = _parallel_dims(config, dist.get_world_size())
        torch.manual_seed(0)
        report = trace_role(config, pd, fake=False, device=device)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, report)
    finally:
        dist.destroy_process_group()
    if report.rank != 0:
        return None
    per_stage = config.parallelism.pipeline_parallel_degree
    return [everyone[s * (len(everyone) // per_stage)] for s in range(per_stage)]


def format_reports(reports: list[RoleReport], gpu_gib: float, headroom: float) -> str:
    lines = [
        f"{'role':14s} {'ranks':>5s} {'params':>9s} {'grads':>9s} {'optim':>9s} "
        f"{'act/mb':>9s} {'in flight':>10s} {'act peak':>9s} {'peak':>9s} {'TP/step':>9s}  fits"
    ]
    for r in reports:
        lines.append(
            f"{r.role:14s} {r.ranks:5d} {r.params_bytes / GIB:8.2f}G {r.grads_bytes / GIB:8.2f}G "
            f"{r.optimizer_bytes / GIB:8.2f}G {max(r.stage_activation_bytes) / GIB:8.2f}G "
            f"{','.join(map(str, r.microbatches_in_flight)):>10s} "
            f"{r.activation_peak_bytes / GIB:8.2f}G {r.peak_bytes / GIB:8.2f}G "
            f"{r.tp_bytes_per_step / GIB:8.2f}G  "
            f"{'yes' if r.peak_bytes <= budget_bytes(gpu_gib, headroom) else 'NO'}"
        )
    return "\n".join(lines)


def quiet_warnings() -> None:
    """Warnings a dry run raises by design (parallelize plan keys of modules a
    pipeline stage does not hold print the whole model; fake-backend notes)."""
    import warnings

    warnings.filterwarnings("ignore", message="Parallelize plan key")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def main(argv: list[str] | None = None) -> int:
    from boost_titan import cpu_runtime

    cpu_runtime.activate()
    quiet_warnings()
    from boost_titan.config_check import check_config, parse_config

    ap = argparse.ArgumentParser(
        prog="python -m boost_titan.dryrun",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--config", required=True, help="TOML config (a recipe)")
    ap.add_argument("--ngpu", type=int, required=True, help="world size of the launch")
    ap.add_argument("--gpu-memory", type=float, default=80.0, help="GiB per GPU (default 80)")
    ap.add_argument(
        "--headroom",
        type=float,
        default=0.1,
        help="fraction of --gpu-memory kept free for what the trace does not see (CUDA "
        "context, NCCL buffers, fragmentation; default 0.1)",
    )
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--measure",
        action="store_true",
        help="measure on real ranks instead (under torchrun with --ngpu processes)",
    )
    a, overrides = ap.parse_known_args(argv)
    if a.ngpu < 1:
        ap.error(f"--ngpu {a.ngpu} must be >= 1")
    config_args = ["--job.config_file", a.config, *overrides]
    try:
        config = parse_config(config_args)
        check_config(config, world_size=a.ngpu, files=False)
    except (ValueError, FileNotFoundError) as e:
        print(f"dryrun: {e}", file=sys.stderr)
        return 2
    config.compile.enable = False  # eager figures (see the module docstring)
    if a.measure:
        reports = measure(config)
        if reports is None:
            return 0
    else:
        reports = dry_run(config_args, a.ngpu, config.parallelism.pipeline_parallel_degree)
    ok = fits(reports, a.gpu_memory, a.headroom)
    if a.json:
        print(
            json.dumps(
                {
                    "config": a.config,
                    "ngpu": a.ngpu,
                    "gpu_memory_gib": a.gpu_memory,
                    "headroom": a.headroom,
                    "fits": ok,
                    "roles": [asdict(r) for r in reports],
                },
                indent=2,
            )
        )
    else:
        budget = budget_bytes(a.gpu_memory, a.headroom)
        print(
            f"{a.config} on {a.ngpu} GPUs of {a.gpu_memory:g} GiB "
            f"(budget {budget / GIB:.1f} GiB: {a.headroom:.0%} headroom)"
        )
        print(format_reports(reports, a.gpu_memory, a.headroom))
        for r in reports:
            if r.peak_bytes > budget:
                print(
                    f"does not fit: {r.role} needs {r.peak_bytes / GIB:.1f} GiB per rank "
                    f"> {budget / GIB:.1f} GiB ({a.gpu_memory:g} GiB less {a.headroom:.0%})",
                    file=sys.stderr,
                )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
