"""LORO on real gloo ranks.

* One lazy and one exact step under TP2 (BTP), FSDP2 x TP2 and FSDP4 equal the
  single-device LORO step on the same weights and gradients (fp32, 1e-5 relative).
* Through the trainer from one seed checkpoint: 1 process, TP2, PP2 and TP2 x FSDP2
  train the same losses across two exact steps, and a TP2 DCP resume across an exact
  step is bit-exact (losses, grad norms, and the exact-step schedule)."""

from __future__ import annotations

import copy
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import assert_safe_metadata, run_training
from launcher import spawn

WORLD = 4
FP32 = ("--training.mixed_precision_param", "float32")
K = 3  # exact steps at 3 and 6
RUN = (
    "--validation.no-enable",
    "--metrics.no-enable-tensorboard",
    "--training.steps",
    "7",
    "--optimizer.loro_freq",
    str(K),
    *FP32,
)


def _worker(rank: int, init_file: str):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh_2d = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        mesh_1d = init_device_mesh("cpu", (WORLD,), mesh_dim_names=("dp",))
        for exact in (False, True):
            _check(exact, tp_mesh=mesh_2d["tp"], dp_mesh=None)
            _check(exact, tp_mesh=mesh_2d["tp"], dp_mesh=mesh_2d["dp"])
            _check(exact, tp_mesh=None, dp_mesh=mesh_1d["dp"])
    finally:
        dist.destroy_process_group()


def _check(exact: bool, tp_mesh, dp_mesh):
    from test_loro import HP, _grads, _single_step, svd_args
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor
    from tp_sim import plan_fn, reference_model

    from boost_titan.optim.loro import LORO
    from boost_titan.optim.manifold import group_size, share_groups, tall_layout

    layout = f"{'TP2' if tp_mesh else ''}{' x ' if tp_mesh and dp_mesh else ''}"
    layout += f"FSDP{dp_mesh.size()}" if dp_mesh else ""
    ref = reference_model(svd_args(), seed=0)
    grads = _grads(ref)
    want, _ = _single_step(ref, grads, exact)

    def parallel():
        model = copy.deepcopy(ref)
        if tp_mesh is not None:
            plan_fn("btp")(model, tp_mesh)
        if dp_mesh is not None:
            for block in model.layers.values():
                fully_shard(block, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        for n, p in model.named_parameters():
            g = grads[n]
            p.grad = (
                distribute_tensor(g, p.device_mesh, p.placements) if isinstance(p, DTensor) else g
            )
        return model

    model = parallel()
    # the layouts the exact step sees: row-split mesh dims (TSQR) vs rank-split (gathered)
    wq = model.layers["0"].attention.wq
    up, down = tall_layout(wq.up.weight, 0, "up"), tall_layout(wq.down.weight, 1, "down")
    n_rows = lambda lay: len(lay.rows)  # noqa: E731
    assert (n_rows(up), up.gather, n_rows(down), len(down.gather)) == {
        "TP2": (1, [], 1, 0),  # B Shard(0), A Shard(1): both split by rows
        "TP2 x FSDP2": (2, [], 1, 1),  # B rows on dp (strided) and tp; A's r on dp
        "FSDP4": (1, [], 0, 1),  # FSDP's Shard(0) of A splits r: gathered
    }[layout], (layout, wq.up.weight.placements, wq.down.weight.placements)
    opt = LORO(model, model_dim=ref.model_args.dim, exact_every=1 if exact else 10**6, **HP)
    opt.step()
    for (n, p), q in zip(model.named_parameters(), want.parameters()):
        full = p.full_tensor() if isinstance(p, DTensor) else p
        rel = ((full - q).abs().max() / q.abs().max()).item()
        assert rel < 1e-5, (layout, "exact" if exact else "lazy", n, rel)
    if not exact:
        return
    # each core SVD on one rank of the pair's group (TP2: 2 ranks; FSDP: all 4) equals
    # every rank doing every SVD, bit for bit
    groups = share_groups(wq.up.weight, wq.down.weight, "wq")
    assert group_size(groups) == {"TP2": 2, "TP2 x FSDP2": 4, "FSDP4": 4}[layout]
    replicated = parallel()
    LORO(replicated, model_dim=ref.model_args.dim, exact_every=1, spread=False, **HP).step()
    for (n, p), q in zip(model.named_parameters(), replicated.parameters()):
        assert torch.equal(p.to_local(), q.to_local()), (layout, n)


def test_step_on_ranks_equals_single_device(tmp_path):
    spawn(_worker, (str(tmp_path / "pg"),), WORLD)


# ------------------------------------------------------------------- run_train.sh
@pytest.fixture(scope="module")
def loro_seed(seed_checkpoint) -> Path:
    return seed_checkpoint("debug_svd_loro.toml")


def _from(seed: Path, *extra: str) -> tuple[str, ...]:
    return ("--checkpoint.enable", "--checkpoint.initial_load_path", str(seed), *RUN, *extra)


@pytest.fixture(scope="module")
def loro_single(loro_seed, tmp_path_factory):
    dump = tmp_path_factory.mktemp("loro_single")
    return run_training("debug_svd_loro.toml", 1, dump, *_from(loro_seed, "--checkpoint.load_only"))


def test_single_process_loss_falls(loro_single):
    losses = loro_single.losses(0)
    print(f"\nLORO 1 process, K={K}: {[round(x, 4) for x in losses]}")
    assert len(losses) == 7 and losses[-1] < losses[0] - 0.5, losses
    # one process, float32: torchtitan's autocast to float32 (refused by CPU autocast)
    # used to warn; no Python warning is left (boost_titan.observability.log_filters)
    assert "Warning:" not in loro_single.output, loro_single.output[-3000:]


# half the single run's local batch on each of 2 data-parallel ranks: the single run's
# global batch (the training data's global order, boost_titan.data.order)
FSDP2 = ("--parallelism.data_parallel_shard_degree", "2", "--training.local_batch_size", "2")
TP2 = ("--parallelism.tensor_parallel_degree", "2")
# layout: processes, overrides, the run it must match
LAYOUTS = {
    "tp2": (2, TP2, "single"),
    "pp2": (2, ("--parallelism.pipeline_parallel_degree", "2"), "single"),
    "tp2_fsdp2": (4, (*TP2, *FSDP2), "single"),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_layout_matches_reference_run(layout, loro_seed, request, tmp_path):
    ngpu, extra, against = LAYOUTS[layout]
    reference = request.getfixturevalue(f"loro_{against}")
    # tp2 also saves at step 4 and is resumed from there, across the exact step at 6
    save = ("--checkpoint.interval", "4") if layout == "tp2" else ("--checkpoint.load_only",)
    run = run_training(
        "debug_svd_loro.toml", ngpu, tmp_path / layout, *_from(loro_seed, *extra, *save)
    )
    got, want = run.losses(0), reference.losses(0)
    print(f"\nLORO {layout} vs {against}: {[round(x, 5) for x in got]} vs {want}")
    assert len(got) == 7
    for step, (a, b) in enumerate(zip(got, want), 1):
        assert abs(a - b) <= 1e-4 * b, f"step {step}: {layout} {a} vs {against} {b}"
    if layout != "tp2":
        return
    _assert_loro_logged(run.output)
    assert_safe_metadata(run.dump_folder / "checkpoint" / "step-4")  # LORO optimizer state
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        run.dump_folder / "checkpoint" / "step-4", resumed_dir / "checkpoint" / "step-4"
    )
    # the same command again: with the run's record of the initial_load_path it started
    # from (else that path over step-4 is refused at parse time)
    shutil.copy(run.dump_folder / "checkpoint" / "initial_load.json", resumed_dir / "checkpoint")
    resumed = run_training(
        "debug_svd_loro.toml", ngpu, resumed_dir, *_from(loro_seed, *extra, *save)
    )
    assert sorted(resumed.loss[0]) == [5, 6, 7]
    for rank in (0, 1):
        for step in (5, 6, 7):
            assert resumed.loss[rank][step] == run.loss[rank][step], (rank, step)
            assert resumed.grad_norm[rank][step] == run.grad_norm[rank][step], (rank, step)


_EXACT_LINE = re.compile(
    r"\[rank(\d+)\]:.*LORO exact step at step (\d+): ([\d.]+) s \((\d+) factor pairs\)"
)


def _assert_loro_logged(output: str) -> None:
    """Rank 0 says once that LORO is active, and marks each exact step (3 and 6) with
    its cost; the TP2 run's log does not call itself one process."""
    active = re.findall(
        r"\[rank(\d+)\]:.*LORO optimizer: exact \(Riemannian\) step every (\d+)", output
    )
    assert active == [("0", str(K))], active
    exact = [(int(r), int(s), float(t), int(n)) for r, s, t, n in _EXACT_LINE.findall(output)]
    assert [(r, s) for r, s, *_ in exact] == [(0, 3), (0, 6)], exact
    # every block's 7 linears are factor pairs (4 blocks); the cost is measured, not 0
    assert all(n == 28 and t > 0 for *_, t, n in exact), exact
    assert "one process" not in output


def test_bench_counts_the_exact_step_collectives(tmp_path):
    """The cost benchmark on 2 ranks (smoke shape: 2 blocks x 7 pairs, r = 32): the
    exact step issues per pair 4 TSQR all-gathers of r x r float64 R factors (2 ranks:
    2 r^2 gathered) and 2 all-reduces of r x r, per 2 pairs one all-gather of the two
    cores' 2r x r factor pairs (each rank factored one core), and nothing else."""
    import json
    import subprocess
    import sys

    out = tmp_path / "loro.json"
    cmd = [sys.executable, "-m", "boost_titan.cli", "bench-loro", "--smoke", "--reps", "1"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    pairs, r = 14, 32
    assert res["exact_ops"] == {
        "all_gather_into_tensor": [
            4 * pairs + pairs // 2,
            (4 * pairs * 2 * r * r + pairs // 2 * 2 * 2 * (2 * r) * r) * 8,
        ],
        "all_reduce": [2 * pairs, 2 * pairs * r * r * 8],
    }
    assert "K = 500" in proc.stdout and "exact step" in proc.stdout
