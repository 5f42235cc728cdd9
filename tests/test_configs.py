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
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert len(out.stdout.strip().splitlines()) == len(TOMLS)


@pytest.mark.parametrize("bad,message", [
    (["--boost.tp_plan", "megatron"], "tp_plan = 'megatron' is not valid; choose one of"),
    (["--boost.rmsnorm", "fast"], "rmsnorm = 'fast' is not valid"),
    (["--model.name", "gpt2"], "unknown model name 'gpt2'; boost_titan models: ['cola_llama2', 'lax_llama2', 'llama2', 'svd_llama2']"),
    (["--model.flavor", "9b"], "unknown flavor '9b' for model 'cola_llama2'; valid flavors:"),
])
def test_bad_config_values_fail_early(bad, message):
    code = _CHECK.replace('for path in sys.argv[1:]:\n    cfg = parse_config(["--job.config_file", path])',
                          'for path in sys.argv[1:2]:\n    cfg = parse_config(["--job.config_file", path, *sys.argv[2:]])')
    out = subprocess.run(
        [sys.executable, "-c", code, str(REPO / "train_configs/debug_cola_btp_tp2.toml"), *bad],
        capture_output=True, text=True, cwd=REPO,
    )
    assert out.returncode != 0
    assert message in out.stderr, out.stderr[-2000:]
