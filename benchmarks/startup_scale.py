"""What one rank does at start-up, before step 1, against the world size (issue #48):
does any of it grow with the number of ranks?

    PYTHONPATH=. .venv/bin/python benchmarks/startup_scale.py \
        [--config recipes/cola_llama2_7b.toml] [--worlds 8 64 256 1024] [--rank first|last] \
        [--no-load] [-- --key value ...]

Each world size runs in a fresh process (DTensor caches sharding decisions with their
process groups) that is rank 0 (``--rank last``: the last rank) of a fake process group
of N ranks, the dry run's (``boost_titan.perf.dryrun``), and times, one after another,
what that rank does at start-up:

    config   parse + check the config at world size N (launch checks, files included)
    mesh     join the process group, ``ParallelDims`` + its device meshes
    model    the model on the meta device, parallelized (TP + FSDP2: ``build_role``)
    shards   its local shards allocated (fake tensors) and the optimizers built
    data     its data loader built (``loader.build_dataloader``) and its first batch read
    folder   the checkpoint folder: lock, run id, cut-off steps set aside (rank 0)
    .metadata / open_step
             a resume's load of a step saved by N ranks: torch's ``.metadata`` unpickled
             (plain DCP), then ours, ``integrity.open_step`` (every rank's load opens it)
             and the section of the rank's own file (``Step.reading``: its load reads it)

The step (``--no-load``: none) is synthesized beforehand, in a process of its own, by
``checkpoint_scale.sealed_step``: the model's tensors x 3 states (model, both AdamW
moments) x one chunk per rank, in N files, in the dump folder's checkpoint folder (so the
config check, which opens the step a resume would load, and the folder phase see it).

Prints per phase and world size: seconds, the peak RSS above the phase's start, the
child's peak RSS in the phase (``ru_maxrss``: ``checkpoint_scale.measure`` resets the
high-water mark at each phase's start), file system calls (``checkpoint_scale.Calls``)
and process groups created (``new_group`` calls, on every rank, member or not) and
joined; and the last world's figure over the first's. The data phase reads the repo's
embedded corpus (``data/boost_corpus``, its tokenizer): the recipe's is not here.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PHASES = ("config", "mesh", "model", "shards", "data", "folder", ".metadata", "open_step")
MARK = "STARTUP "  # the child's result line
# the recipe's data and tokenizer are not on this machine: the embedded corpus instead
DATA = ["--training.dataset", "boost_corpus", "--training.dataset_path", "data/boost_corpus/train",
        "--model.hf_assets_path", "data/boost_corpus/tokenizer"]  # fmt: skip
# the synthesized step holds the model and optimizer only (what grows with the world)
PARTIAL = ["--checkpoint.exclude_from_loading", "lr_scheduler,dataloader,train_state"]


# ---------------------------------------------------------------- one rank (the child)


def _groups() -> tuple[int, int]:
    """(process groups created so far, on this rank; process groups it is a member of)."""
    from torch.distributed import distributed_c10d as c10d

    return c10d._world.group_count, len(c10d._world.pg_map)


def _measured(fn) -> dict:
    """``checkpoint_scale.measure`` of ``fn()``, with process groups and ``ru_maxrss``."""
    from checkpoint_scale import measure

    made, joined = _groups()
    m = measure(fn)
    made_after, joined_after = _groups()
    return {
        "s": m["s"],
        "peak": m["peak"],
        "maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "fs": sum(m["calls"].values()),
        "made": made_after - made,
        "joined": joined_after - joined,
    }


def rank_startup(config_args: list[str], world: int, last: bool) -> dict[str, dict]:
    """The phases (module docstring) of rank 0 (``last``: rank ``world - 1``)."""
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    from boost_titan.perf.dryrun import quiet_warnings

    quiet_warnings()
    import pickle

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # (the trainer: what a training process imports before it starts, not timed)
    import boost_titan.train.trainer  # noqa: F401
    from boost_titan.checkpoint import integrity, run_id
    from boost_titan.checkpoint import lock as folder_lock
    from boost_titan.checkpoint.folder import complete_steps, step_dir
    from boost_titan.data import loader
    from boost_titan.perf.dryrun.trace import _parallel_dims, build_role
    from boost_titan.train import fault
    from boost_titan.train.config_check import check_config, parse_config
    from boost_titan.train.specs import build_optimizers

    rank = world - 1 if last else 0
    os.environ["RANK"] = str(rank)  # as torchrun sets it (the launch check reads it)
    got: dict = {}
    out: dict[str, dict] = {}

    def config():
        got["config"] = c = parse_config(config_args)
        check_config(c, world_size=world)
        c.compile.enable = False  # the dry run's eager build (compiling wraps, lazily)

    def mesh():
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        got["pd"] = _parallel_dims(got["config"], world)

    def model():
        got["role"] = build_role(got["config"], got["pd"], torch.device("cpu"))

    def shards():
        parts = got["role"].parts
        with FakeTensorMode(allow_non_fake_inputs=True):
            for part in parts:
                part.to_empty(device="cpu")
            got["optimizers"] = build_optimizers(parts, got["config"].optimizer, got["pd"])

    def data():
        batch = got["pd"].get_mesh("batch")  # (torchtitan's Trainer: the dataloading mesh)
        dl = loader.build_dataloader(batch.size(), batch.get_local_rank(), None, got["config"])
        got["batch"] = next(iter(dl))

    def folder_of():
        return os.path.join(got["config"].job.dump_folder, got["config"].checkpoint.folder)

    def folder():
        if rank == 0:  # rank 0 alone; it broadcasts the outcome (checkpoint.manager)
            got["lock"] = folder_lock.acquire(folder_of())
            run_id.read(folder_of())
            fault.quarantine_incomplete_checkpoints(folder_of())

    def torch_metadata():
        with open(os.path.join(got["step"], ".metadata"), "rb") as f:
            return pickle.load(f)

    def open_step():
        opened = integrity.open_step(got["step"])
        if hasattr(opened, "reading"):  # (the rank's own file's section: since seal/2)
            opened.reading(f"__{rank}_0.distcp")

    for name, fn in (("config", config), ("mesh", mesh), ("model", model), ("shards", shards),
                     ("data", data), ("folder", folder)):  # fmt: skip
        out[name] = _measured(fn)
    steps = complete_steps(folder_of())
    if steps:
        got["step"] = step_dir(folder_of(), steps[-1])
        integrity.release()  # (the config check opened it: a load opens it afresh)
        out[".metadata"] = _measured(torch_metadata)
        out["open_step"] = _measured(open_step)
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- the step (its own process)


def synthesize_step(config_args: list[str], world: int, folder: Path) -> int:
    """A step saved by ``world`` ranks of the config's model in ``folder``; its items."""
    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()
    import torch
    from checkpoint_scale import STATES, sealed_step

    from boost_titan.models.model import Transformer
    from boost_titan.train.config_check import config_args as model_args
    from boost_titan.train.config_check import parse_config

    with torch.device("meta"):
        tensors = len(list(Transformer(model_args(parse_config(config_args))).parameters()))
    folder.mkdir(parents=True)
    sealed_step(folder, tensors, world)
    return tensors * len(STATES) * world


# ---------------------------------------------------------------- the table


REPO = Path(__file__).resolve().parents[1]


def _run(args: list[str]) -> str:
    """This script run with ``args`` in a fresh process, from the repo (its relative
    paths: recipes, data), importing this checkout's boost_titan."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    env.pop("WORLD_SIZE", None)  # (the world size is the child's argument)
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          check=False, cwd=REPO, env=env)  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:4])}: failed\n{proc.stderr[-4000:]}")
    return proc.stdout


def child_line(args: list[str]) -> dict:
    """The result line of a child run of this script with ``args``."""
    out = _run(args)
    return json.loads(out[out.rindex(MARK) + len(MARK) :])


FIGURES = (
    ("seconds", "s", lambda v: f"{v:.3f}"),
    ("peak RSS above the phase's start, MiB", "peak", lambda v: f"{v / 2**20:.0f}"),
    ("child's peak RSS in the phase (ru_maxrss), MiB", "maxrss", lambda v: f"{v / 2**20:.0f}"),
    ("file system calls", "fs", str),
    ("process groups created (new_group calls)", "made", str),
    ("process groups joined", "joined", str),
)


def table(worlds: list[int], results: dict[int, dict]) -> list[str]:
    first, last = worlds[0], worlds[-1]
    lines = []
    for title, key, fmt in FIGURES:
        head = "".join(f"{w:>10}" for w in worlds)
        lines += ["", f"{title:<42}{head}  {last}/{first}"]
        for phase in PHASES:
            if phase not in results[first]:
                continue
            vals = [results[w][phase][key] for w in worlds]
            a, b = vals[0], vals[-1]
            ratio = f"x{b / a:.2f}" if a else ("x1.00" if a == b else "-")
            lines.append(f"  {phase:<40}" + "".join(f"{fmt(v):>10}" for v in vals) + f"  {ratio}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="recipes/cola_llama2_7b.toml")
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    ap.add_argument("--rank", choices=("first", "last"), default="first")
    ap.add_argument("--no-load", action="store_true", help="no step in the checkpoint folder")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)  # one rank's run
    ap.add_argument("--synth", type=int, help=argparse.SUPPRESS)  # a step of N ranks
    ap.add_argument("--step", help=argparse.SUPPRESS)
    a, overrides = ap.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    config_args = ["--job.config_file", a.config, *DATA, *overrides]
    if a.synth:
        print(MARK + json.dumps(synthesize_step(config_args, a.synth, Path(a.step))))
        return
    if a.child:
        print(MARK + json.dumps(rank_startup(config_args, a.child, a.rank == "last")))
        return
    results, items = {}, {}
    for world in a.worlds:
        dump = Path(tempfile.mkdtemp(prefix=f"startup-{world}-"))
        try:
            common = ["--config", a.config, "--rank", a.rank]
            tail = ["--", *overrides, "--job.dump_folder", str(dump)]
            tail += [] if a.no_load else PARTIAL
            if not a.no_load:
                step = str(dump / "checkpoint" / "step-100")
                items[world] = child_line([*common, "--synth", str(world), "--step", step, *tail])
            results[world] = child_line([*common, "--child", str(world), *tail])
        finally:
            shutil.rmtree(dump, ignore_errors=True)
        print(f"world {world}: done", file=sys.stderr)
    print(f"{a.config}, {a.rank} rank, one fresh process per world size")
    if items:
        print("step loaded: " + ", ".join(f"{w} ranks {n:,} items" for w, n in items.items()))
    print("\n".join(table(a.worlds, results)))


if __name__ == "__main__":
    main()
