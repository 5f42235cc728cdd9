"""Faults on real gloo ranks through run_train.sh (BTP TP2, 8 steps), against one
uninterrupted reference run: every recovered run ends with the reference's final
weights and optimizer state, bit for bit (fp32).

* SIGKILL of rank 1 after step 5, MAX_RESTARTS=1: torchrun restarts both ranks, they
  resume from step 4;
* SIGTERM to the launcher after step 3 (as SLURM preemption): a checkpoint of the step
  in flight, exit 0; the same command again resumes after it;
* a cut-off save (step-6 without DCP's .metadata, a truncated shard): set aside, named
  in the log, resume from step-4;
* NaN loss: the update is not applied, the run stops naming the step, the step-2
  checkpoint is untouched; under nan_policy = "skip" a skipped step leaves the weights
  exactly as they were, and too many skips in a row stop the run.

Faults come from BOOST_TITAN_INJECT (boost_titan.train.fault), so each one lands at a known
step on every run. The restart and preemption runs go through run_train.sh and
torchrun (what they test is the launcher's part); the others fork their ranks
(tests/launcher.py)."""

from __future__ import annotations

import logging
import os
import re
import shutil

import pytest
import torch
from helpers import run_main, run_training
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

from boost_titan.train.fault import parse_injections, quarantine_incomplete_checkpoints

CONFIG = "debug_cola_btp_tp2.toml"
BASE = (
    "--checkpoint.enable",
    "--training.steps",
    "8",
    "--validation.no-enable",
    "--training.mixed_precision_param",
    "float32",
)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"),
    pytest.mark.filterwarnings("ignore:torch.distributed is unavailable:UserWarning"),
]


def _injected(monkeypatch, spec: str) -> None:
    monkeypatch.setenv("BOOST_TITAN_INJECT", spec)


def _state(step_dir) -> dict[str, object]:
    """Everything in a DCP checkpoint (weights, optimizer moments and hyper-parameters,
    LR scheduler, train state, data loader position), flattened by key."""
    flat = {}

    def walk(prefix, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        else:
            flat[prefix] = obj

    walk("", _load_state_dict_from_keys(checkpoint_id=str(step_dir)))
    return flat


def _assert_same_state(a_dir, b_dir, ignore: tuple[str, ...] = ()) -> None:
    a, b = _state(a_dir), _state(b_dir)
    assert sorted(a) == sorted(b)
    compared = [k for k in a if not k.startswith(ignore)]
    for k in compared:
        same = torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k]
        assert same, (k, a[k], b[k])
    assert sum(isinstance(a[k], torch.Tensor) for k in compared) > 20
    assert any(k.startswith("optimizer.state") for k in compared)
    assert any(k.startswith("lr_scheduler") for k in compared)


# a skipped step still consumes its batch and counts as a step
SKIPPED = ("dataloader", "train_state")


@pytest.fixture(scope="module")
def reference(corpus_dir, tmp_path_factory):
    """Uninterrupted: checkpoints after steps 2, 4, 6 and 8."""
    run = run_training(
        CONFIG, 2, tmp_path_factory.mktemp("ft") / "ref", *BASE, "--checkpoint.interval", "2"
    )
    assert sorted(run.loss[0]) == list(range(1, 9))
    return run


def _ckpt(run, step):
    return run.dump_folder / "checkpoint" / f"step-{step}"


def test_sigkill_restart_resumes_bitwise(reference, tmp_path, monkeypatch):
    _injected(monkeypatch, "sigkill@5:rank=1")
    monkeypatch.setenv("MAX_RESTARTS", "1")
    run = run_training(
        CONFIG, 2, tmp_path / "killed", *BASE, "--checkpoint.interval", "2", launcher="torchrun"
    )
    # rank 1 really died of SIGKILL: the injector logs just before os.kill, and the agent
    # saw a worker die of a signal. Which failure torchrun names is a race: it takes the
    # earliest timestamp, in whole seconds, and rank 0 (SIGTERMed by the agent while it
    # handles rank 1's death) can write an error file stamped a second before the poll
    # that caught rank 1 (seen once in a clean-clone CI run: "exitcode: -15 local_rank: 0")
    assert "[inject] rank 1: SIGKILL after step 5" in run.output
    assert re.search(r"failed \(exitcode: -(9|15)\) local_rank: [01] ", run.output)
    assert re.search(r"Loading the checkpoint from \S+/step-4\.", run.output)
    assert run.output.count("Training starts at step 5") == 2  # both ranks, second attempt
    for step in range(5, 9):
        assert run.loss[0][step] == reference.loss[0][step]
    _assert_same_state(_ckpt(reference, 8), _ckpt(run, 8))


def test_sigterm_saves_current_step_exits_0_and_resumes(reference, tmp_path, monkeypatch):
    _injected(monkeypatch, "sigterm@3")
    # interval 7: the preemption checkpoint is not a regular one
    args = (*BASE, "--checkpoint.interval", "7")
    # exit 0 asserted by the helper
    first = run_training(CONFIG, 2, tmp_path / "pre", *args, launcher="torchrun")
    m = re.search(r"run_train.sh: preempted step=(\d+) checkpoint=(\S+); exiting 0", first.output)
    assert m, first.output[-3000:]
    stopped = int(m[1])
    assert 3 <= stopped < 7 and max(first.loss[0]) == stopped
    assert (tmp_path / "pre" / "checkpoint" / f"step-{stopped}" / ".metadata").is_file()
    monkeypatch.delenv("BOOST_TITAN_INJECT")
    second = run_training(CONFIG, 2, tmp_path / "pre", *args, launcher="torchrun")
    assert f"Training starts at step {stopped + 1}" in second.output
    assert sorted(second.loss[0]) == list(range(stopped + 1, 9))
    for step in range(stopped + 1, 9):
        assert second.loss[0][step] == reference.loss[0][step]
    _assert_same_state(_ckpt(reference, 8), tmp_path / "pre" / "checkpoint" / "step-8")


def test_cut_off_checkpoint_is_skipped_and_named(reference, tmp_path):
    """A save cut off (step-6: no .metadata, a shard cut short) and a complete step that
    lost a file since (step-8: rank 1's shard gone, issue #41's reproduction 3, which
    ended the resume in a FileNotFoundError): both are set aside and named, the run
    resumes from step-4 and ends as the reference did."""
    folder = tmp_path / "cut" / "checkpoint"
    for step in (4, 6, 8):
        shutil.copytree(_ckpt(reference, step), folder / f"step-{step}")
    # what a kill during the save leaves: shards (one cut short), no .metadata
    (folder / "step-6" / ".metadata").unlink()
    shard = sorted((folder / "step-6").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])
    (folder / "step-8" / "__1_0.distcp").unlink()
    run = run_training(CONFIG, 2, tmp_path / "cut", *BASE, "--checkpoint.interval", "2")
    assert re.search(
        r"checkpoint \S+/step-6 is incomplete \(no \.metadata: its save was cut off\) "
        r"and will not be loaded; moved to \S+/step_6\.incomplete",
        run.output,
    )
    assert (
        f"checkpoint {folder / 'step-8'} is incomplete: __1_0.distcp is missing; not loaded. "
        f"Moved it to {folder / 'step_8.corrupt'}; resuming from step 4 instead: 4 steps "
        "(5-8) are trained again"
    ) in run.output
    assert re.search(r"Loading the checkpoint from \S+/step-4\.", run.output)
    assert sorted(run.loss[0]) == [5, 6, 7, 8]
    assert (folder / "step_6.incomplete").is_dir() and (folder / "step-6" / ".metadata").is_file()
    assert (folder / "step_8.corrupt").is_dir()
    _assert_same_state(_ckpt(reference, 8), folder / "step-8")


def test_nan_loss_stops_naming_step_and_keeps_last_checkpoint(reference, tmp_path, monkeypatch):
    _injected(monkeypatch, "nan_loss@3")
    run = run_training(
        CONFIG, 2, tmp_path / "nan", *BASE, "--checkpoint.interval", "2", expect_failure=True
    )
    assert re.search(
        r"NonFiniteStepError: step 3: non-finite loss or gradients \(NaN/inf\); the "
        r"update was not applied and the run stops \(\[boost\] nan_policy = \"stop\"",
        run.output,
    )
    assert re.search(r"Last checkpoint: \S+/step-2 \(untouched\)", run.output)
    folder = tmp_path / "nan" / "checkpoint"
    assert sorted(os.listdir(folder)) == ["run.json", "step-2"]
    _assert_same_state(_ckpt(reference, 2), folder / "step-2")


def test_nan_skip_policy_skips_updates_then_stops_at_limit(reference, tmp_path, monkeypatch):
    # inf in one gradient on rank 1 only (the ranks must still agree), then NaN losses
    _injected(monkeypatch, "inf_grad@3:rank=1,nan_loss@5,nan_loss@6,nan_loss@7")
    run = run_training(
        CONFIG,
        2,
        tmp_path / "skip",
        *BASE,
        "--checkpoint.interval",
        "1",
        "--boost.nan_policy",
        "skip",
        "--boost.nan_max_consecutive_skips",
        "2",
        expect_failure=True,
    )
    # rank 0's log (the console's) lists every injection, those on rank 1 included
    assert re.search(
        r"\[rank0\]:.*faults will be injected: an inf gradient after step 3's backward on "
        r"rank 1; NaN loss at step 5 on every rank;",
        run.output,
    )
    assert "step 3: non-finite loss or gradients; update skipped (1 in a row, limit 2" in run.output
    assert (
        "step 6: non-finite loss or gradients; update skipped (2 in a row, limit 2; "
        "3 skipped so far: [3, 5, 6])" in run.output
    )
    assert (
        "step 7: non-finite loss or gradients (NaN/inf); the update was not applied and the run "
        "stops (3 non-finite steps in a row exceed [boost] nan_max_consecutive_skips = 2)"
    ) in run.output
    folder = tmp_path / "skip" / "checkpoint"
    steps = [n for n in os.listdir(folder) if n.startswith("step")]
    assert sorted(steps, key=lambda n: int(n.split("-")[1])) == [f"step-{i}" for i in range(1, 7)]
    # steps 1-2 as the reference; a skipped step changes nothing: not a weight, not an
    # optimizer moment, not the LR schedule
    _assert_same_state(_ckpt(reference, 2), folder / "step-2")
    _assert_same_state(folder / "step-2", folder / "step-3", ignore=SKIPPED)
    _assert_same_state(folder / "step-4", folder / "step-6", ignore=SKIPPED)
    assert run.loss[0][4] != reference.loss[0][4]  # step 4 trains on from the step-2 weights


def test_bad_injection_spec_and_quarantine_unit(tmp_path):
    with pytest.raises(ValueError, match=r"'sigkil@5' is not KIND@STEP\[:rank=R\] with KIND in"):
        parse_injections("nan_loss@2,sigkil@5")
    for name in ("step-2", "step-4", "step-6"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__0_0.distcp").write_bytes(b"x")
    (tmp_path / "step-2" / ".metadata").write_bytes(b"m")
    (tmp_path / "step-4" / "model.safetensors.index.json").write_text("{}")
    (tmp_path / "step_6.incomplete").mkdir()  # an earlier cut-off save of the same step
    moved = quarantine_incomplete_checkpoints(str(tmp_path))
    assert [os.path.basename(old) for old, _ in moved] == ["step-6"]
    assert re.fullmatch(r"step_6\.incomplete\.\d+", os.path.basename(moved[0][1]))
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("step-")) == ["step-2", "step-4"]


class _AsyncCheckpointer:
    """torchtitan's checkpointer under ``async_mode = "async"``, reduced to what the
    preemption save touches: ``save`` returns while its write is still in flight."""

    interval = 5

    def __init__(self, folder):
        self.folder = folder
        self.save_future = None
        self.saves: list[int] = []

    def _create_checkpoint_id(self, step: int) -> str:
        return str(self.folder / f"step-{step}")

    def save(self, step: int) -> None:
        import threading
        import time
        from concurrent.futures import Future

        self.saves.append(step)
        future: Future = Future()

        def write() -> None:
            time.sleep(0.3)
            os.makedirs(self._create_checkpoint_id(step), exist_ok=True)
            with open(os.path.join(self._create_checkpoint_id(step), ".metadata"), "wb"):
                pass
            future.set_result(None)

        threading.Thread(target=write).start()
        self.save_future = future

    def _async_wait(self) -> None:
        if self.save_future is not None:
            self.save_future.result()
            self.save_future = None


def test_preemption_waits_for_the_async_save_in_flight(tmp_path, monkeypatch):
    """Under async checkpointing, the preemption save is on disk before the status file
    says so (and before the process group ends); an interval save of the same step
    still in flight is waited for, not saved a second time."""
    from types import SimpleNamespace

    from boost_titan.train.trainer import BoostTrainer

    status = tmp_path / "status"
    monkeypatch.setenv("BOOST_TITAN_STATUS_FILE", str(status))
    ckpt = _AsyncCheckpointer(tmp_path)
    trainer = SimpleNamespace(checkpointer=ckpt, step=3)
    BoostTrainer._save_for_preemption(trainer)
    assert ckpt.saves == [3] and (tmp_path / "step-3" / ".metadata").is_file()
    assert status.read_text() == f"preempted step=3 checkpoint={tmp_path / 'step-3'}\n"
    assert ckpt.interval == 5 and ckpt.save_future is None
    trainer.step = 4
    ckpt.save(4)  # the interval save of step 4, in flight when SIGTERM is agreed
    BoostTrainer._save_for_preemption(trainer)
    assert ckpt.saves == [3, 4] and (tmp_path / "step-4" / ".metadata").is_file()


def test_torchrun_prints_no_report_after_a_line_the_ranks_explained(tmp_path):
    """run_train.sh's torchrun (``boost_titan.train.torchrun``): a rank that stops after
    local rank 0 wrote its one line to the status file ends the agent with the rank's
    exit status and without torchrun's report; a failure without such a line keeps the
    report (its traceback, the failure table) as torchrun prints it."""
    status = tmp_path / "status"
    for explained in (True, False):
        status.write_text("")
        said = 'echo "failed: a refusal in one line" > "$BOOST_TITAN_STATUS_FILE"; '
        proc = run_main(
            "boost_titan.train.torchrun",
            "--nproc_per_node", "1", "--no-python",
            "sh", "-c", (said if explained else "") + "exit 3",
            env={"BOOST_TITAN_STATUS_FILE": str(status)},
        )  # fmt: skip
        report = [x for x in proc.stderr.splitlines() if "ChildFailedError" in x]
        if explained:
            assert proc.returncode == 3 and not report, proc.stderr
            assert len(proc.stderr.splitlines()) <= 3, proc.stderr
        else:
            assert proc.returncode == 1 and report, proc.stderr
            assert "exitcode  : 3" in proc.stderr


@pytest.mark.parametrize("refusal", ["damaged", "data_resume"])
def test_a_refused_checkpoint_still_closes_the_trainer(monkeypatch, caplog, refusal, tmp_path):
    """trainer.main: a refusal that is no Exception (a damaged checkpoint, a data
    position refused as SystemExit) runs trainer.close() like any other failure; a
    damaged checkpoint ends on its one line, exit 1; local rank 0 writes the line to
    run_train.sh's status file (its torchrun then prints no report: below), over a
    line an earlier attempt left."""
    from types import SimpleNamespace

    from boost_titan.checkpoint.data_position import DataResumeError
    from boost_titan.checkpoint.integrity import ChecksumMismatch
    from boost_titan.train import trainer as trainer_module

    closed = []

    class Trainer:
        def __init__(self, config):
            pass

        def train(self):
            if refusal == "damaged":
                raise ChecksumMismatch("checkpoint X/step-4 is corrupted: one line")
            raise DataResumeError("checkpoint X/step-4 was saved with data-parallel degree 2")

        def close(self):
            closed.append(True)

    config = SimpleNamespace(checkpoint=SimpleNamespace(create_seed_checkpoint=False))
    for name, value in (
        ("init_logger", lambda: None),
        ("install", lambda: None),
        ("BoostTrainer", Trainer),
    ):
        monkeypatch.setattr(trainer_module, name, value)
    monkeypatch.setattr(trainer_module.log_filters, "install_for_training", lambda: None)
    monkeypatch.setattr(trainer_module.launch_check, "parse_or_exit", lambda argv: config)

    def exit_now(code: int = 0) -> None:
        raise SystemExit(code)

    monkeypatch.setattr(trainer_module.cpu_runtime, "exit_after_clean_shutdown", exit_now)
    monkeypatch.setenv("LOCAL_RANK", "0")
    status = tmp_path / "status"
    status.write_text("failed: an earlier attempt's line\n")
    monkeypatch.setenv("BOOST_TITAN_STATUS_FILE", str(status))
    with caplog.at_level(logging.ERROR), pytest.raises(SystemExit) as info:
        trainer_module.main([])
    assert closed == [True]
    line = (
        "checkpoint X/step-4 is corrupted: one line"
        if refusal == "damaged"
        else "checkpoint X/step-4 was saved with data-parallel degree 2"
    )
    assert status.read_text() == f"failed: {line}\n"
    if refusal == "damaged":
        assert info.value.code == 1
        assert [r.getMessage() for r in caplog.records] == [
            "checkpoint X/step-4 is corrupted: one line"
        ]
    else:  # its own SystemExit: the message is its one line (exit 1)
        assert isinstance(info.value, DataResumeError)
