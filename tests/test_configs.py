"""Every shipped TOML (train_configs/, recipes/) parses with boost_titan's config and
names a registered model, flavor and valid [boost] options."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOMLS = sorted(REPO.glob("train_configs/*.toml")) + sorted(REPO.glob("recipes/*.toml"))

_CHECK = """
import sys
from boost_titan import cpu_runtime
cpu_runtime.activate()
from boost_titan.train import parse_config
for path in sys.argv[1:]:
    cfg = parse_config(["--job.config_file", path])
    print(path, cfg.model.name, cfg.model.flavor, cfg.boost.tp_plan)
"""


def test_all_configs_parse():
    assert len(TOMLS) >= 15
    out = subprocess.run(
        [sys.executable, "-c", _CHECK, *map(str, TOMLS)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.strip().splitlines()) == len(TOMLS)


BAD = [
    (["--boost.tp_plan", "megatron"], "tp_plan = 'megatron' is not valid; choose one of"),
    (["--boost.rmsnorm", "fast"], "rmsnorm = 'fast' is not valid"),
    (
        ["--model.name", "gpt2"],
        "unknown model name 'gpt2'; boost_titan models: "
        "['cola_llama2', 'lax_llama2', 'llama2', 'svd_llama2']",
    ),
    (["--model.flavor", "9b"], "unknown flavor '9b' for model 'cola_llama2'; valid flavors:"),
    (
        ["--boost.latent_checkpoint", "full"],
        "latent_checkpoint = 'full' is not valid; choose one of",
    ),
    (
        ["--boost.latent_checkpoint_keep", "all"],
        "latent_checkpoint_keep = 'all' is not valid; choose one of",
    ),
    (
        [
            "--activation_checkpoint.mode",
            "selective",
            "--activation_checkpoint.selective_ac_option",
            "x",
        ],
        "selective_ac_option = 'x' is not valid",
    ),
    # pipeline splits and microbatching (debug model: 4 layers, local batch 4)
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_microbatch_size",
            "3",
        ],
        "pipeline_parallel_microbatch_size = 3 does not divide training.local_batch_size = 4; "
        "valid microbatch sizes: [1, 2, 4]",
    ),
    (
        ["--parallelism.pipeline_parallel_degree", "4"],
        "4 pipeline stages (pipeline_parallel_degree 4 x 1 per rank for 1F1B) do not divide the 6 "
        "effective layers (4 layers + first_stage_less_layers 1 + last_stage_less_layers 1)",
    ),
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            "Interleaved1F1B",
        ],
        "4 pipeline stages (pipeline_parallel_degree 2 x 2 per rank for Interleaved1F1B) "
        "do not divide",
    ),
    (
        [
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_layers_per_stage",
            "4",
        ],
        "pipeline_parallel_layers_per_stage = 4 does not divide the 6 effective layers",
    ),
]

_CHECK_BAD = """
import json, sys
from boost_titan import cpu_runtime
cpu_runtime.activate()
from boost_titan.train import parse_config
errors = []
for bad in json.loads(sys.argv[2]):
    try:
        parse_config(["--job.config_file", sys.argv[1], *bad])
        errors.append(None)
    except BaseException as e:  # tyro exits with SystemExit on unparsable values
        errors.append(f"{type(e).__name__}: {e}")
print(json.dumps(errors))
"""


@pytest.fixture(scope="module")
def bad_config_errors():
    """The error of every BAD case, from one interpreter (imports dominate the cost)."""
    import json

    out = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHECK_BAD,
            str(REPO / "train_configs/debug_cola_btp_tp2.toml"),
            json.dumps([bad for bad, _ in BAD]),
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("case", range(len(BAD)), ids=[" ".join(b) for b, _ in BAD])
def test_bad_config_values_fail_early(bad_config_errors, case):
    bad, message = BAD[case]
    error = bad_config_errors[case]
    assert error is not None, f"{bad} was accepted"
    assert message in error, error
