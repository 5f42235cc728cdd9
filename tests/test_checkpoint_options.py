"""Loading a checkpoint is never silently ignored or silently something else (issues 28,
31): what a launch would load is checked when its config is parsed, the log names what
was loaded, and a run ends with exactly keep_latest_k step folders.

The parse-time cases run in this process against small DCP folders written here (a
full save holds optimizer, lr_scheduler, dataloader and train_state beside the model;
a model-only save, the model alone), with ``WORLD_SIZE`` set as torchrun sets it (the
checks that read the file system are launch checks). The options that need no file
are in ``test_configs.py``'s bad-config cases. One test trains: 8 steps at interval 2
with keep_latest_k 2, then the README's fine-tuning example (export, import,
``--checkpoint.initial_load_path``) from its last step."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from helpers import REPO_ROOT, run_main, run_training

CONFIG = "debug_cola.toml"


def _save(path, full: bool) -> str:
    import warnings

    import torch.distributed.checkpoint as dcp

    state = {"tok_embeddings.weight": torch.ones(4, 2)}
    if full:
        state |= {
            "optimizer": {"state": {"tok_embeddings.weight": {"step": torch.tensor(2.0)}}},
            "lr_scheduler": {"lr_scheduler_0": {"last_epoch": 2}},
            "dataloader": {"dp_rank_0": b"\x80"},
            "train_state": {"step": 2, "ntokens_seen": 8},
        }
    with warnings.catch_warnings():  # one process, no process group: the point here
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    return str(path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """run/: a run's checkpoints (full step-2 and step-4, the final model-only step-6);
    imported/step-0: what ``boost_titan.cli.checkpoint import`` writes (model only);
    finetune/: a run that started from imported/step-0 (its record) and saved step-2;
    cut/step-3: a save cut off before its .metadata; a plain file."""
    t = tmp_path_factory.mktemp("ckpt_options")
    for step, full in ((2, True), (4, True), (6, False)):
        _save(t / "run" / "checkpoint" / f"step-{step}", full)
    _save(t / "imported" / "step-0", full=False)
    _save(t / "finetune" / "checkpoint" / "step-2", full=True)
    from boost_titan.checkpoint import folder as checkpoint_folder

    checkpoint_folder.write_record(str(t / "finetune" / "checkpoint"), str(t / "imported/step-0"))
    (t / "cut" / "step-3").mkdir(parents=True)
    (t / "cut" / "step-3" / "__0_0.distcp").write_bytes(b"\0" * 8)
    (t / "model.safetensors").write_bytes(b"\0" * 8)
    return t


def _bad(t):
    """(args, the whole error line) of every refused case."""
    run, new, imported = t / "run", t / "new", str(t / "imported" / "step-0")
    ck = str(run / "checkpoint")
    step6 = str(run / "checkpoint" / "step-6")
    cut = str(t / "cut" / "step-3")
    return [
        # an existing step wins over initial_load_path (torchtitan: nothing was loaded
        # from it, nothing trained at the last step)
        (
            [run, "--checkpoint.initial_load_path", imported],
            f"ValueError: [checkpoint] initial_load_path = {imported!r} would not be loaded: "
            f"the dump folder's checkpoint folder {ck!r} already holds step-6, which a run "
            f"resumes first; use a new --job.dump_folder to start from {imported!r}, or drop "
            "--checkpoint.initial_load_path to resume step-6",
        ),
        (
            [t / "finetune", "--checkpoint.initial_load_path", str(run / "checkpoint/step-4")],
            f"ValueError: [checkpoint] initial_load_path = {str(run / 'checkpoint/step-4')!r} "
            f"would not be loaded: the dump folder's checkpoint folder "
            f"{str(t / 'finetune' / 'checkpoint')!r} already holds step-2 of a run that "
            f"started from {imported!r}, which a run resumes first; use a new "
            f"--job.dump_folder to start from {str(run / 'checkpoint/step-4')!r}, or drop "
            "--checkpoint.initial_load_path to resume step-2",
        ),
        (
            [new, "--checkpoint.initial_load_path", str(t / "nope")],
            f"FileNotFoundError: [checkpoint] initial_load_path = {str(t / 'nope')!r} does not "
            f"exist (cwd {str(REPO_ROOT)!r}); it must be a checkpoint's step folder, e.g. "
            "<dump_folder>/checkpoint/step-N",
        ),
        (
            [new, "--checkpoint.initial_load_path", ck],
            f"FileNotFoundError: [checkpoint] initial_load_path = {ck!r} is a checkpoint "
            f"folder, not a step folder: point it at one of its steps [2, 4, 6], e.g. the "
            f"newest, {step6!r}",
        ),
        (
            [new, "--checkpoint.initial_load_path", str(run)],
            f"FileNotFoundError: [checkpoint] initial_load_path = {str(run)!r} is a dump "
            f"folder, not a step folder: point it at one of its steps [2, 4, 6], e.g. the "
            f"newest, {step6!r}",
        ),
        (
            [new, "--checkpoint.initial_load_path", cut],
            f"FileNotFoundError: [checkpoint] initial_load_path = {cut!r} holds no .metadata, "
            "so it is not a complete DCP step folder (a finished save holds .metadata beside "
            "its *.distcp files; a save cut off does not)",
        ),
        (
            [new, "--checkpoint.initial_load_path", str(t / "model.safetensors")],
            f"FileNotFoundError: [checkpoint] initial_load_path = "
            f"{str(t / 'model.safetensors')!r} is a file, not a DCP step folder (a folder "
            "holding .metadata, e.g. <dump_folder>/checkpoint/step-N); turn a safetensors "
            "file into one with `boost-titan checkpoint import --from FILE --to "
            "DIR/step-0`",
        ),
        (
            [
                new,
                "--checkpoint.initial_load_path",
                imported,
                "--checkpoint.no-initial-load-model-only",
            ],
            f"ValueError: [checkpoint] initial_load_model_only = False but initial_load_path "
            f"{imported!r} holds only the model (optimizer, lr_scheduler, dataloader, "
            "train_state missing): leave initial_load_model_only on (the default) to start "
            "from its weights",
        ),
        # resuming the final model-only save (last_save_model_only): torchtitan failed in
        # DCP with "Missing key in checkpoint state_dict: dataloader.dp_rank_0."
        (
            [run],
            f"ValueError: [checkpoint] load_step = -1 resumes the newest step, {step6!r}, which "
            "holds only the model (a run's final save under [checkpoint] last_save_model_only "
            "= true) and cannot restore optimizer, lr_scheduler, dataloader, train_state: "
            "resume the newest full save with --checkpoint.load_step 4, or start a new run "
            f"from its weights with --checkpoint.initial_load_path {step6} and a new "
            "--job.dump_folder",
        ),
        (
            [run, "--checkpoint.load_step", "5"],
            f"FileNotFoundError: [checkpoint] load_step = 5 names no complete checkpoint: "
            f"{ck!r} holds steps [2, 4, 6]; -1 resumes the newest",
        ),
        # (torchtitan: no checkpoint folder, so fresh weights without a word)
        (
            [new, "--checkpoint.load_step", "5"],
            f"FileNotFoundError: [checkpoint] load_step = 5 names no complete checkpoint: "
            f"{str(new / 'checkpoint')!r} holds no complete checkpoint",
        ),
    ]


def _good(t):
    imported = str(t / "imported" / "step-0")
    return [
        [t / "new", "--checkpoint.initial_load_path", imported],  # the README's fine-tuning
        [t / "finetune", "--checkpoint.initial_load_path", imported],  # the same, run again
        [t / "run", "--checkpoint.load_step", "4"],
        [t / "new", "--checkpoint.keep_latest_k", "0"],
        [t / "new", "--checkpoint.keep_latest_k", "2", "--checkpoint.interval", "1"],
        [t / "run", "--checkpoint.create_seed_checkpoint"],  # loads nothing
    ]


def _parse(dump, *args, **check):
    from boost_titan.train.config_check import check_config, parse_config

    argv = ["--job.config_file", str(REPO_ROOT / "train_configs" / CONFIG)]
    argv += ["--job.dump_folder", str(dump), "--checkpoint.enable", *map(str, args)]
    if check:
        check_config(parse_config(argv, layout=False), **check)  # tools' own checks
        return None
    try:
        parse_config(argv)
    except (ValueError, FileNotFoundError) as e:
        return f"{type(e).__name__}: {e}"
    return None


@pytest.fixture(scope="module")
def outcomes(folders, corpus_dir):
    """The error (or None) of every bad, then every good case, parsed as a launch."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WORLD_SIZE", "1")
        mp.chdir(REPO_ROOT)
        return [_parse(*case) for case in [args for args, _ in _bad(folders)] + _good(folders)]


@pytest.mark.parametrize("case", range(11))
def test_checkpoint_to_load_is_checked_at_parse_time(folders, outcomes, case):
    args, line = _bad(folders)[case]
    assert len(_bad(folders)) == 11
    assert outcomes[case] == line


@pytest.mark.parametrize("case", range(6))
def test_loadable_checkpoints_are_accepted(folders, outcomes, case):
    assert len(_good(folders)) == 6
    assert outcomes[11 + case] is None, outcomes[11 + case]


def test_tools_that_only_parse_a_config_skip_the_file_checks(folders, corpus_dir, monkeypatch):
    """The checkpoint CLI (layout=False) and the dry run (files=False) parse configs
    whose dump folder they never load from: a launch would be refused here."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.chdir(REPO_ROOT)
    assert _parse(folders / "run") is not None  # the launch: model-only newest step
    _parse(folders / "run", world_size=1, files=False)
    _parse(folders / "run", world_size=1, layout=False)


# ------------------------------------------------------------------ one real run
_LOADED = re.compile(r"\[rank0\]:.*?(Loaded checkpoint .*|No checkpoint loaded .*)")


def test_keep_latest_k_and_the_readme_fine_tuning_example(corpus_dir, tmp_path):
    """8 steps at interval 2 with keep_latest_k 2 end with exactly step-6 and step-8
    (torchtitan left step-4 too: its final save does not purge), and log that they
    start from fresh weights. Then the README's fine-tuning example from step-8:
    export, import, and a run with --checkpoint.initial_load_path in a dump folder
    whose checkpoint folder exists without a complete step (a first save cut off):
    torchtitan ignored initial_load_path there and trained from fresh weights, which
    give exactly the first run's step-1 loss on the same first batch."""
    quiet = ("--validation.no-enable", "--metrics.no-enable-tensorboard")
    quiet += ("--boost.profile_freq", "0")
    first = run_training(
        CONFIG,
        1,
        tmp_path / "first",
        *quiet,
        "--training.steps",
        "8",
        "--checkpoint.enable",
        "--checkpoint.interval",
        "2",
        "--checkpoint.keep_latest_k",
        "2",
    )
    ckpt = tmp_path / "first" / "checkpoint"
    assert sorted(os.listdir(ckpt)) == ["run.json", "step-6", "step-8"]
    assert _LOADED.findall(first.output) == [
        f"No checkpoint loaded (checkpoint folder {ckpt} holds no complete step-N folder and "
        "[checkpoint] initial_load_path is not set): training starts from fresh weights"
    ]

    config = ("--job.config_file", str(REPO_ROOT / "train_configs" / CONFIG))
    exported, imported = tmp_path / "first.safetensors", tmp_path / "imported" / "step-0"
    for argv in (
        ("export", "--from", str(ckpt / "step-8"), "--to", str(exported)),
        ("import", "--from", str(exported), "--to", str(imported)),
    ):
        proc = run_main("boost_titan.cli.main", "checkpoint", *argv, *config)
        assert proc.returncode == 0, proc.stderr[-3000:]

    cut = tmp_path / "tuned" / "checkpoint" / "step-2"
    cut.mkdir(parents=True)  # a save cut off before its .metadata: set aside at start
    tuned = run_training(
        CONFIG,
        1,
        tmp_path / "tuned",
        *quiet,
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(imported),
    )
    assert _LOADED.findall(tuned.output) == [
        f"Loaded checkpoint {imported} ([checkpoint] initial_load_path): model weights only "
        "(optimizer, LR schedule, data position and step start fresh)"
    ]
    fresh, loaded = first.loss[0][1], tuned.loss[0][1]
    assert abs(fresh - 9.0) < 1.0 and loaded < fresh - 1.0, (fresh, loaded)
    # a rerun of the same command resumes this run's own step-1 (parse-time check)
    record = json.loads((tmp_path / "tuned" / "checkpoint" / "initial_load.json").read_text())
    assert record["initial_load_path"] == str(imported)
    assert sorted(os.listdir(tmp_path / "tuned" / "checkpoint")) == [
        "initial_load.json",
        "run.json",
        "step-1",
        "step_2.incomplete",
    ]
