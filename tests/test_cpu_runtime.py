"""boost_titan.parallel.cpu_runtime: the CPU/gloo shims for torchtitan 0.2.2.

activate() must precede the first torchtitan import, so every check runs in a fresh
interpreter and reports back as JSON on its last stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="cpu_runtime is inert when CUDA is present"
)


def run_fresh(code: str) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# One fresh interpreter for every post-activation check (importing torchtitan costs
# 10-20 s on this machine); each test below asserts on its part of the report.
_FRESH_SCRIPT = """
import gc, json, os, sys, torch
from torch.profiler import ProfilerActivity

def profile_none():
    try:
        with torch.profiler.profile(activities=[ProfilerActivity.CPU, None]) as p:
            torch.mm(torch.ones(8, 8), torch.ones(8, 8))
        return sorted({e.name for e in p.events()})
    except TypeError as e:
        return "TypeError: " + str(e)

report = {}
report["profile_before"] = profile_none()

from boost_titan.parallel import cpu_runtime
report["torchtitan_imported_early"] = "torchtitan" in sys.modules
report["before"] = torch._utils._get_available_device_type()
report["on"] = cpu_runtime.activate()
report["again"] = cpu_runtime.activate()
report["active"] = cpu_runtime.is_active()
report["profile_after"] = profile_none()

from torchtitan.tools import utils
report.update(
    device_type=utils.device_type,
    device_module=utils.device_module is torch.cpu,
    current_device=torch.cpu.current_device(),
    current_device_type=type(torch.cpu.current_device()).__name__,
    name=torch.cpu.get_device_name(),
    total=torch.cpu.get_device_properties(0).total_memory,
    stats=torch.cpu.memory_stats(),
    empty=torch.cpu.empty_cache(),
)

# ---- RSS monitor
mon = cpu_runtime.RSSMemoryMonitor()
GiB = 2**30
def vm(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GiB
def d(s):
    return dict(active=s.max_active_gib, active_pct=s.max_active_pct,
                reserved=s.max_reserved_gib, reserved_pct=s.max_reserved_pct,
                retries=s.num_alloc_retries, ooms=s.num_ooms)
s0 = mon.get_peak_stats()
ref0 = (vm("VmRSS"), vm("VmHWM"))
x = torch.ones(50_000_000)  # 200 MB, every page touched
x.add_(1)
s1 = mon.get_peak_stats()
del x
gc.collect()
s2 = mon.get_peak_stats()  # freed, peak not reset yet
mon.reset_peak_stats()
s3 = mon.get_peak_stats()
ref3 = (vm("VmRSS"), vm("VmHWM"))
report["rss"] = dict(s0=d(s0), s1=d(s1), s2=d(s2), s3=d(s3), ref0=ref0, ref3=ref3,
                     cap=mon.device_capacity_gib)

# ---- peak FLOP/s
report["measured"] = cpu_runtime.measure_matmul_peak_flops(n=256, seconds=0.2)
report["configured"] = cpu_runtime.resolve_peak_flops(1.5e12)
os.environ["BOOST_CPU_PEAK_FLOPS"] = "2.5e11"
report["from_env"] = cpu_runtime.resolve_peak_flops(0.0)
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def fresh() -> dict:
    return run_fresh(_FRESH_SCRIPT)


def test_activate_makes_torchtitan_run_on_cpu(fresh):
    r = fresh
    assert r["torchtitan_imported_early"] is False  # cpu_runtime must not import torchtitan
    assert r["before"] is None  # no accelerator: torchtitan alone would pick "cuda"
    assert r["on"] is True and r["again"] is True and r["active"] is True
    assert r["device_type"] == "cpu"
    assert r["device_module"] is True
    assert r["current_device"] == 0 and r["current_device_type"] == "int"
    assert r["name"].startswith("CPU")
    meminfo = Path("/proc/meminfo").read_text().split("\n")[0].split()
    assert meminfo[0] == "MemTotal:"
    assert r["total"] == int(meminfo[1]) * 1024
    assert r["stats"] == {} and r["empty"] is None


def test_rss_memory_monitor_tracks_peak(fresh):
    r = fresh["rss"]
    s0, s1, s2, s3 = r["s0"], r["s1"], r["s2"], r["s3"]
    for s in (s0, s1, s2, s3):
        assert s["active"] > 0 and s["reserved"] > 0
        assert s["reserved"] >= s["active"]
        assert s["retries"] == 0 and s["ooms"] == 0
        assert s["reserved_pct"] == pytest.approx(100 * s["reserved"] / r["cap"])
    # matches /proc/self/status read independently (RSS moves a little between reads)
    assert s0["active"] == pytest.approx(r["ref0"][0], abs=0.02)
    assert s0["reserved"] == pytest.approx(r["ref0"][1], abs=0.02)
    alloc = 200e6 / 2**30
    assert s1["active"] - s0["active"] > 0.9 * alloc
    assert s1["reserved"] - s0["reserved"] > 0.9 * alloc
    # after freeing: RSS falls, the peak stays until reset
    assert s2["active"] < s1["active"] - 0.9 * alloc
    assert s2["reserved"] > s1["reserved"] - 0.01  # kernel RSS counters lag a few KiB
    # reset: the peak drops back to about the current RSS
    assert s3["reserved"] < s2["reserved"] - 0.9 * alloc
    assert s3["reserved"] == pytest.approx(r["ref3"][1], abs=0.02)


def test_measure_matmul_peak_flops_and_resolution(fresh):
    # a CPU core does between ~1e8 and ~1e13 fp32 FLOP/s
    assert 1e8 < fresh["measured"] < 1e13
    assert fresh["configured"] == 1.5e12
    assert fresh["from_env"] == 2.5e11


def test_profiler_patch_drops_none_activity(fresh):
    # unpatched torch refuses None; patched it profiles the CPU ops
    before, after = fresh["profile_before"], fresh["profile_after"]
    assert isinstance(before, str) and before.startswith("TypeError")
    assert isinstance(after, list) and "aten::mm" in after


def test_importing_torchtitan_first_raises_clear_error():
    code = textwrap.dedent(
        """
        import torchtitan.tools.utils
        from boost_titan.parallel import cpu_runtime
        cpu_runtime.activate()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode != 0
    assert "RuntimeError" in proc.stderr
    assert "must run before torchtitan is imported" in proc.stderr
    assert "'cuda'" in proc.stderr


def _sharded_init_worker(rank: int, init_file: str, out_file: str) -> None:
    """4 gloo ranks: Linear pairs under TP2 (colwise, rowwise) and under TP2 x FSDP2
    (``_StridedShard`` placements), initialised as torchtitan does (meta, to_empty,
    seeded ``trunc_normal_``), against the same init on one device."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def pair() -> torch.nn.Module:
        return torch.nn.Sequential(
            torch.nn.Linear(6, 10, bias=False), torch.nn.Linear(10, 6, bias=False)
        )

    def init(model: torch.nn.Module) -> None:
        torch.manual_seed(0)
        for p in model.parameters():
            torch.nn.init.trunc_normal_(p, std=0.02)  # uniform_ then elementwise
        torch.nn.init.normal_(model[1].weight)

    reference = pair()
    init(reference)
    report = {}
    for layout in ("tp2", "tp2_fsdp2"):
        with torch.device("meta"):
            model = pair()
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "1": RowwiseParallel()})
        if layout == "tp2_fsdp2":
            fully_shard(model, mesh=mesh["dp"])
        model.to_empty(device="cpu")
        init(model)
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            full = p.full_tensor()  # a collective: every rank
            report[f"{layout} {name} {p.placements}"] = torch.equal(full, q.detach())
    if rank == 0:
        with open(out_file, "w") as f:
            json.dump(report, f)
    dist.destroy_process_group()


@pytest.mark.slow
def test_sharded_random_init_equals_one_device(tmp_path):
    """DTensor draws every CPU shard from the local generator (each TP rank got the same
    numbers: a TP2 weight's halves were copies); cpu_runtime draws the global tensor and
    keeps the shard, so any layout's init is the 1-process init with the same seed."""
    from launcher import spawn

    out = tmp_path / "init.json"
    spawn(_sharded_init_worker, (str(tmp_path / "pg"), str(out)), 4)
    report = json.loads(out.read_text())
    assert len(report) == 4 and any("_StridedShard" in k for k in report), report
    assert all(report.values()), report


@pytest.mark.parametrize("workers,asked", [(1, None), (2, None), (2, "64")])
def test_a_launched_process_gets_its_workers_share_of_the_cores(
    tmp_path, monkeypatch, workers, asked
):
    """Under ``pytest -n workers`` each worker's processes get its share of the cores
    (tests/launcher.py: ``cores``), never threads for the whole machine, even when more
    are asked for: two workers each sizing their pools for both cores of a 2-core
    machine ran up to four spinning OpenMP threads (tests/README.md)."""
    from launcher import launch

    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    env = {"PATH": os.environ["PATH"], **({"OMP_NUM_THREADS": asked} if asked else {})}
    out = launch("launcher", [], 1, env, str(tmp_path), str(tmp_path / "logs"), 120, False)
    assert out.returncode == 0, out.stderr
    share = str(max(1, (os.cpu_count() or 1) // workers))
    assert out.stdout[0].split() == ["threads", share, "omp", share], out.stdout
