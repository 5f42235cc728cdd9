"""The test suite's rank launcher: ``boost_titan.train.main`` on N gloo ranks, each
rank forked from a server that imported the trainer once (``boost_titan.preload``).

What torchrun does for a run that matters to the trainer, it does too: the
environment of ``torch.distributed.run`` (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/
PORT, ...), run_train.sh's defaults (OMP_NUM_THREADS = cores / ranks,
HF_DATASETS_OFFLINE=1), the exit (``cpu_runtime.exit_after_clean_shutdown``), every
line of a rank's output prefixed ``[rank<r>]:`` and, when a rank fails, the others
stopped. What it saves: per launch, torchrun's agent and each rank's imports of torch,
torchtitan and boost_titan (~10 s of a 15-20 s debug run on 2 cores).

Tests of the launcher itself (run_train.sh, torchrun restarts, signals, the README's
commands) launch through run_train.sh: ``helpers.run_training(..., launcher="torchrun")``.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import sys
import time
import traceback

PRELOAD = "boost_titan.preload"


def _context():
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> None:
    """One rank: torchrun's environment, output to ``log_path``, then the trainer's own
    ``main`` and exit, as ``python -m boost_titan.train`` runs them."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    import torch

    from boost_titan import cpu_runtime

    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    sys.argv = ["boost_titan.train", *argv]
    try:
        import boost_titan.train

        boost_titan.train.main(argv)
    except SystemExit as e:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)
    if cpu_runtime.is_active():
        cpu_runtime.exit_after_clean_shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    argv: list[str], ngpu: int, env: dict[str, str], cwd: str, log_dir: str, timeout: float
) -> tuple[int, str]:
    """Train ``argv`` on ``ngpu`` ranks; returns (exit code, output). The exit code is
    the first failing rank's, or -9 for a run stopped at ``timeout`` seconds."""
    os.makedirs(log_dir, exist_ok=True)
    env = dict(env)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ngpu)))
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    env.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    env.setdefault("LOG_RANK", ",".join(map(str, range(ngpu))))
    env.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        WORLD_SIZE=str(ngpu),
        LOCAL_WORLD_SIZE=str(ngpu),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="rank",
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="boost-tests",
    )
    ctx = _context()
    logs = [os.path.join(log_dir, f"rank{r}.log") for r in range(ngpu)]
    procs = []
    for rank in range(ngpu):
        rank_env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
        p = ctx.Process(target=_rank_main, args=(argv, rank_env, cwd, logs[rank]), daemon=False)
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
    rc = rc or next((p.exitcode for p in procs if p.exitcode != 0), 0)
    out = []
    for rank, path in enumerate(logs):
        with open(path, errors="replace") as f:
            out += [f"[rank{rank}]:{line}" for line in f.read().splitlines()]
    return rc, "\n".join(out) + "\n"
