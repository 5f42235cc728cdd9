"""The test suite's process launcher: a ``main(argv)`` of boost_titan (the trainer,
the dry run, the checkpoint CLI) in fresh processes, one per rank, each forked from a
server that imported torch, torchtitan and boost_titan once (``boost_titan.perf.preload``).

What torchrun and ``python -m`` do for a run that matters to the code under test, it
does too: the environment of ``torch.distributed.run`` (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, ...), run_train.sh's defaults (OMP_NUM_THREADS = cores / ranks, of
the cores this pytest worker may use: :func:`cores`; HF_DATASETS_OFFLINE=1), the exit
code (``SystemExit``, an exception, ``main``'s return value) and the CPU runtime's
clean exit, each rank's stdout and stderr kept apart (a
run's text as torchrun tees it: lines prefixed ``[rank<r>]:``), and, when a rank fails,
the others stopped. What it saves per launch: torchrun's agent and every process's
imports (~10 s of a 15-20 s debug run on 2 cores; ~5 s of a CLI call).

Tests of the launcher itself (run_train.sh, torchrun restarts, signals, the README's
runs) go through run_train.sh: ``helpers.run_training(..., launcher="torchrun")``.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass

PRELOAD = "boost_titan.perf.preload"


def cores() -> int:
    """The cores this pytest process may use: the machine's, shared out among xdist's
    workers (``make test``: two). Each worker otherwise sized its ranks' OpenMP pools
    for the whole machine, and two workers on two cores ran up to four spinning
    OpenMP threads: test_btp beside another job on this machine took 615 s of wall
    and 142 s of CPU at two threads, 114 s and 47 s at one."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def main(argv: list[str]) -> None:
    """A launched process's own view (``launch("launcher", ...)``): its intra-op
    threads and OMP_NUM_THREADS, one line."""
    import torch

    print(f"threads {torch.get_num_threads()} omp {os.environ.get('OMP_NUM_THREADS')}")


@dataclass
class Launched:
    returncode: int  # the first failing process's, -9 when stopped at the timeout
    stdout: list[str]  # per rank
    stderr: list[str]

    def tee(self) -> str:
        """All ranks' stdout then stderr, each line prefixed ``[rank<r>]:`` (torchrun
        --tee 3)."""
        lines = []
        for streams in (self.stdout, self.stderr):
            for rank, text in enumerate(streams):
                lines += [f"[rank{rank}]:{line}" for line in text.splitlines()]
        return "\n".join(lines) + "\n"


def _process_main(entry: str, argv: list[str], env: dict[str, str], cwd: str, logs) -> None:
    """One process: its environment, cwd and output files, then ``entry.main(argv)``
    and exit as ``python -m entry`` would (the trainer: the CPU runtime's clean exit)."""
    for fd, path in zip((1, 2), logs):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import torch

    from boost_titan.parallel import cpu_runtime

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = [entry, *argv]
    code = 0
    try:
        code = importlib.import_module(entry).main(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code == 0 and entry == "boost_titan.train.trainer" and cpu_runtime.is_active():
        cpu_runtime.exit_after_clean_shutdown()
    os._exit(code)


def launch(
    entry: str,
    argv: list[str],
    nproc: int,
    env: dict[str, str],
    cwd: str,
    log_dir: str,
    timeout: float,
    distributed: bool = True,
) -> Launched:
    """``entry.main(argv)`` in ``nproc`` processes (``distributed``: as the ranks of one
    torchrun launch)."""
    os.makedirs(log_dir, exist_ok=True)
    env = dict(env)
    # this worker's cores shared out among the ranks; a value inherited from the worker's
    # environment (conftest: its whole share) or asked for is never more than that
    share = max(1, cores() // nproc)
    env["OMP_NUM_THREADS"] = str(min(int(env.get("OMP_NUM_THREADS") or share), share))
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    store = None
    if distributed:
        # the launcher hosts the rendezvous store, as torchrun's agent does: a port the
        # OS picked and holds, no race for a free one
        from torch.distributed import TCPStore

        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        env.update(
            TORCHELASTIC_USE_AGENT_STORE="True",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(store.port),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            ROLE_NAME="rank",
            TORCHELASTIC_RESTART_COUNT="0",
            TORCHELASTIC_MAX_RESTARTS="0",
            TORCHELASTIC_RUN_ID="boost-tests",
        )
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    logs = [
        (os.path.join(log_dir, f"rank{r}.out"), os.path.join(log_dir, f"rank{r}.err"))
        for r in range(nproc)
    ]
    procs = []
    for rank in range(nproc):
        rank_env = dict(env)
        if distributed:
            rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        p = ctx.Process(target=_process_main, args=(entry, argv, rank_env, cwd, logs[rank]))
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    rc = 0
    while any(p.is_alive() for p in procs):
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed or time.monotonic() > deadline:
            rc = failed[0] if failed else -signal.SIGKILL
            time.sleep(0.5)  # let a failing rank's peers print their side
            for p in procs:
                if p.is_alive():
                    p.kill()
            break
        time.sleep(0.05)
    for p in procs:
        p.join()
    del store
    rc = rc or next((p.exitcode for p in procs if p.exitcode != 0), 0)

    def read(path: str) -> str:
        with open(path, errors="replace") as f:
            return f.read()

    return Launched(rc, [read(out) for out, _ in logs], [read(err) for _, err in logs])


def spawn(fn, args: tuple, nprocs: int) -> None:
    """``torch.multiprocessing.spawn(fn, args, nprocs)`` (``fn(rank, *args)`` in each
    process, an error in any re-raised here), the processes forked from the server."""
    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload([PRELOAD])
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
