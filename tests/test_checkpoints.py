"""Checkpoints under BTP, through the trainer on real gloo ranks: DCP resume is bit-exact, a BTP TP2
checkpoint loads into 1-process, FSDP2 and PP2 layouts with identical weights, and the
consolidated safetensors export / import round-trips.

The cross-layout runs train one step with lr = 0 (AdamW then leaves every weight
bit-for-bit unchanged: p * (1 - 0 * wd) + 0 * update) and save: the weights each layout
held after loading come back out of its own checkpoint."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from helpers import REPO_ROOT, assert_safe_metadata, run_main, run_training

from boost_titan.checkpoint import integrity, run_id

FP32 = ("--training.mixed_precision_param", "float32")
CONFIG = "debug_cola_btp_tp2.toml"


def _cli(*args: str, config: str = CONFIG, expect_error: str | None = None) -> str:
    """``boost-titan checkpoint args --job.config_file <config>``."""
    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        *args,
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / config),
    )
    if expect_error is not None:
        assert proc.returncode != 0 and expect_error in proc.stderr, proc.stderr[-3000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout + proc.stderr


def _tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def btp_run(seed_checkpoint, tmp_path_factory):
    """From the shared seed checkpoint, 6 BTP TP2 steps saving full checkpoints at
    steps 3 and 6."""
    root = tmp_path_factory.mktemp("ckpt")
    args = (
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed_checkpoint("debug_cola.toml")),
        "--checkpoint.interval",
        "3",
        "--training.steps",
        "6",
        "--validation.no-enable",
        *FP32,
    )
    run = run_training(CONFIG, 2, root / "btp", *args)
    return root, args, run


@pytest.mark.slow
def test_resume_under_btp_is_bit_exact(btp_run):
    root, args, full = btp_run
    # BTP TP2 with the optimizer (step 3) and model-only (the last save, step 6)
    for step in (3, 6):
        assert_safe_metadata(full.dump_folder / "checkpoint" / f"step-{step}")
    resumed_dir = root / "resumed"
    shutil.copytree(
        full.dump_folder / "checkpoint" / "step-3", resumed_dir / "checkpoint" / "step-3"
    )
    # the same command again: with the run's record of the initial_load_path it started
    # from (else that path over step-3 is refused at parse time)
    shutil.copy(full.dump_folder / "checkpoint" / "initial_load.json", resumed_dir / "checkpoint")
    resumed = run_training(CONFIG, 2, resumed_dir, *args)
    assert sorted(resumed.loss[0]) == [4, 5, 6]
    # steps copied into a new folder (no run.json) go on as their run (#48): same run id
    first = run_id.read(str(full.dump_folder / "checkpoint"))
    assert first is not None and run_id.read(str(resumed_dir / "checkpoint")) == first
    assert integrity.open_step(resumed_dir / "checkpoint" / "step-6").seal.run_id == first
    for rank in (0, 1):
        for step in (4, 5, 6):
            assert resumed.loss[rank][step] == full.loss[rank][step]
            assert resumed.grad_norm[rank][step] == full.grad_norm[rank][step]
    # and the weights after step 6 are the same bits
    _cli(
        "export",
        "--from",
        str(full.dump_folder / "checkpoint" / "step-6"),
        "--to",
        str(root / "full6.safetensors"),
    )
    _cli(
        "export",
        "--from",
        str(resumed_dir / "checkpoint" / "step-6"),
        "--to",
        str(root / "resumed6.safetensors"),
    )
    _assert_identical(_tensors(root / "full6.safetensors"), _tensors(root / "resumed6.safetensors"))


# layout config, processes, overrides
LAYOUTS = {
    "tp1": ("debug_cola.toml", 1, ()),
    "fsdp2": ("debug_cola_fsdp2.toml", 2, ()),
    "pp2": ("debug_lax_pp2.toml", 2, ("--model.name", "cola_llama2")),
}


@pytest.mark.slow
def test_btp_checkpoint_loads_into_other_layouts_and_safetensors_round_trip(btp_run):
    root, _, full = btp_run
    source = full.dump_folder / "checkpoint" / "step-6"
    ref_file = root / "btp6.safetensors"
    _cli("export", "--from", str(source), "--to", str(ref_file))
    ref = _tensors(ref_file)
    assert ref["layers.0.attention.wq.down.weight"].shape == (64, 256)  # A: [r, d]
    assert ref["layers.0.attention.wq.up.weight"].shape == (256, 64)  # B: [d, r]

    # import the file as a model-only DCP checkpoint: exporting it again gives the same tensors
    imported = root / "imported" / "step-0"
    _cli("import", "--from", str(ref_file), "--to", str(imported))
    _cli("export", "--from", str(imported), "--to", str(root / "again.safetensors"))
    _assert_identical(ref, _tensors(root / "again.safetensors"))
    _cli("import", "--from", str(ref_file), "--to", str(imported), expect_error="exists")
    assert_safe_metadata(imported)

    first_losses = {}
    cases = [(name, source) for name in LAYOUTS] + [("tp1-imported", imported)]
    for name, load_from in cases:
        config, ngpu, extra = LAYOUTS[name.split("-")[0]]
        run = run_training(
            config,
            ngpu,
            root / name,
            *extra,
            *FP32,
            "--checkpoint.enable",
            "--checkpoint.initial_load_path",
            str(load_from),
            "--checkpoint.last_save_model_only",
            "--checkpoint.interval",
            "1000",
            "--optimizer.lr",
            "0",
            "--training.steps",
            "1",
            "--validation.no-enable",
        )
        assert_safe_metadata(run.dump_folder / "checkpoint" / "step-1")  # model-only
        saved = root / f"{name}.safetensors"
        _cli("export", "--from", str(run.dump_folder / "checkpoint" / "step-1"), "--to", str(saved))
        _assert_identical(ref, _tensors(saved))
        if name != "fsdp2":  # its 2 data-parallel ranks read other batches
            first_losses[name] = max(v[1] for v in run.loss.values())  # PP: the last stage's
    # the layouts score the loaded weights on the same batch alike
    values = list(first_losses.values())
    assert max(values) - min(values) <= 2e-4 * min(values), first_losses


@pytest.mark.slow
def test_export_rejects_a_config_that_does_not_fit(btp_run):
    root, _, full = btp_run
    source = str(full.dump_folder / "checkpoint" / "step-6")
    _cli(
        "export",
        "--from",
        source,
        "--to",
        str(root / "bad.safetensors"),
        "--boost.rank",
        "32",
        expect_error="shape mismatches, e.g. ['layers.0.attention.wk.down.weight: "
        "(64, 256) (model: (32, 256))'",
    )
    _cli(
        "export",
        "--from",
        source,
        "--to",
        str(root / "bad.safetensors"),
        "--model.name",
        "llama2",
        expect_error="missing 28 tensors, e.g. ['layers.0.attention.wk.weight'",
    )
    _cli(
        "export",
        "--from",
        str(root / "nowhere"),
        "--to",
        str(root / "bad.safetensors"),
        expect_error="is not a DCP checkpoint (no .metadata file)",
    )
    assert not list(root.glob("*bad.safetensors*"))  # nothing half-written


def _empty_folders(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.is_dir() and not any(p.iterdir())
    )


@pytest.mark.slow
def test_runs_leave_no_empty_folders(btp_run, seed_checkpoint):
    """torchtitan creates the flight recorder's ``comm_traces/`` in every dump folder;
    a run that dumped nothing there removes it (``boost_titan.observability.comm_traces``):
    a training
    run (TP2, checkpoints) and a seed-checkpoint run."""
    _, _, run = btp_run
    seed_dump = seed_checkpoint("debug_cola.toml").parent.parent
    for dump in (run.dump_folder, seed_dump):
        assert (dump / "checkpoint").is_dir()  # the run wrote its dump folder
        assert not (dump / "comm_traces").exists(), dump
        assert _empty_folders(dump) == [], dump


@pytest.mark.slow
def test_export_and_import_write_as_a_plain_write_does(seed_checkpoint, tmp_path):
    """Exported files and imported checkpoints get the permissions of any file the user
    writes (0666 / 0777 less the umask: 0644 / 0755 under umask 022), not those of the
    temporary path they are renamed from (``tempfile``'s 0600 / 0700)."""
    umask = os.umask(0)
    os.umask(umask)  # the CLI's, too: it forks from a server this process started
    config = "debug_cola.toml"
    exported = tmp_path / "exported" / "seed.safetensors"
    _cli("export", "--from", str(seed_checkpoint(config)), "--to", str(exported), config=config)
    imported = tmp_path / "imported" / "step-0"
    _cli("import", "--from", str(exported), "--to", str(imported), config=config)
    assert oct(exported.stat().st_mode & 0o777) == oct(0o666 & ~umask)
    assert oct(imported.stat().st_mode & 0o777) == oct(0o777 & ~umask)
    inside = list(imported.rglob("*"))
    assert inside  # the DCP files
    for p in inside:
        want = 0o777 if p.is_dir() else 0o666
        assert oct(p.stat().st_mode & 0o777) == oct(want & ~umask), p
    assert sorted(p.name for p in exported.parent.iterdir()) == ["seed.safetensors"]  # no tmp left
