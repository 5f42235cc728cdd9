"""``boost-titan replicas``: a lighthouse and N torchft replica groups on this machine
(``boost_titan.train.replicas``; docs/fault-tolerance.md, "Replica groups (torchft)")::

    boost-titan replicas --groups 2 [--nproc-per-group 1] [--min-replicas 1] \\
        -- --job.config_file train_configs/debug_cola.toml [--section.key VALUE ...]

In order:

1. its own options refused in one line (``--groups`` < 1, ``--min-replicas`` outside
   1..groups, a ``--fault_tolerance.*`` option this command sets itself, more GPUs than
   visible);
2. a lighthouse started in this process (torchft's ``LighthouseServer``, on a free port
   the OS picks, ``min_replicas = 1``): the groups find it through
   ``TORCHFT_LIGHTHOUSE``;
3. the config checked once, as ``run_train.sh``'s pre-check (``launch_check``) checks it
   for one group (``WORLD_SIZE = --nproc-per-group``, its lighthouse included); a bad
   value is one line, exit 2, and no group starts;
4. N groups, each ``run_train.sh`` (its own torchrun, its own rendezvous store on a free
   port: ``RDZV_ENDPOINT`` localhost:0; with GPUs, group i gets the i-th K of the visible
   GPUs as its ``CUDA_VISIBLE_DEVICES``) with ``NGPU = K = --nproc-per-group`` and
   ``--fault_tolerance.enable --fault_tolerance.group_size N --fault_tolerance.replica_id
   i --fault_tolerance.min_replica_size M``; everything after ``--`` goes to every group;
   each group's output goes to ``<dump_folder>/replica_<i>.log`` and, each line prefixed
   ``[replica i]``, to the console;
5. it waits for every group. A group that exits non-zero is reported at once with its
   log (the others go on: that is what replica groups are for); the exit status is 0
   when every group finished with 0, else 1.

Ctrl-C or SIGTERM to this command: every group gets SIGTERM, as ``run_train.sh`` gets
it from SLURM (with ``[checkpoint] enable``, group 0 saves its step); a second one kills
them. On Linux a group also gets SIGTERM if this command dies (the lighthouse dies with
it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from boost_titan.config import Parser, refuse

PROG = "boost-titan replicas"
CONFIG_ERROR_EXIT = 2
# the checkout: run_train.sh and train_configs/ (relative paths are taken from here,
# as run_train.sh takes them)
CHECKOUT = Path(__file__).resolve().parents[2]
SCRIPT = CHECKOUT / "run_train.sh"
# this command's options give these; the same keys after `--` would be overridden
OWN_FT = {
    "--fault_tolerance.enable": "(always set)",
    "--fault_tolerance.no-enable": "(always set)",
    "--fault_tolerance.group_size": "--groups",
    "--fault_tolerance.replica_id": "(one per group)",
    "--fault_tolerance.min_replica_size": "--min-replicas",
}
# a group's run_train.sh is ended with SIGTERM when this process dies (Linux: the
# parent-death signal, set between fork and exec by this one-liner, then exec)
_EXEC_WITH_PDEATHSIG = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0); "
    "os.getppid() == int(sys.argv[1]) or sys.exit(143); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def _parser() -> Parser:
    p = Parser(
        prog=PROG,
        usage=f"{PROG} --groups N [options] [-- TRAINER OPTIONS]",
        description=(
            "A torchft lighthouse and N replica groups on this machine, each its own "
            "run_train.sh (torchrun) with --fault_tolerance.* set; options after -- go to "
            "every group's trainer (e.g. --job.config_file X.toml). docs/fault-tolerance.md"
        ),
    )
    p.add_argument(
        "--groups", type=int, required=True, metavar="N", help="replica groups to start (N >= 1)"
    )
    p.add_argument(
        "--nproc-per-group",
        type=int,
        metavar="K",
        default=1,
        help="ranks per group (run_train.sh's NGPU: GPUs, or CPU ranks on gloo); default 1",
    )
    p.add_argument(
        "--min-replicas",
        type=int,
        metavar="M",
        default=1,
        help="live groups a step needs to be applied (every group's [fault_tolerance] "
        "min_replica_size), 1..N; default 1",
    )
    p.add_argument(
        "--join-timeout-ms",
        type=int,
        metavar="MS",
        default=5000,
        help="how long the lighthouse waits for a live group that has not asked for the "
        "quorum yet before it forms one without it; keep it below [fault_tolerance] "
        "process_group_timeout_ms (10000 by default); default 5000",
    )
    return p


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1 :]
    return argv, []


def _config_file(trainer: list[str], nproc: int) -> tuple[str, list[str]]:
    """The config every group trains (``--job.config_file`` after ``--``, else
    ``CONFIG_FILE``, else run_train.sh's default for ``nproc`` ranks) and the trainer
    options without it."""
    given, rest, i = [], [], 0
    while i < len(trainer):
        a = trainer[i]
        if a == "--job.config_file":
            if i + 1 == len(trainer):
                refuse(PROG, "--job.config_file needs a path")
            given.append(trainer[i + 1])
            i += 2
            continue
        if a.startswith("--job.config_file="):
            given.append(a.split("=", 1)[1])
        else:
            rest.append(a)
        i += 1
    env = os.environ.get("CONFIG_FILE")
    if env:
        given.append(env)
    resolved = {str((CHECKOUT / g).resolve()) for g in given}
    if len(resolved) > 1:
        refuse(PROG, f"two configs given ({', '.join(given)}); give one --job.config_file")
    if given:
        return given[0], rest
    default = "debug_cola.toml" if nproc == 1 else "debug_cola_btp_tp2.toml"
    return f"./train_configs/{default}", rest


def ft_options(groups: int, replica_id: int, min_replicas: int) -> list[str]:
    return [
        "--fault_tolerance.enable",
        "--fault_tolerance.group_size",
        str(groups),
        "--fault_tolerance.replica_id",
        str(replica_id),
        "--fault_tolerance.min_replica_size",
        str(min_replicas),
    ]


def _check_args(args, trainer: list[str]) -> None:
    if args.groups < 1:
        refuse(PROG, f"--groups {args.groups} must be >= 1 (the number of replica groups)")
    if args.nproc_per_group < 1:
        refuse(PROG, f"--nproc-per-group {args.nproc_per_group} must be >= 1")
    if not 1 <= args.min_replicas <= args.groups:
        refuse(
            PROG,
            f"--min-replicas {args.min_replicas} must be in 1..{args.groups} "
            f"(--groups {args.groups})",
        )
    if args.join_timeout_ms < 1:
        refuse(PROG, f"--join-timeout-ms {args.join_timeout_ms} must be >= 1")
    for a in trainer:
        key = a.split("=", 1)[0]
        if key in OWN_FT:
            refuse(
                PROG,
                f"{key} after -- is this command's to set: {OWN_FT[key]} "
                f"(other [fault_tolerance] keys may be given)",
            )
    if not SCRIPT.is_file():
        refuse(PROG, f"needs the checkout's run_train.sh, not found at {SCRIPT}")


def _check_config(config_file: str, rest: list[str], args, address: str):
    """``run_train.sh``'s pre-check for group 0, in this process; the JobConfig."""
    from boost_titan.train.launch_check import CONFIG_ERRORS, parse_launch_config

    saved = {k: os.environ.get(k) for k in ("WORLD_SIZE", "TORCHFT_LIGHTHOUSE")}
    os.environ.update(WORLD_SIZE=str(args.nproc_per_group), TORCHFT_LIGHTHOUSE=address)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # as run_train.sh launches
    argv = ["--job.config_file", config_file, *rest, *ft_options(args.groups, 0, args.min_replicas)]
    try:
        return parse_launch_config(argv), None
    except CONFIG_ERRORS as e:
        return None, e
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class Group:
    """One replica group: its run_train.sh, its log, the thread that copies its output."""

    def __init__(self, i: int, cmd: list[str], env: dict, log: Path, console_lock):
        self.i, self.log = i, log
        self.log_file = open(log, "w", buffering=1)  # noqa: SIM115  (closed by the thread)
        shown = " ".join(cmd[4:] if sys.platform == "linux" else cmd)
        gpus = env.get("CUDA_VISIBLE_DEVICES")
        self.log_file.write(
            f"# replica group {i}: TORCHFT_LIGHTHOUSE={env['TORCHFT_LIGHTHOUSE']} "
            + (f"CUDA_VISIBLE_DEVICES={gpus} " if gpus is not None else "")
            + f"NGPU={env['NGPU']} CONFIG_FILE={env['CONFIG_FILE']} {shown}\n"
        )
        self.proc = subprocess.Popen(
            cmd,
            cwd=CHECKOUT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C reaches this command, which stops the groups
        )
        self._thread = threading.Thread(target=self._copy, args=(console_lock,), daemon=True)
        self._thread.start()

    def _copy(self, console_lock) -> None:
        prefix = f"[replica {self.i}] "
        with self.log_file:
            for raw in self.proc.stdout:
                line = raw.decode("utf-8", "replace")
                self.log_file.write(line)
                with console_lock:
                    sys.stdout.write(prefix + line)
                    sys.stdout.flush()

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            try:
                if sig == signal.SIGKILL:  # the whole group: run_train.sh, torchrun, ranks
                    os.killpg(self.proc.pid, sig)
                else:  # run_train.sh forwards SIGTERM to torchrun, which stops the ranks
                    self.proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def finish(self) -> int:
        rc = self.proc.wait()
        self._thread.join()
        return rc


def gpu_sets(groups: int, per_group: int) -> list[str] | None:
    """Each group's ``CUDA_VISIBLE_DEVICES``: its own ``per_group`` GPUs of those this
    process sees (run_train.sh would give every group GPUs 0..K-1); None without GPUs."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    need = groups * per_group
    if need > len(ids):
        refuse(
            PROG,
            f"--groups {groups} x --nproc-per-group {per_group} need {need} GPUs (one rank "
            f"per GPU), {len(ids)} visible ({','.join(ids)})",
        )
    return [",".join(ids[i * per_group : (i + 1) * per_group]) for i in range(groups)]


def _group_env(args, config_file: str, address: str) -> dict:
    env = dict(os.environ)
    env.update(
        TORCHFT_LIGHTHOUSE=address,
        NGPU=str(args.nproc_per_group),
        CONFIG_FILE=config_file,
        BOOST_TITAN_PRECHECK="0",  # checked above, once for every group
    )
    env.setdefault("PYTHON", sys.executable)
    env.setdefault("HF_DATASETS_OFFLINE", "1")
    if "OMP_NUM_THREADS" not in env:  # run_train.sh would give each group every core
        ranks = args.groups * args.nproc_per_group
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // ranks))
    env.pop("WORLD_SIZE", None)
    return env


def _command(rest: list[str], args, i: int) -> list[str]:
    cmd = [str(SCRIPT), *rest, *ft_options(args.groups, i, args.min_replicas)]
    if sys.platform == "linux":
        return [sys.executable, "-c", _EXEC_WITH_PDEATHSIG, str(os.getpid()), *cmd]
    return cmd


def main(argv: list[str] | None = None) -> int:
    own, trainer = _split(sys.argv[1:] if argv is None else list(argv))
    args = _parser().parse_args(own)
    _check_args(args, trainer)
    config_file, rest = _config_file(trainer, args.nproc_per_group)
    gpus = gpu_sets(args.groups, args.nproc_per_group)
    os.chdir(CHECKOUT)  # paths as run_train.sh reads them

    # the lighthouse logs every quorum request at INFO (RUST_LOG, read when torchft is
    # imported): warnings only on this console unless RUST_LOG says otherwise
    rust_log = os.environ.get("RUST_LOG")
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    if rust_log is None:
        os.environ.pop("RUST_LOG")  # the groups log as under run_train.sh

    # min_replicas 1: the lighthouse forms a quorum of whichever groups are live, and
    # --min-replicas (each group's min_replica_size) decides whether a step is applied;
    # a quorum short of the lighthouse's own minimum would fail the waiting groups
    # outright at torchft's quorum timeout instead of letting their steps wait
    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=args.join_timeout_ms
    )
    address = lighthouse.address()
    try:
        config, error = _check_config(config_file, rest, args, address)
        if error is not None:
            refuse(PROG, error, CONFIG_ERROR_EXIT)
        return _run(args, config, config_file, rest, address, gpus)
    finally:
        lighthouse.shutdown()


def _run(args, config, config_file: str, rest: list[str], address: str, gpus) -> int:
    dump = Path(config.job.dump_folder)
    dump.mkdir(parents=True, exist_ok=True)
    print(
        f"{PROG}: lighthouse {address} (steps need {args.min_replicas} live group(s)); "
        f"{args.groups} group(s) of {args.nproc_per_group} rank(s) on {config_file}; logs "
        f"{dump}/replica_<i>.log",
        flush=True,
    )
    env = _group_env(args, config_file, address)
    lock = threading.RLock()  # (the signal handler prints too, on the main thread)
    groups: list[Group] = []
    stopping = []

    def stop(signum, _frame):
        stopping.append(signum)
        sig = signal.SIGTERM if len(stopping) == 1 else signal.SIGKILL
        how = "stopping every group (SIGTERM; again to kill them)"
        if sig == signal.SIGKILL:
            how = "killing every group"
        with lock:
            print(f"{PROG}: {signal.Signals(signum).name}: {how}", file=sys.stderr, flush=True)
        for g in groups:
            g.signal(sig)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i in range(args.groups):
            if stopping:
                break
            group_env = env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus[i]}
            log = dump / f"replica_{i}.log"
            groups.append(Group(i, _command(rest, args, i), group_env, log, lock))
        return _wait(groups, lock, stopping)
    finally:
        for g in groups:  # an exception here (not a signal): nothing left behind
            g.signal(signal.SIGKILL)
        for s, h in previous.items():
            signal.signal(s, h)


def _wait(groups: list[Group], lock, stopping: list) -> int:
    failed = []
    pending = list(groups)
    while pending:
        time.sleep(0.2)
        for g in [g for g in pending if g.proc.poll() is not None]:
            pending.remove(g)
            rc = g.finish()
            if rc != 0:
                failed.append(g)
                what = "stopped" if stopping else "exited"
                with lock:
                    print(
                        f"{PROG}: replica group {g.i} {what} with status {rc} (log: {g.log})",
                        file=sys.stderr,
                        flush=True,
                    )
    if failed:
        with lock:
            print(
                f"{PROG}: {len(failed)} of {len(groups)} group(s) did not finish: "
                + ", ".join(f"{g.i} ({g.log})" for g in failed),
                file=sys.stderr,
                flush=True,
            )
        return 1
    return 0
