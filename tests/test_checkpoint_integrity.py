"""Checksummed checkpoints (boost_titan.checkpoint.integrity): every DCP save records a checksum of
every byte it writes, every load verifies what it reads, and a mismatch is one line.

Unit cases save and load small state dicts in this process (DCP without a process
group); the end-to-end case is the issue's reproduction on real gloo ranks (BTP TP2):
16 fp32 weights of ``layers.1.attention.wq.down.weight`` in the newest checkpoint get
one bit flipped (0x08 of the top byte: each is scaled by 2^16 or 2^-16, what bit rot
or a bad copy does), located through ``.metadata``'s storage offsets."""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash
from helpers import REPO_ROOT, run_main, run_training
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

from boost_titan.checkpoint import integrity, safe_metadata

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")

WQ = "layers.1.attention.wq.down.weight"
BIG = "tok_embeddings.weight"  # 600 x 1024 fp32: 2.4 MiB, three 1 MiB blocks


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        WQ: torch.randn(64, 256, generator=g),
        BIG: torch.randn(600, 1024, generator=g),
        "steps": torch.arange(5),
        "train_state": {"step": 4, "tokens": 1024},  # DCP pickles these (bytes items)
    }


def _empty() -> dict:
    return {
        WQ: torch.zeros(64, 256),
        BIG: torch.zeros(600, 1024),
        "steps": torch.zeros(5, dtype=torch.long),
        "train_state": {"step": 0, "tokens": 0},
    }


def _save(path: Path, **writer) -> Path:
    dcp.save(_state(), storage_writer=FileSystemWriter(path, **writer), no_dist=True)
    return path


def _stored(step_dir: Path, fqn: str, file: str | None = None):
    """(file path, offset, length) of the item ``fqn`` (its chunk in ``file``, if
    given) as ``.metadata``'s storage_data records it."""
    meta = safe_metadata.loads((step_dir / ".metadata").read_bytes(), str(step_dir))
    for index, info in sorted(meta.storage_data.items(), key=lambda kv: kv[1].relative_path):
        if index.fqn == fqn and file in (None, info.relative_path):
            return step_dir / info.relative_path, info.offset, info.length
    raise KeyError(fqn)


def _payload_length(path: Path, offset: int, length: int) -> int:
    """The item's own bytes: its stored bytes end with the trailer, whose footer is
    (u64 payload length, u32 block size, 8-byte magic)."""
    with open(path, "rb") as f:
        f.seek(offset + length - 20)
        footer = f.read(20)
    assert footer.endswith(b"BTxxh3\x00\x01"), footer
    return struct.unpack_from("<QI", footer)[0]


def flip_bits(step_dir: Path, fqn: str, file: str | None = None, at: float = 0.5) -> int:
    """Flip bit 0x08 of the top byte of 16 consecutive fp32 words at fraction ``at`` of
    the stored item ``fqn`` (a torch.save archive whose tensor data is 64-byte aligned
    and makes up nearly all of it), located via .metadata's offsets. Returns the
    position in the file of the first flipped word."""
    path, offset, length = _stored(step_dir, fqn, file)
    pos = offset + int(length * at) // 64 * 64
    data = bytearray(path.read_bytes())
    for i in range(16):
        data[pos + 4 * i + 3] ^= 0x08
    path.write_bytes(bytes(data))
    return pos


def test_round_trip_records_a_checksum_of_every_byte(tmp_path):
    step = _save(tmp_path / "step-1")
    back = _empty()
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    for k, v in _state().items():
        assert torch.equal(back[k], v) if isinstance(v, torch.Tensor) else back[k] == v, k
    # the sidecar holds the digest of .metadata's bytes
    data = (step / ".metadata").read_bytes()
    assert json.loads((step / ".metadata.xxh3").read_text()) == {
        "algorithm": "xxh3_64",
        "digest": xxhash.xxh3_64_hexdigest(data),
        "bytes": len(data),
    }
    meta = pickle.loads(data)
    assert all(
        i.transform_descriptors == ["boost_titan.xxh3/1"] for i in meta.storage_data.values()
    )
    # each item: its bytes, one xxh3_64 per MiB of them, then the footer
    path, offset, length = _stored(step, BIG)
    n = _payload_length(path, offset, length)
    raw = path.read_bytes()[offset : offset + length]
    blocks = [raw[i : min(i + 2**20, n)] for i in range(0, n, 2**20)]
    assert len(blocks) == 3 and length == n + 8 * 3 + 20
    assert raw[n : n + 24] == b"".join(xxhash.xxh3_64_digest(b) for b in blocks)
    assert torch.equal(torch.load(__import__("io").BytesIO(raw[:n])), _state()[BIG])
    result = integrity.check(step)
    assert result.ok and result.checksummed and result.items == len(meta.storage_data)


def test_flipped_bits_fail_the_load_on_one_line(tmp_path, monkeypatch):
    step = _save(tmp_path / "step-4")
    path, offset, length = _stored(step, WQ)
    n = _payload_length(path, offset, length)  # 64 KiB of weights: one block
    clean = path.read_bytes()[offset : offset + n]
    flip_bits(step, WQ)
    corrupted = path.read_bytes()[offset : offset + n]
    back = _empty()
    with pytest.raises(BaseException) as info:
        dcp.load(back, checkpoint_id=str(step), no_dist=True)
    assert type(info.value).__name__ == "CheckpointException"  # DCP's per-rank report
    line = str(integrity.mismatch_in(info.value))
    assert line == (
        f"checkpoint {step} is corrupted: __0_0.distcp, item {WQ}: xxh3_64 of its bytes "
        f"0..{n} is {xxhash.xxh3_64_hexdigest(corrupted)} where its save recorded "
        f"{xxhash.xxh3_64_hexdigest(clean)} (the item starts at byte {offset} of the file); "
        "not loaded"
    )
    assert not back[WQ].any()  # the damaged weights never reached the state
    # and the same flip loads silently without the check: 16 weights scaled by 2^+-16
    monkeypatch.setattr(integrity._VerifyingReader, "_check", lambda self, k, data: None)
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    ref = _state()[WQ]
    changed = (back[WQ] != ref).nonzero()
    assert len(changed) == 16
    ratios = {float(back[WQ][tuple(i)] / ref[tuple(i)]) for i in changed}
    assert ratios <= {2.0**16, 2.0**-16}, ratios


def test_a_flip_in_a_middle_block_names_its_bytes(tmp_path):
    step = _save(tmp_path / "step-4")
    path, offset, length = _stored(step, BIG)
    pos = flip_bits(step, BIG)
    assert 2**20 <= pos - offset < 2 * 2**20  # in the second MiB
    with pytest.raises(BaseException) as info:
        dcp.load(_empty(), checkpoint_id=str(step), no_dist=True)
    line = str(integrity.mismatch_in(info.value))
    assert re.fullmatch(
        rf"checkpoint {re.escape(str(step))} is corrupted: __0_0\.distcp, item {BIG}: "
        rf"xxh3_64 of its bytes 1048576\.\.2097152 is [0-9a-f]{{16}} where its save "
        rf"recorded [0-9a-f]{{16}} \(the item starts at byte {offset} of the file\); not loaded",
        line,
    ), line


def test_a_flipped_metadata_byte_is_refused_before_unpickling(tmp_path, monkeypatch):
    step = _save(tmp_path / "step-4")
    data = bytearray((step / ".metadata").read_bytes())
    data[len(data) // 2] ^= 0x08
    (step / ".metadata").write_bytes(bytes(data))

    def unpickled(*args, **kwargs):
        raise AssertionError(".metadata was unpickled")

    monkeypatch.setattr(safe_metadata, "loads", unpickled)
    expected = (
        f"checkpoint {step} is corrupted: .metadata: xxh3_64 "
        f"{xxhash.xxh3_64_hexdigest(bytes(data))} ({len(data)} bytes) where .metadata.xxh3 "
        f"records {json.loads((step / '.metadata.xxh3').read_text())['digest']} "
        f"({len(data)} bytes); not unpickled, not loaded"
    )
    with pytest.raises(integrity.ChecksumMismatch) as info:
        FileSystemReader(str(step)).read_metadata()
    assert str(info.value) == expected
    with pytest.raises(BaseException) as info:
        dcp.load(_empty(), checkpoint_id=str(step), no_dist=True)
    assert str(integrity.mismatch_in(info.value)) == expected


def test_a_checkpoint_without_checksums_loads_with_one_warning(tmp_path, caplog):
    old = _save(tmp_path / "old" / "step-2", _extensions=())  # as saved before integrity
    assert not (old / ".metadata.xxh3").exists()
    with caplog.at_level(logging.WARNING):
        for _ in range(2):
            back = _empty()
            dcp.load(back, checkpoint_id=str(old), no_dist=True)
        FileSystemReader(str(old)).read_metadata()
    assert torch.equal(back[BIG], _state()[BIG]) and back["train_state"]["step"] == 4
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warned == [
        f"checkpoint {old} has no checksums (written before boost_titan checksummed "
        "checkpoints, or by another writer): its bytes cannot be verified; loaded unverified"
    ]
    assert integrity.check(old).checksummed is False and integrity.verify(old) == []
    # half and half is refused: a sidecar over items without checksums ...
    data = (old / ".metadata").read_bytes()
    (old / ".metadata.xxh3").write_text(
        json.dumps(
            {"algorithm": "xxh3_64", "digest": xxhash.xxh3_64_hexdigest(data), "bytes": len(data)}
        )
    )
    with pytest.raises(integrity.ChecksumMismatch, match=r"items carry none \(e\.g\. item "):
        FileSystemReader(str(old)).read_metadata()
    # ... and checksummed items without the sidecar
    new = _save(tmp_path / "new" / "step-2")
    (new / ".metadata.xxh3").unlink()
    with pytest.raises(integrity.ChecksumMismatch, match=r"\.metadata\.xxh3 .* is missing"):
        FileSystemReader(str(new)).read_metadata()
    assert integrity.verify(new) == [
        f"checkpoint {new} is corrupted: its items carry checksums but .metadata.xxh3 (the "
        "checksum of .metadata) is missing"
    ]


def test_verify_command(tmp_path, capsys):
    from boost_titan.cli import checkpoint

    def verify(*paths) -> tuple[int, str, str]:
        with pytest.raises(SystemExit) as info:
            checkpoint.main(["verify", *map(str, paths)])
        out = capsys.readouterr()
        return info.value.code, out.out, out.err

    root = tmp_path / "checkpoint"
    good = _save(root / "step-2")
    bad = _save(root / "step-4")
    flip_bits(bad, WQ)
    flip_bits(bad, BIG, at=0.9)
    old = _save(root / "step-6", _extensions=())
    shutil.copytree(bad, root / "step_8.corrupt")  # not a step folder: not verified
    code, out, err = verify(root)
    assert code == 1
    assert out.splitlines() == [
        f"ok: {good} (5 items, 2.4 MiB, xxh3_64)",
        f"unverified: checkpoint {old} has no checksums (written before boost_titan "
        "checksummed checkpoints, or by another writer): its bytes cannot be verified",
    ]
    lines = err.splitlines()
    assert len(lines) == 2, err  # one per bad item
    # in file order; the line of a load without "; not loaded"
    assert lines[0].startswith(f"checkpoint {bad} is corrupted: __0_0.distcp, item {WQ}: xxh3_64 ")
    assert lines[1].startswith(f"checkpoint {bad} is corrupted: __0_0.distcp, item {BIG}: xxh3_64 ")
    assert all(line.endswith("of the file)") for line in lines), lines
    assert verify(good)[0] == 0 and verify(old)[0] == 0
    code, _, err = verify(bad, good)
    assert code == 1 and len(err.splitlines()) == 2
    code, _, err = verify(tmp_path / "nowhere")
    assert (code, err) == (
        1,
        f"{tmp_path / 'nowhere'} is not a DCP checkpoint: it does not exist\n",
    )
    # the cut tail of a file
    path, offset, length = _stored(good, BIG)
    os.truncate(path, offset + length - 100)
    code, _, err = verify(good)
    assert code == 1 and "the file is shorter than its .metadata says" in err, err


def test_the_nan_stop_names_the_newest_checkpoint_that_verifies(tmp_path):
    """StepGuard's stop (boost_titan.train.fault) with step-6 cut off, step-4 corrupted: the
    message sends a restart to step-2, and says why not step-4."""
    from types import SimpleNamespace

    from boost_titan.train.fault import NonFiniteStepError, StepGuard

    folder = tmp_path / "checkpoint"
    _save(folder / "step-2")
    flip_bits(_save(folder / "step-4"), WQ)
    (_save(folder / "step-6") / ".metadata").unlink()
    weight = torch.nn.Parameter(torch.ones(2))
    trainer = SimpleNamespace(
        optimizers=SimpleNamespace(step=lambda: None, zero_grad=lambda: None),
        lr_schedulers=SimpleNamespace(step=lambda: None),
        model_parts=[SimpleNamespace(parameters=lambda: [weight])],
        device="cpu",
        step=7,
        checkpointer=SimpleNamespace(enable=True, folder=str(folder)),
    )
    guard = StepGuard(trainer, "stop", 0, None)
    guard.record_loss(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteStepError) as info:
        trainer.optimizers.step()
    bad = integrity.verify(folder / "step-4")
    assert len(bad) == 1
    assert (
        f"Last checkpoint: {folder / 'step-2'} (untouched; newer, failed verification: "
        f"{bad[0]}). A NaN"
    ) in str(info.value)


def test_a_writer_pickled_into_a_fresh_process_writes_checksums(tmp_path):
    """DCP's process-based async save (torchtitan's async_with_pinned_mem) pickles the
    writer into a spawned process that never called install(): it writes the item
    checksums and the .metadata sidecar there too."""
    import subprocess
    import sys

    step = tmp_path / "step-2"
    (tmp_path / "writer.pkl").write_bytes(pickle.dumps(FileSystemWriter(step)))
    script = (
        "import pickle, sys, warnings, torch\n"
        "import torch.distributed.checkpoint as dcp\n"
        "from torch.distributed.checkpoint import filesystem\n"
        "warnings.simplefilter('ignore')\n"
        "before = filesystem._FileSystemWriter.finish.__module__\n"
        "writer = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "dcp.save({'w': torch.arange(6.0)}, storage_writer=writer, no_dist=True)\n"
        "print(before, filesystem._FileSystemWriter.finish.__module__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "writer.pkl")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == [
        "torch.distributed.checkpoint.filesystem",
        "boost_titan.checkpoint.integrity.dcp_hooks",
    ]
    result = integrity.check(step)
    assert result.ok and result.checksummed and (step / ".metadata.xxh3").is_file()
    back = {"w": torch.zeros(6)}
    dcp.load(back, checkpoint_id=str(step), no_dist=True)
    assert torch.equal(back["w"], torch.arange(6.0))


# ---------------------------------------------------------------- end to end (gloo ranks)

CONFIG = "debug_cola_btp_tp2.toml"


def _train_args(seed: Path, steps: int) -> tuple[str, ...]:
    return (
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed),
        "--checkpoint.interval",
        "2",
        "--training.steps",
        str(steps),
        "--validation.no-enable",
        "--training.mixed_precision_param",
        "float32",
    )


def _expected_line(clean: Path, corrupted: Path, fqn: str, file: str, pos: int) -> str:
    """The mismatch line for the flip at byte ``pos`` of ``file``, from the two copies'
    bytes: the digest of the flipped MiB block of the item in each."""
    meta = safe_metadata.loads((corrupted / ".metadata").read_bytes(), str(corrupted))
    index, info = next(
        (i, s) for i, s in meta.storage_data.items() if i.fqn == fqn and s.relative_path == file
    )
    n = _payload_length(corrupted / file, info.offset, info.length)
    start = (pos - info.offset) // 2**20 * 2**20
    end = min(start + 2**20, n)
    digest = [
        xxhash.xxh3_64_hexdigest((d / file).read_bytes()[info.offset + start : info.offset + end])
        for d in (corrupted, clean)
    ]
    chunk = f" (chunk at {tuple(index.offset)})" if any(index.offset) else ""
    return (
        f"checkpoint {corrupted} is corrupted: {file}, item {fqn}{chunk}: xxh3_64 of its bytes "
        f"{start}..{end} is {digest[0]} where its save recorded {digest[1]} (the item starts "
        f"at byte {info.offset} of the file); not loaded"
    )


@pytest.fixture(scope="module")
def uninterrupted(seed_checkpoint, tmp_path_factory):
    """6 BTP TP2 steps from the shared seed checkpoint, saving at steps 2, 4 and 6
    (model only, the last); a copy of its step-4 with 16 weights of
    layers.1.attention.wq.down.weight (rank 0's file) flipped."""
    root = tmp_path_factory.mktemp("integrity")
    run = run_training(CONFIG, 2, root / "ref", *_train_args(seed_checkpoint("debug_cola.toml"), 6))
    assert sorted(run.loss[0]) == list(range(1, 7))
    clean = run.dump_folder / "checkpoint" / "step-4"
    corrupted = root / "corrupted" / "step-4"
    shutil.copytree(clean, corrupted)
    pos = flip_bits(corrupted, WQ, "__0_0.distcp")
    return run, corrupted, _expected_line(clean, corrupted, WQ, "__0_0.distcp", pos)


@pytest.mark.slow
def test_resume_sets_a_corrupted_newest_step_aside(uninterrupted, seed_checkpoint, tmp_path):
    """The issue's reproduction: the newest checkpoint (step 4) has 16 flipped weights;
    the resume to step 6 sets it aside, loads step 2 and trains steps 3-6 exactly as
    the uninterrupted run did (DCP resume is bit-exact, test_checkpoints.py)."""
    ref, corrupted, line = uninterrupted
    folder = tmp_path / "resumed" / "checkpoint"
    shutil.copytree(ref.dump_folder / "checkpoint" / "step-2", folder / "step-2")
    shutil.copytree(corrupted, folder / "step-4")
    # the same command again: with the run's record of the initial_load_path it started
    # from (else that path over these steps is refused at parse time)
    shutil.copy(ref.dump_folder / "checkpoint" / "initial_load.json", folder)
    line = line.replace(str(corrupted), str(folder / "step-4"))
    run = run_training(
        CONFIG, 2, tmp_path / "resumed", *_train_args(seed_checkpoint("debug_cola.toml"), 6)
    )
    assert (
        f"{line}. Moved it to {folder / 'step_4.corrupt'}; resuming from step 2 instead: "
        "2 steps (3-4) are trained again"
    ) in run.output
    assert re.search(
        rf"Loading the checkpoint from {re.escape(str(folder / 'step-2'))}\.", run.output
    )
    for rank in (0, 1):
        assert sorted(run.loss[rank]) == [3, 4, 5, 6]
        for step in (3, 4, 5, 6):
            assert run.loss[rank][step] == ref.loss[rank][step], (rank, step)
            assert run.grad_norm[rank][step] == ref.grad_norm[rank][step], (rank, step)
    # the damaged copy is kept for inspection; the new saves verify
    assert [p.name for p in integrity.step_folders(folder)] == ["step-6", "step-4", "step-2"]
    assert len(integrity.verify(folder / "step_4.corrupt")) == 1
    assert all(integrity.check(p).ok for p in integrity.step_folders(folder))


@pytest.mark.slow
def test_a_named_corrupted_checkpoint_fails_on_its_line(uninterrupted, tmp_path):
    """``initial_load_path`` and ``export`` at the corrupted step fail on the mismatch's
    line; the one-process load reads the TP2 checkpoint's chunks (resharding)."""
    _, corrupted, line = uninterrupted
    run = run_training(
        "debug_cola.toml",
        1,
        tmp_path / "named",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(corrupted),
        "--training.steps",
        "1",
        expect_failure=True,
    )
    assert f"boost_titan.checkpoint.integrity.ChecksumMismatch: {line}" in run.output, run.output[
        -3000:
    ]
    assert "Training starts" not in run.output
    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        "export",
        "--from",
        str(corrupted),
        "--to",
        str(tmp_path / "x.safetensors"),
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / CONFIG),
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().endswith(f"boost-titan checkpoint export: error: {line}")
    assert not list(tmp_path.glob("*x.safetensors*"))
