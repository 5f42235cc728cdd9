"""[checkpoint]: the options (always), and at launch what the run would load.

torchtitan checks little here and ignores much silently: ``keep_latest_k = 1`` fails
only once the model is built, naming no key; ``interval = 0`` divides by zero at the
first save; ``initial_load_path`` and ``load_step`` without ``enable`` are ignored
(the run starts from fresh weights); an ``initial_load_path`` is ignored too when the
dump folder's checkpoint folder exists (its newest step is resumed instead); and a
resume of a model-only step (a run's final save under ``last_save_model_only``) fails
deep inside DCP with ``Missing key in checkpoint state_dict: dataloader.dp_rank_0``.

The launch checks (:func:`_check_checkpoint_files`) read the file system: the
checkpoint folder ``<dump_folder>/<folder>``, ``initial_load_path`` and the ``.metadata``
of the step a run would resume. They run only for a launch (``WORLD_SIZE`` set), never
for tools that only parse a config (dry run, checkpoint export/import).
"""

from __future__ import annotations

import glob
import os

from boost_titan.checkpoint import folder as cf
from boost_titan.checkpoint.integrity import ChecksumMismatch
from boost_titan.checkpoint.safe_metadata import UntrustedCheckpointError
from boost_titan.train.config_check.common import ConfigPathError, _at_least, bad

_ENABLE_HINT = (
    "add --checkpoint.enable (the run then also saves checkpoints, every [checkpoint] "
    "interval steps and at the end, unless --checkpoint.load_only is added too)"
)


def _check_checkpoint(config) -> None:
    ck = config.checkpoint
    _at_least("checkpoint", "interval", ck.interval, 1, " (save every N steps)")
    if ck.keep_latest_k < 0 or ck.keep_latest_k == 1:
        raise bad(
            "checkpoint",
            "keep_latest_k",
            ck.keep_latest_k,
            "is not valid: use 0 (keep every checkpoint) or >= 2 (one complete checkpoint "
            "is kept beside the newest save, which may still be being written under "
            "async_mode or hold only the model under last_save_model_only)",
        )
    _at_least("checkpoint", "load_step", ck.load_step, -1, " (-1: the newest step)")
    # torchtitan asserts both (bare AssertionErrors), the first only at the last step
    if ck.last_save_in_hf and not ck.last_save_model_only:
        raise bad(
            "checkpoint",
            "last_save_model_only",
            False,
            "but last_save_in_hf = true: a Hugging Face save holds the model only; add "
            "--checkpoint.last_save_model_only",
        )
    if ck.initial_load_in_hf and not ck.initial_load_model_only:
        raise bad(
            "checkpoint",
            "initial_load_model_only",
            False,
            "but initial_load_in_hf = true: a Hugging Face checkpoint holds the model "
            "only; leave initial_load_model_only on (the default)",
        )
    if not ck.enable:
        if ck.initial_load_path:
            raise bad(
                "checkpoint",
                "initial_load_path",
                ck.initial_load_path,
                f"is ignored while checkpointing is off (training would start from fresh "
                f"weights): {_ENABLE_HINT}",
            )
        if ck.load_step != -1:
            raise bad(
                "checkpoint",
                "load_step",
                ck.load_step,
                f"is ignored while checkpointing is off: {_ENABLE_HINT}",
            )


def _check_recorded_model(config) -> None:
    """A step that records its model (from-dense, import) loads only into that model:
    the config's flavor must be it (``--model.flavor STEP`` names it)."""
    from boost_titan.checkpoint.model_args import check_recorded
    from boost_titan.train.config_check.common import ConfigError, _ours
    from boost_titan.train.config_check.model import config_args

    if not _ours(config) or config.checkpoint.initial_load_in_hf:
        return
    m = config.model
    try:
        check_recorded(
            config.checkpoint.initial_load_path,
            config_args(config),
            f"model {m.name!r} flavor {m.flavor!r}",
        )
    except ValueError as e:
        raise ConfigError(f"[checkpoint] initial_load_path: {e}") from None


def _check_checkpoint_files(config) -> None:
    """What a launch with checkpointing on would load: the step it resumes exists and
    is a full save; an initial_load_path is a DCP step folder and is not shadowed by
    checkpoints already in the dump folder."""
    ck = config.checkpoint
    if not ck.enable or ck.create_seed_checkpoint:  # a seed checkpoint loads nothing
        return
    folder = os.path.join(config.job.dump_folder, ck.folder)
    steps = cf.complete_steps(folder)
    if ck.initial_load_path:
        if not steps:
            _check_initial_load_path(ck)
            _check_recorded_model(config)
            if ck.initial_load_in_hf:
                _check_hf_config_fits(config)
        elif not cf.started_from(folder, ck.initial_load_path):
            # torchtitan resumes the folder's newest step and ignores initial_load_path
            raise bad(
                "checkpoint",
                "initial_load_path",
                ck.initial_load_path,
                f"would not be loaded: the dump folder's checkpoint folder {folder!r} "
                f"already holds step-{steps[-1]}{_of_another_run(folder)}, which a run "
                f"resumes first; use a new --job.dump_folder to start from "
                f"{ck.initial_load_path!r}, or drop --checkpoint.initial_load_path to "
                f"resume step-{steps[-1]}",
            )
    if ck.load_step != -1 and ck.load_step not in steps:
        held = f"holds steps {steps}" if steps else "holds no complete checkpoint"
        raise bad(
            "checkpoint",
            "load_step",
            ck.load_step,
            f"names no complete checkpoint: {folder!r} {held}"
            + ("; -1 resumes the newest" if steps else ""),
            ConfigPathError,
        )
    excluded = ck.exclude_from_loading
    if ck.load_step != -1:
        step = ck.load_step
        missing = _missing(cf.step_dir(folder, step), excluded, "load_step", step)
    else:  # the newest step that opens: the trainer sets damaged newer ones aside
        step, missing = 0, []
        for s in reversed(steps):
            found = _missing(cf.step_dir(folder, s), excluded, "load_step", -1, resume=True)
            if found is not None:
                step, missing = s, found
                break
    if step == 0:  # nothing to resume; torchtitan loads a step-0 (seed) model only
        return
    path = cf.step_dir(folder, step)
    if missing:
        full = [
            s
            for s in steps
            if s < step
            and _missing(cf.step_dir(folder, s), excluded, "load_step", -1, resume=True) == []
        ]
        ways = (
            f"resume the newest full save with --checkpoint.load_step {full[-1]}, or "
            if full
            else ""
        )
        which = "the newest step" if ck.load_step == -1 else "this step"
        held = (
            "only the model (a run's final save under [checkpoint] last_save_model_only = true)"
            if len(missing) == len(cf.TRAINING_STATES)
            else f"no {', '.join(missing)}"
        )
        hf = not os.path.isfile(os.path.join(path, ".metadata"))  # last_save_in_hf's
        if hf:
            held = "only the model, as Hugging Face safetensors (last_save_in_hf)"
        raise bad(
            "checkpoint",
            "load_step",
            ck.load_step,
            f"resumes {which}, {path!r}, which holds {held} and cannot restore "
            f"{', '.join(missing)}: {ways}start a new run from its weights with "
            f"--checkpoint.initial_load_path {path}"
            + (" --checkpoint.initial_load_in_hf" if hf else "")
            + " and a new --job.dump_folder",
        )


def _missing(path: str, excluded, key: str, value, resume: bool = False) -> list[str] | None:
    """``cf.missing_states`` of a step, which is opened (and verified) first: a damaged
    step is None when resuming (the trainer sets it aside and loads an older one), one
    line naming the damage for a checkpoint the user named; a crafted one is refused.
    The first rank (or a process outside a launch) also checks that every file of the
    step is there (one listing of the folder, no call per file): a file lost from a
    named checkpoint is refused at launch; the other ranks leave it to their loads."""
    try:
        return cf.missing_states(path, excluded, files=os.environ.get("RANK", "0") == "0")
    except ChecksumMismatch as e:
        if resume:
            return None
        raise bad("checkpoint", key, value, f"names a damaged checkpoint: {e}") from None
    except UntrustedCheckpointError as e:
        raise bad("checkpoint", key, value, f"names a refused checkpoint: {e}") from None


def _of_another_run(folder: str) -> str:
    record = cf.read_record(folder)
    return f" of a run that started from {record['initial_load_path']!r}" if record else ""


def _check_hf_config_fits(config) -> None:
    """A config.json beside HF weights must describe the run's model: DCP checks shapes
    only, and a flag like CoLA's only_lr_act changes what the forward computes without
    changing a shape."""
    path = config.checkpoint.initial_load_path
    if not os.path.isfile(os.path.join(path, "config.json")):
        return
    from boost_titan.checkpoint.hf import HFFormatError
    from boost_titan.checkpoint.hf.folder import check_same_model, format_for_config, read_hf_config
    from boost_titan.train.config_check.model import config_args

    try:
        hf = read_hf_config(path)
        found = format_for_config(hf, f"{path}/config.json").args_from_config(hf)
        check_same_model(found, config_args(config), "its config.json", "this run's model")
    except HFFormatError as e:
        raise bad("checkpoint", "initial_load_path", path, f"(initial_load_in_hf): {e}") from None


def _check_initial_load_path(ck) -> None:
    path = ck.initial_load_path
    if not os.path.exists(path):
        raise bad(
            "checkpoint",
            "initial_load_path",
            path,
            f"does not exist (cwd {os.getcwd()!r}); it must be a checkpoint's step folder, "
            "e.g. <dump_folder>/checkpoint/step-N",
            ConfigPathError,
        )
    if ck.initial_load_in_hf:
        if not glob.glob(os.path.join(path, "*.safetensors")):
            raise bad(
                "checkpoint",
                "initial_load_path",
                path,
                "holds no *.safetensors file; with [checkpoint] initial_load_in_hf it must "
                "be a folder of Hugging Face safetensors",
                ConfigPathError,
            )
        return
    if not os.path.isdir(path):
        raise bad(
            "checkpoint",
            "initial_load_path",
            path,
            "is a file, not a DCP step folder (a folder holding .metadata, e.g. "
            "<dump_folder>/checkpoint/step-N); turn a safetensors file into one with "
            "`boost-titan checkpoint import --from FILE --to DIR/step-0`",
            ConfigPathError,
        )
    if not os.path.isfile(os.path.join(path, ".metadata")):
        inner = cf.complete_steps(path)
        dumped = cf.complete_steps(os.path.join(path, "checkpoint"))
        if inner or dumped:
            what = "checkpoint" if inner else "dump"
            folder = path if inner else os.path.join(path, "checkpoint")
            why = (
                f"is a {what} folder, not a step folder: point it at one of its steps "
                f"{inner or dumped}, e.g. the newest, "
                f"{cf.step_dir(folder, (inner or dumped)[-1])!r}"
            )
        elif os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
            why = (
                "holds Hugging Face safetensors, not a DCP checkpoint: add "
                "--checkpoint.initial_load_in_hf"
            )
        else:
            why = (
                "holds no .metadata, so it is not a complete DCP step folder (a finished "
                "save holds .metadata beside its *.distcp files; a save cut off does not)"
            )
        raise bad("checkpoint", "initial_load_path", path, why, ConfigPathError)
    missing = _missing(path, ck.exclude_from_loading, "initial_load_path", path)
    if not ck.initial_load_model_only:
        if missing:
            raise bad(
                "checkpoint",
                "initial_load_model_only",
                False,
                f"but initial_load_path {path!r} holds "
                + ("only the model" if len(missing) == len(cf.TRAINING_STATES) else "no")
                + f" ({', '.join(missing)} missing): leave initial_load_model_only on "
                "(the default) to start from its weights",
            )


def _check_hf_layout(config) -> None:
    """last_save_in_hf / initial_load_in_hf: the model's Hugging Face layout
    (``boost_titan.checkpoint.hf.adapters.LAYOUT_OF_MODEL``) must hold this model (a GQA
    CoLA does not
    fit the CoLA authors' layout): refused now, not at the last step's save."""
    ck = config.checkpoint
    if not ck.enable or not (ck.last_save_in_hf or ck.initial_load_in_hf):
        return
    from boost_titan.checkpoint.hf import HFFormatError
    from boost_titan.checkpoint.hf.adapters import LAYOUT_OF_MODEL
    from boost_titan.checkpoint.hf.folder import get_format
    from boost_titan.train.config_check.model import config_args

    layout = LAYOUT_OF_MODEL[config.model.name]
    key = "last_save_in_hf" if ck.last_save_in_hf else "initial_load_in_hf"
    try:
        get_format(layout).check(config_args(config))
    except HFFormatError as e:
        raise bad(
            "checkpoint",
            key,
            True,
            f"but {config.model.name}'s Hugging Face layout {layout!r} cannot hold this "
            f"model: {e} (from this run's DCP checkpoint, `boost-titan checkpoint`)",
        ) from None
