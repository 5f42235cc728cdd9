"""What a replica group's death and return cost, and what a DiLoCo outer sync sends.

    PYTHONPATH=. .venv/bin/python benchmarks/replica_groups.py [--steps 200] [--kill-after 4]

One run, side by side: a lighthouse in this process and two torchft replica groups of
one CPU rank each (``run_train.sh``, train_configs/debug_cola.toml, seq_len 64,
``min_replica_size`` 1). Group 1 SIGKILLs itself after step ``--kill-after``
(``BOOST_TITAN_INJECT``); as soon as it is dead it is launched again and recovers from
group 0 while group 0 trains on. From the ranks' logs (``BOOST_TITAN_PARAM_DIGEST=1``
marks every committed step) it prints:

* death -> the survivor's next committed step (the collectives' timeout and the
  lighthouse's heartbeat bound it);
* the relaunched group: launch -> trainer ready ("Training starts") -> recovered from the
  live group -> its first committed step, and the bytes its rank received;
* the bytes of one DiLoCo outer sync per group (every parameter, fp32, once; a ring
  all-reduce sends 2 (N-1)/N of it) for CoLA and its dense twin at the debug and 7B
  flavors, from the parameter counts (``boost_titan.perf.plan.params_per_rank``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_STAMP = r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})"
_COMMITTED = re.compile(
    _STAMP + r" - root - INFO - \[fault_tolerance\] group \d+ step (\d+) params"
)


def _t(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _group(i: int, args, root: Path, extra_env: dict[str, str], tag: str) -> subprocess.Popen:
    env = {
        **os.environ,
        "NGPU": "1",
        "OMP_NUM_THREADS": "1",
        "BOOST_TITAN_PARAM_DIGEST": "1",
        "PYTHONPATH": str(REPO),
        **extra_env,
    }
    log = open(root / f"{tag}.log", "w")
    cmd = [
        str(REPO / "run_train.sh"),
        "--job.config_file", "train_configs/debug_cola.toml",
        "--job.dump_folder", str(root / tag),
        "--training.steps", str(args.steps), "--training.seq_len", "64",
        "--validation.no-enable", "--boost.profile_freq", "0",
        "--metrics.no-enable-tensorboard", "--metrics.disable_color_printing",
        "--fault_tolerance.enable", "--fault_tolerance.group_size", "2",
        "--fault_tolerance.replica_id", str(i), "--fault_tolerance.min_replica_size", "1",
        "--fault_tolerance.process_group_timeout_ms", str(args.timeout_ms),
    ]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)


def _first(pattern: str, text: str) -> float | None:
    m = re.search(_STAMP + r".*" + pattern, text)
    return _t(m[1]) if m else None


def failure_and_recovery(args) -> None:
    os.environ.setdefault("RUST_LOG", "warn")  # (the lighthouse's every quorum: RUST_LOG=info)
    from torchft._torchft import LighthouseServer

    server = LighthouseServer(
        bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=args.heartbeat_ms
    )
    os.environ["TORCHFT_LIGHTHOUSE"] = server.address()
    root = Path(tempfile.mkdtemp(prefix="replica_groups_"))
    try:
        survivor = _group(0, args, root, {}, "group0")
        killed = _group(
            1, args, root, {"BOOST_TITAN_INJECT": f"sigkill@{args.kill_after}"}, "group1"
        )
        killed.wait()
        relaunched_at = time.time()
        rejoined = _group(1, args, root, {}, "group1b")
        for p in (survivor, rejoined):
            p.wait(timeout=900)
    finally:
        server.shutdown()
    logs = {tag: (root / f"{tag}.log").read_text() for tag in ("group0", "group1", "group1b")}
    died = _first(f"SIGKILL after step {args.kill_after}", logs["group1"])
    after = [(_t(s), int(n)) for s, n in _COMMITTED.findall(logs["group0"]) if _t(s) > died]
    print(f"logs: {root}")
    print("| event | seconds | note |")
    print("|---|---:|---|")
    if after:
        print(
            f"| group 1 dies -> group 0's next committed step ({after[0][1]}) | "
            f"{after[0][0] - died:.2f} | collectives' timeout {args.timeout_ms} ms, "
            f"heartbeat {args.heartbeat_ms} ms |"
        )
    ready = _first("Training starts at step", logs["group1b"])
    m = re.search(
        _STAMP + r".*recovered from a live group: step (\d+).*?([\d.]+) MiB", logs["group1b"]
    )
    first = [_t(s) for s, _ in _COMMITTED.findall(logs["group1b"])]
    if not (ready and m and first):
        print("| relaunched group did not recover (survivor done first? raise --steps) | | |")
        return
    print(
        "| relaunch -> trainer ready (process start, model, data) | "
        f"{ready - relaunched_at:.2f} | |"
    )
    print(
        f"| trainer ready -> recovered from group 0 (quorum, transfer, load) | "
        f"{_t(m[1]) - ready:.2f} | at step {m[2]}, {m[3]} MiB received by its rank |"
    )
    print(f"| recovered -> its first committed step | {first[0] - _t(m[1]):.2f} | |")
    print(f"| relaunch -> first committed step | {first[0] - relaunched_at:.2f} | |")


def outer_sync_bytes() -> None:
    from boost_titan.models.flavors import flavors_for
    from boost_titan.perf.plan import params_per_rank

    print()
    print("| flavor | model | parameters | one outer sync (fp32) | sent per group, ring, N=8 |")
    print("|---|---|---:|---:|---:|")
    for flavor in ("debugmodel", "7b"):
        for arch, plan in (("dense", "fullrank"), ("cola", "vanilla")):
            args = flavors_for(arch)[flavor]
            n = params_per_rank(args, plan, 1)
            b = 4 * n
            print(
                f"| {flavor} | {arch} | {n / 1e9:.3f} B | {b / 2**30:.2f} GiB | "
                f"{2 * 7 / 8 * b / 2**30:.2f} GiB |"
            )


#: Llama 3's report: 466 job interruptions in 54 days on 16,384 GPUs
FAILURES_PER_GPU_DAY = 466 / 54 / 16384


def gpu_hours_lost(args) -> None:
    """GPU-hours lost per day at the Llama 3 failure rate: checkpoint-restart (every GPU
    waits for the restart and redoes, on average, half a checkpoint interval) against
    replica groups (every GPU loses the detection and the step in flight; the failed
    group alone waits for its relaunch and its recovery from a peer)."""
    restart = args.load_s + args.other_s
    redo = args.interval / 2 * args.step_s
    detect = args.detect_s + args.step_s
    recover = args.other_s + args.recover_s
    print()
    print(
        f"step {args.step_s} s, checkpoint every {args.interval} steps, a restart's load "
        f"{args.load_s} s + the rest of a restart {args.other_s} s; replica groups of "
        f"{args.group_gpus} GPUs, detection {detect:.1f} s (--detect-s + the step in "
        f"flight), a relaunched group's recovery {args.recover_s} s"
    )
    print(
        "| GPUs | failures/day | checkpoint-restart GPU-h/day | replica groups GPU-h/day | ratio |"
    )
    print("|---:|---:|---:|---:|---:|")
    for gpus in (1024, 4096):
        per_day = gpus * FAILURES_PER_GPU_DAY
        restart_h = per_day * gpus * (redo + restart) / 3600
        ft_h = per_day * (gpus * detect + args.group_gpus * recover) / 3600
        print(
            f"| {gpus:,} | {per_day:.2f} | {restart_h:,.1f} ({restart_h / (24 * gpus):.2%}) | "
            f"{ft_h:,.1f} ({ft_h / (24 * gpus):.3%}) | {restart_h / ft_h:.0f}x |"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps",
        type=int,
        default=200,
        help="steps of each group (default 200: "
        "the survivor must still train when the relaunched group is up)",
    )
    p.add_argument("--kill-after", type=int, default=4, help="group 1 dies after this step")
    p.add_argument("--timeout-ms", type=int, default=2000, help="process_group_timeout_ms")
    p.add_argument("--heartbeat-ms", type=int, default=1000, help="lighthouse heartbeat timeout")
    p.add_argument("--arithmetic-only", action="store_true", help="only the GPU-hours table")
    g = p.add_argument_group("the GPU-hours arithmetic")
    g.add_argument(
        "--step-s",
        type=float,
        default=0.567,
        help="seconds per step (default: "
        "the step-time model's cola_llama2 7b, h100-80, TP4, seq 4096, micro-batch 8)",
    )
    g.add_argument("--interval", type=int, default=1000, help="checkpoint interval (recipes')")
    g.add_argument(
        "--load-s",
        type=float,
        default=26.4,
        help="a rank's load of a sealed step "
        "at 1,024 ranks (docs/checkpoints.md: 18.6 s plain .metadata + 7.7 s ours)",
    )
    g.add_argument(
        "--other-s",
        type=float,
        default=120.0,
        help="the rest of a restart or a "
        "relaunch (scheduler, processes, NCCL, compile): not measured here",
    )
    g.add_argument(
        "--recover-s",
        type=float,
        default=4.2,
        help="a group's recovery from a "
        "peer: cola 7b's weights and AdamW moments, 4.2 GB per GPU of an 8-GPU "
        "group, at 1 GB/s (torchft's HTTP transport; not measured on GPUs)",
    )
    g.add_argument(
        "--detect-s",
        type=float,
        default=15.0,
        help="a death to the survivors' "
        "next step, at most: the defaults' collectives' timeout 10 s + heartbeat "
        "5 s (the run above measures it at its own, shorter, settings)",
    )
    g.add_argument("--group-gpus", type=int, default=8, help="GPUs per replica group")
    args = p.parse_args()
    if args.arithmetic_only:
        gpu_hours_lost(args)
        return
    if not 1 <= args.kill_after < args.steps:
        p.error(f"--kill-after {args.kill_after}: give 1..{args.steps - 1} (below --steps)")
    failure_and_recovery(args)
    outer_sync_bytes()
    gpu_hours_lost(args)


if __name__ == "__main__":
    sys.exit(main())
