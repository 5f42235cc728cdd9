"""Loading a checkpoint never runs code from it (issue #32): a DCP step folder whose
``.metadata`` pickles ``os.system(...)`` is refused, naming the folder and the global,
before anything is built from it, through every way a checkpoint is loaded:
``--checkpoint.initial_load_path``, resuming from the dump folder, and
``boost-titan checkpoint export``; so are a pickled (bytes) item that names
such a global or stands where a tensor is expected, and a data loader state that does.
The allowlists are complete for what we write: the checkpoint tests (test_checkpoints,
test_composition, test_loro_ranks) pass each layout's checkpoint, its pickled items
included, through ``helpers.assert_safe_metadata``; this file adds the one layout they
do not save, one process with the optimizer."""

from __future__ import annotations

import os
import pickle
import shutil
from collections import OrderedDict

import pytest
import torch
from helpers import REPO_ROOT, assert_safe_metadata, run_main, run_training

CONFIG = "debug_cola.toml"
REFUSED = "refers to posix.system, which DCP metadata is not made of; it is not a DCP checkpoint"

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


class _RunsCommand:
    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def _evil_step(folder, marker) -> str:
    """What the issue's reproduction loads: a step folder whose .metadata runs
    ``touch marker`` when unpickled, and an empty shard."""
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps(_RunsCommand(f"touch {marker}")))
    (folder / "__0_0.distcp").write_bytes(b"")
    return str(folder)


def _assert_refused(output: str, folder: str, marker) -> None:
    assert not marker.exists(), "the checkpoint's pickle ran a command"
    line = f"checkpoint {folder} was not loaded: its .metadata {REFUSED}"
    assert line in output, output[-4000:]


class _Sub(OrderedDict):
    """A harmless class outside the allowlist."""


def test_refuses_globals_outside_the_allowlist_by_name(tmp_path):
    from boost_titan.checkpoint import safe_metadata

    marker = tmp_path / "marker"
    data = pickle.dumps(_RunsCommand(f"touch {marker}"))
    with pytest.raises(safe_metadata.UntrustedCheckpointError, match="refers to posix.system"):
        safe_metadata.loads(data, "step-0")
    assert not marker.exists()
    with pytest.raises(
        safe_metadata.UntrustedCheckpointError,
        match=r"^checkpoint EVIL/step-3 was not loaded: its \.metadata refers to "
        r"test_safe_metadata\._Sub, which DCP metadata is not made of; it is not a DCP "
        r"checkpoint boost_titan wrote or trusts",
    ):
        safe_metadata.loads(pickle.dumps({"a": _Sub(x=1)}), "EVIL/step-3")
    # the refusal is no Exception: DCP's loader would log it and fall back to rank files
    assert not issubclass(safe_metadata.UntrustedCheckpointError, Exception)


def _sets_attributes_of(module: str, name: str, slots: dict) -> bytes:
    """A pickle that pushes an allowed global itself and BUILDs slot state onto it
    (``setattr`` on the class or function: no code runs, but state would change)."""
    pushed = b"c" + module.encode() + b"\n" + name.encode() + b"\n"
    state = pickle.dumps((None, slots), protocol=2)[2:-1]  # (no protocol header, no STOP)
    return b"\x80\x02" + pushed + state + b"b."  # BUILD, STOP


@pytest.mark.parametrize(
    "module, name, slots",
    [
        ("torch.distributed.checkpoint.metadata", "Metadata", {"planner_data": {"x": 1}}),
        ("torch.serialization", "_get_layout", {"__defaults__": ("torch.sparse_coo",)}),
        ("pathlib", "PosixPath", {"__fspath__": "/etc"}),
    ],
)
def test_a_pickle_that_sets_attributes_of_an_allowed_global_is_refused_and_undone(
    module, name, slots
):
    """Issue #48, finding 5: BUILD with slot state on an allowed global set attributes
    that outlived the refusal; now the step is refused and the attributes put back."""
    import importlib

    from boost_titan.checkpoint import safe_metadata

    obj = getattr(importlib.import_module(module), name)
    before = {k: getattr(obj, k, None) for k in slots}
    with pytest.raises(safe_metadata.UntrustedCheckpointError) as info:
        safe_metadata.loads(_sets_attributes_of(module, name, slots), "EVIL/step-5")
    (attr,) = slots
    # a special attribute is refused by the checked unpickler before it is set; another
    # is set by the C unpickler, then put back
    when = "refused before it was set" if attr.startswith("__") else "put back"
    assert str(info.value) == (
        f"checkpoint EVIL/step-5 was not loaded: its .metadata sets {module}.{name}.{attr} "
        f"while it is unpickled ({when}); it is not a DCP checkpoint boost_titan wrote or "
        "trusts"
    )
    assert {k: getattr(obj, k, None) for k in slots} == before


_META = "torch.distributed.checkpoint.metadata"


def _glob(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _text(s: str) -> bytes:
    return b"X" + len(s.encode()).to_bytes(4, "little") + s.encode()  # BINUNICODE


_MEMBER = _glob(_META, "_MEM_FORMAT_ENCODING") + b"K\x01\x85R"  # the enum member of value 1
_FRESH = _glob(_META, "BytesStorageMetadata") + b")\x81"  # a new one: cls.__new__(cls)
_TO_METADATA = _glob(_META, "Metadata")


def _build(target: bytes, key: bytes, value: bytes, slots: bool = True) -> bytes:
    """PROTO 2, ``target`` pushed, then BUILD of ``{key: value}``, as slot state
    (``setattr``) or as dict state (into its __dict__)."""
    state = b"}" + key + value + b"s"
    return b"\x80\x02" + target + (b"N" + state + b"\x86" if slots else state) + b"b."


_CASES = {
    # issue 56 item 7: the member became a Metadata for the rest of the process
    "member-class-slots": (_MEMBER, _text("__class__"), True, "{member}.__class__"),
    "member-class-dict": (_MEMBER, _text("__class__"), False, "{member}.__class__"),
    "member-dict": (_MEMBER, _text("__dict__"), True, "{member}.__dict__"),
    # protocol 0's UNICODE with \u escapes: no "__class__" in the bytes
    "member-class-escaped": (
        _MEMBER,
        b"V\\u005f\\u005fclass\\u005f\\u005f\n",
        True,
        "{member}.__class__",
    ),
    # no special name in the bytes: the C unpickler sets it, the guard puts it back
    "member-sunder": (_MEMBER, _text("_value_"), True, "{member}._value_ (put back)"),
    "class-bases": (
        _glob(_META, "StorageMeta"),
        _text("__bases__"),
        True,
        "{meta}.StorageMeta.__bases__",
    ),
    "fresh-class": (
        _FRESH,
        _text("__class__"),
        True,
        "a {meta}.BytesStorageMetadata it builds.__class__",
    ),
    "fresh-dunder-dict-state": (
        _FRESH,
        _text("__reduce_ex__"),
        False,
        "a {meta}.BytesStorageMetadata it builds.__reduce_ex__",
    ),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_a_build_of_a_special_attribute_is_refused(case):
    """Issue 56, item 7: a BUILD that set ``__class__`` on an allowed enum member was not
    refused (the guard compared only vars() and defaults) and left the member a
    ``Metadata`` for the rest of the process, so a later save wrote a ``.metadata`` that
    no longer loaded. Now a BUILD of any special attribute, on any object, and any BUILD
    on an allowed global or enum member, is refused in one line before it sets anything,
    and the member is unchanged."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as Encoding

    from boost_titan.checkpoint import safe_metadata

    target, key, slots, what = _CASES[case]
    member = Encoding(1)
    before = (type(member), dict(vars(member)), member.value, member.name)
    data = _build(target, key, _TO_METADATA, slots)
    with pytest.raises(safe_metadata.UntrustedCheckpointError) as info:
        safe_metadata.loads(data, "EVIL/step-7")
    what = what.format(member=f"{_META}._MEM_FORMAT_ENCODING.{member.name}", meta=_META)
    what, _, when = what.partition(" (")
    assert str(info.value) == (
        f"checkpoint EVIL/step-7 was not loaded: its .metadata sets {what} while it is "
        f"unpickled ({when.rstrip(')') or 'refused before it was set'}); it is not a DCP "
        "checkpoint boost_titan wrote or trusts"
    )
    assert (type(member), dict(vars(member)), member.value, member.name) == before
    assert Encoding(1) is member and all(type(m) is Encoding for m in Encoding)


def test_the_guard_puts_back_a_changed_class_of_an_allowed_object(monkeypatch):
    """The second line of defence, where the C unpickler reads the pickle (it does where
    the bytes hold no special name): the complete identity of every allowed global and
    enum member, its type included, is compared after the load, put back and refused."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING as Encoding

    from boost_titan.checkpoint import safe_metadata

    monkeypatch.setattr(safe_metadata, "_MAYBE_DUNDER", ())  # as if the scan missed it
    member = Encoding(1)
    data = _build(_MEMBER, _text("__class__"), _TO_METADATA)
    with pytest.raises(safe_metadata.UntrustedCheckpointError) as info:
        safe_metadata.loads(data, "EVIL/step-7")
    assert str(info.value) == (
        f"checkpoint EVIL/step-7 was not loaded: its .metadata sets {_META}._MEM_FORMAT_"
        f"ENCODING.{member.name}.__class__ while it is unpickled (put back); it is not a DCP "
        "checkpoint boost_titan wrote or trusts"
    )
    assert type(member) is Encoding and Encoding(1) is member


def test_reader_is_installed_and_reads_dcp_metadata(tmp_path):
    """Installed over FileSystemReader.read_metadata (here by conftest; the entry points'
    own installs are what the reproduction below exercises), a DCP save/load round trip
    goes through the reader, which reads what plain pickle reads."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    from boost_titan.checkpoint import safe_metadata

    assert safe_metadata.installed()
    state = {"w": torch.randn(3, 4), "b": torch.zeros(2, dtype=torch.bfloat16), "n": {"k": 7}}
    dcp.save(state, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    assert_safe_metadata(tmp_path / "step-1")
    back = {"w": torch.empty(3, 4), "b": torch.empty(2, dtype=torch.bfloat16), "n": {"k": 0}}
    dcp.load(back, checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    assert torch.equal(back["w"], state["w"]) and back["n"]["k"] == 7
    meta = FileSystemReader(str(tmp_path / "step-1")).read_metadata()
    assert meta.storage_meta.load_id  # torch's bookkeeping is kept
    # without its manifest (boost_titan.checkpoint.integrity would refuse the changed bytes
    # before they are unpickled): what the allowlist sees is the point here; a pickle of
    # plain data that is no DCP metadata is a damaged step
    from boost_titan.checkpoint.integrity import ChecksumMismatch

    (tmp_path / "step-1" / ".manifest.json").unlink()
    (tmp_path / "step-1" / ".metadata").write_bytes(pickle.dumps([1]))
    with pytest.raises(ChecksumMismatch, match=r"its \.metadata holds a list, not DCP Metadata"):
        FileSystemReader(str(tmp_path / "step-1")).read_metadata()
    (tmp_path / "step-1" / ".metadata").write_bytes(pickle.dumps(_RunsCommand("true")))
    with pytest.raises(safe_metadata.UntrustedCheckpointError, match="refers to posix.system"):
        FileSystemReader(str(tmp_path / "step-1")).read_metadata()


def test_crafted_checkpoint_is_refused_on_every_load_path(seed_checkpoint, tmp_path):
    """The issue's reproduction, one process: initial_load_path, a dump-folder resume
    (after a real one-process run saved a full checkpoint there: the layout with the
    optimizer no other test saves with one process) and export. The marker file the
    pickle would create never appears; each exits non-zero on the refusal's line."""
    marker = tmp_path / "PWNED"
    evil = _evil_step(tmp_path / "EVIL" / "step-0", marker)
    run = run_training(
        CONFIG,
        1,
        tmp_path / "initial",
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        evil,
        expect_failure=True,
    )
    _assert_refused(run.output, evil, marker)  # run_training: it exited non-zero
    assert not run.loss  # refused before the first step

    # a real one-process run with its optimizer, then a crafted later step beside it
    dump = tmp_path / "resume"
    run_training(
        CONFIG,
        1,
        dump,
        "--training.steps",
        "1",
        "--validation.no-enable",
        "--checkpoint.enable",
        "--checkpoint.initial_load_path",
        str(seed_checkpoint(CONFIG)),
        "--checkpoint.no-last-save-model-only",
    )
    full = dump / "checkpoint" / "step-1"
    assert_safe_metadata(full)
    assert any(k.startswith("optimizer.") for k in _keys(full))
    shutil.copytree(evil, dump / "checkpoint" / "step-2")
    run = run_training(
        CONFIG, 1, dump, "--training.steps", "3", "--checkpoint.enable", expect_failure=True
    )
    _assert_refused(run.output, str(dump / "checkpoint" / "step-2"), marker)
    assert not run.loss

    proc = run_main(
        "boost_titan.cli.main",
        "checkpoint",
        "export",
        "--from",
        evil,
        "--to",
        str(tmp_path / "out.safetensors"),
        "--job.config_file",
        str(REPO_ROOT / "train_configs" / CONFIG),
    )
    assert proc.returncode != 0
    _assert_refused(proc.stderr, evil, marker)
    assert not (tmp_path / "out.safetensors").exists()


def _keys(step_dir) -> list[str]:
    from boost_titan.checkpoint import safe_metadata

    data = (step_dir / ".metadata").read_bytes()
    return list(safe_metadata.loads(data, str(step_dir)).state_dict_metadata)


def _dcp_load_refused(state, step_dir) -> str:
    """dcp.load's refusal line (DCP wraps a refusal raised while it reads)."""
    import torch.distributed.checkpoint as dcp

    from boost_titan.checkpoint import safe_metadata

    with pytest.raises(BaseException) as info:
        dcp.load(state, checkpoint_id=str(step_dir), no_dist=True)
    refused = safe_metadata.refusal_in(info.value)
    assert refused is not None, info.value
    return str(refused)


def test_a_bytes_item_in_an_allowlisted_checkpoint_runs_no_code(tmp_path):
    """The hole the metadata allowlist leaves: .metadata made only of allowed classes
    may declare any key a bytes item. Where the loader asks for a tensor (a model-only
    initial_load_path does) the load is refused before anything is unpickled; where it
    asks for an object (train state, optimizer settings), the item is read weights-only
    and refused by the global it names."""
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "PWNED"
    step = tmp_path / "step-5"
    dcp.save({"w": _RunsCommand(f"touch {marker}")}, checkpoint_id=str(step), no_dist=True)
    assert_safe_metadata_only(step)  # the metadata passes the allowlist
    line = _dcp_load_refused({"w": torch.empty(3)}, step)
    assert line == (
        f"checkpoint {step} was not loaded: its .metadata declares w a pickled (bytes) item, "
        "where this load expects a tensor; it is not a DCP checkpoint boost_titan wrote or trusts"
    )
    line = _dcp_load_refused({"w": 0}, step)
    assert line.startswith(
        f"checkpoint {step} was not loaded: its item w refers to posix.system, which no item "
        "boost_titan saves is made of"
    ), line
    assert not marker.exists(), "a bytes item's pickle ran a command"


def test_data_loader_state_is_unpickled_with_no_global(tmp_path):
    """torchtitan's data loader pickles its state inside its bytes item and
    ``pickle.loads`` it on every full resume: that pickle is read with no global
    allowed first, so a crafted one is refused (naming the folder, the rank's key and
    the global) and torchtitan's loads never sees it; plain state still loads."""
    import torch.distributed.checkpoint as dcp
    from torch.utils.data import IterableDataset
    from torchtitan.components.dataloader import ParallelAwareDataloader

    class _Numbers(IterableDataset):
        def __iter__(self):
            return iter(range(8))

    loader = ParallelAwareDataloader(_Numbers(), dp_rank=0, dp_world_size=1, batch_size=2)
    next(iter(loader))
    marker = tmp_path / "PWNED"
    evil = {"dp_rank_0": pickle.dumps(_RunsCommand(f"touch {marker}")), "world_size": 1}
    step = tmp_path / "step-7"
    dcp.save({"dataloader": evil}, checkpoint_id=str(step), no_dist=True)
    assert_safe_metadata_only(step)
    with pytest.raises(BaseException) as info:  # DCP hands the state over after its read
        dcp.load({"dataloader": loader}, checkpoint_id=str(step), no_dist=True)
    assert str(info.value).startswith(
        f"checkpoint {step} was not loaded: its data loader state dp_rank_0 refers to "
        "posix.system, which data loader state is not made of"
    ), info.value
    assert not marker.exists(), "the data loader's pickle ran a command"

    state = loader.state_dict()
    fresh = ParallelAwareDataloader(_Numbers(), dp_rank=0, dp_world_size=1, batch_size=2)
    fresh.load_state_dict(state)
    assert next(iter(fresh)).tolist() == [2, 3]  # resumed after the first batch


def assert_safe_metadata_only(step_dir) -> None:
    """The crafted folders above pass the metadata allowlist (their items are the point)."""
    from boost_titan.checkpoint import safe_metadata

    data = (step_dir / ".metadata").read_bytes()
    assert safe_metadata.loads(data, str(step_dir)) == pickle.loads(data)


def test_a_step_whose_bytes_name_a_special_attribute_reads_the_same(tmp_path):
    """A checkpoint saved under a folder named like a special attribute (its path is in
    .metadata) is read by the checked unpickler, and reads what plain pickle reads."""
    import torch.distributed.checkpoint as dcp

    from boost_titan.checkpoint import safe_metadata

    step = tmp_path / "__pycache__" / "step-1"
    dcp.save({"w": torch.randn(3, 4), "n": {"k": 7}}, checkpoint_id=str(step), no_dist=True)
    data = (step / ".metadata").read_bytes()
    assert safe_metadata._MAYBE_DUNDER[0].search(data)  # (the checked unpickler's case)
    assert safe_metadata.loads(data, str(step)) == pickle.loads(data)
