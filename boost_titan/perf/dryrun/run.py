"""Run the trace: per role in a fake world of N ranks (one process each), or on the
real ranks of a torchrun launch."""

from __future__ import annotations

from boost_titan.perf.dryrun.report import RoleReport
from boost_titan.perf.dryrun.trace import _parallel_dims, trace_role


def quiet_warnings() -> None:
    """Warnings a dry run raises by design (parallelize plan keys of modules a
    pipeline stage does not hold print the whole model; fake-backend notes), and
    torchtitan's note that the config's tokenizer is missing (none is read)."""
    import warnings

    from boost_titan.observability import log_filters

    log_filters.install_for_dry_run()

    warnings.filterwarnings("ignore", message="Parallelize plan key")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


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


def _role_worker(config_args: list[str], world_size: int, pp_rank: int) -> RoleReport:
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    quiet_warnings()
    from boost_titan.train.config_check import parse_config

    config = parse_config(config_args)
    config.compile.enable = False  # eager figures (see the module docstring)
    return dry_run_role(config, world_size, pp_rank)


def dry_run(config_args: list[str], world_size: int, pp: int) -> list[RoleReport]:
    """The reports of each pipeline rank's role of one config (see :func:`dry_run_many`)."""
    return dry_run_many([(config_args, world_size, pp)])[0]


def dry_run_many(jobs: list[tuple[list[str], int, int]]) -> list[list[RoleReport]]:
    """Dry-run several configs, each ``(config_args, world_size, pp)``: every role in a
    fresh process (DTensor caches sharding decisions with their process groups, which
    a second fake world in one process would reuse stale), as many at a time as there
    are cores. The processes fork from a server that has imported torch and torchtitan
    once (a spawned process spends ~5 s importing them, about what a 7B role's trace
    takes)."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    roles = [(args, world, s) for args, world, pp in jobs for s in range(pp)]
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["boost_titan.perf.preload"])
    workers = max(1, min(len(roles), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers, mp_context=ctx, max_tasks_per_child=1) as pool:
        futures = [pool.submit(_role_worker, *role) for role in roles]
        reports = iter([f.result() for f in futures])
    return [[next(reports) for _ in range(pp)] for _, _, pp in jobs]


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
