"""What a fork server imports once, so that every process it forks starts with torch,
torchtitan and boost_titan's trainer and tracer imported (a spawned process spends
~5 s of CPU on these imports, more than a debug run's steps or a 7B dry-run role's
trace). Used by the dry run's role processes (``boost_titan.perf.dryrun.run``) and the
test suite's rank launcher (``tests/launcher.py``)::

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["boost_titan.perf.preload"])

Forking is safe here: importing starts no threads (OpenMP's pool is made at the first
parallel op, in the forked process)."""

import os

# torchft (imported with torchtitan) reads RUST_LOG once, at import: its Rust side logs
# six INFO lines per step per rank; warnings and errors stay (a RUST_LOG of yours is kept)
os.environ.setdefault("RUST_LOG", "warn")

from boost_titan.parallel import cpu_runtime

cpu_runtime.activate()  # before torchtitan: it fixes its device type at import

import torchtitan.train  # noqa: E402, F401

import boost_titan.perf.dryrun.trace  # noqa: E402, F401
import boost_titan.train.config_check  # noqa: E402, F401
import boost_titan.train.trainer  # noqa: E402, F401
