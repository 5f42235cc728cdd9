import os
import tempfile
from pathlib import Path

import pytest

from boost_titan.parallel import cpu_runtime

# CPU shims before any test module imports torchtitan (which fixes its device at import):
# collection order must not decide whether in-process tests run
cpu_runtime.activate()
# tests read DCP checkpoints themselves too (test_fault_tolerance): with the package's
# allowlisted metadata reader, as boost_titan.train and boost_titan.cli.checkpoint do
from boost_titan.checkpoint import integrity, safe_metadata  # noqa: E402

safe_metadata.install()
integrity.install()  # and checksums: the trainer's checkpoints carry them

REPO_ROOT = Path(__file__).resolve().parents[1]

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Under xdist each worker gets its share of the cores (launcher.cores), for its own
    # intra-op pool and, through the environment, every process it starts (fork server,
    # dry-run roles, run_train.sh's ranks): sized for the whole machine, two workers ran
    # twice as many spinning OpenMP threads as there are cores (tests/README.md)
    import torch
    from launcher import cores

    asked = os.environ.get("OMP_NUM_THREADS")
    threads = min(int(asked), cores()) if asked else cores()
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """The embedded corpus at <repo>/data/boost_corpus, built once (default vocab) if needed."""
    from boost_titan.data.corpus.build import build_corpus

    out = REPO_ROOT / "data" / "boost_corpus"
    build_corpus(out)
    return out


# run_train.sh's setting; set before tests/launcher.py's fork server imports `datasets`
# (which reads it at import)
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
# raw text the tests train on is tokenized into this session's cache, not ~/.cache
os.environ.setdefault(
    "BOOST_TITAN_DATA_CACHE",
    os.path.join(tempfile.gettempdir(), f"boost_titan_test_cache_{os.getpid()}"),
)


@pytest.fixture(scope="session", autouse=True)
def _cli_log_root(tmp_path_factory):
    """helpers.run_main's process logs go under pytest's temporary folder."""
    import helpers

    helpers.LOG_ROOT = str(tmp_path_factory.mktemp("cli_logs"))


@pytest.fixture(scope="session")
def seed_checkpoint(corpus_dir, tmp_path_factory):
    """``seed_checkpoint("debug_cola.toml")``: the step-0 folder of a torchtitan seed
    checkpoint of that config (one process, fp32), made once per session and shared by
    every test that starts layouts from the same weights."""
    from helpers import assert_safe_metadata, run_training

    made: dict[str, Path] = {}

    def get(config: str) -> Path:
        if config not in made:
            dump = tmp_path_factory.mktemp(f"seed_{config.removesuffix('.toml')}")
            run = run_training(
                config,
                1,
                dump,
                "--checkpoint.enable",
                "--checkpoint.create_seed_checkpoint",
                "--training.mixed_precision_param",
                "float32",
            )
            assert "Created seed checkpoint" in run.output and not run.loss  # no step ran
            step0 = dump / "checkpoint" / "step-0"
            assert step0.is_dir() and any(step0.iterdir()), step0
            assert_safe_metadata(step0)  # one process, model only
            made[config] = step0
        return made[config]

    return get
