"""run_train.sh picks NGPU and the default config from the visible GPUs (2+ GPUs: the
TP2 default, one GPU: its one-process twin, none: 2 CPU ranks), lets an explicit
NGPU / CONFIG_FILE win, and refuses more ranks than GPUs before torchrun starts.
BOOST_TITAN_VISIBLE_GPUS stands in for the GPU count; RUN_TRAIN_PRINT_ONLY=1 stops
before torchrun (bash only: no interpreter starts)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "run_train.sh"
TP2 = "./train_configs/debug_cola_btp_tp2.toml"
ONE = "./train_configs/debug_cola.toml"


def launch(gpus: int, args: list[str] = (), **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("NGPU", "CONFIG_FILE")}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={
            **base,
            "BOOST_TITAN_VISIBLE_GPUS": str(gpus),
            "RUN_TRAIN_PRINT_ONLY": "1",
            **env,
        },
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "gpus, env, chosen",
    [
        (0, {}, f"NGPU=2 CONFIG_FILE={TP2}"),  # CPU: two gloo ranks, as before
        (1, {}, f"NGPU=1 CONFIG_FILE={ONE}"),
        (2, {}, f"NGPU=2 CONFIG_FILE={TP2}"),
        (8, {}, f"NGPU=2 CONFIG_FILE={TP2}"),
        (0, {"NGPU": "4"}, f"NGPU=4 CONFIG_FILE={TP2}"),  # CPU ranks: any count
        (0, {"NGPU": "1"}, f"NGPU=1 CONFIG_FILE={ONE}"),  # the default config follows NGPU
        (8, {"NGPU": "4"}, f"NGPU=4 CONFIG_FILE={TP2}"),
        (1, {"CONFIG_FILE": "my.toml"}, "NGPU=1 CONFIG_FILE=my.toml"),
        (2, {"NGPU": "1", "CONFIG_FILE": "my.toml"}, "NGPU=1 CONFIG_FILE=my.toml"),
    ],
)
def test_run_train_picks_ranks_and_config(gpus, env, chosen):
    proc = launch(gpus, **env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"{chosen} GPUS={gpus}"
    # the choice is announced only when it was made for the user
    announced = "GPU(s) visible; set NGPU to choose" in proc.stdout
    assert announced == ("NGPU" not in env)


@pytest.mark.parametrize(
    "gpus, ngpu, message",
    [
        (1, "2", "NGPU=2 needs 2 GPUs but 1 visible (one rank per GPU); set NGPU=1 or fewer"),
        (2, "4", "NGPU=4 needs 4 GPUs but 2 visible (one rank per GPU); set NGPU=2 or fewer"),
        (0, "0", "NGPU must be a positive integer, got '0'"),
        (0, "two", "NGPU must be a positive integer, got 'two'"),
    ],
)
def test_run_train_refuses_more_ranks_than_gpus(gpus, ngpu, message):
    proc = launch(gpus, NGPU=ngpu)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert "NGPU=" not in proc.stdout  # stopped before the launch line


@pytest.mark.parametrize(
    "argv",
    [
        ["--job.config_file", "train_configs/debug_llama2_tp2.toml", "--training.steps", "3"],
        ["--training.steps", "3", "--job.config_file=train_configs/debug_llama2_tp2.toml"],
    ],
    ids=["space", "equals"],
)
@pytest.mark.parametrize("env_config", [None, "./train_configs/debug_llama2_tp2.toml"])
def test_job_config_file_on_the_command_line_is_the_config(argv, env_config):
    """torchtitan's spelling of the config trains that config (it used to be ignored:
    the script's own --job.config_file came first and the default config trained);
    the same file in CONFIG_FILE too is fine; the other arguments pass through."""
    env = {"CONFIG_FILE": env_config} if env_config else {}
    proc = launch(0, **env, args=argv)
    assert proc.returncode == 0, proc.stderr
    *_, args, chosen = proc.stdout.splitlines()
    assert chosen.split()[1] in (
        "CONFIG_FILE=train_configs/debug_llama2_tp2.toml",
        "CONFIG_FILE=./train_configs/debug_llama2_tp2.toml",
    )
    assert args == "ARGS=--training.steps 3"


def test_two_different_configs_are_refused():
    proc = launch(
        0,
        CONFIG_FILE="train_configs/debug_cola.toml",
        args=["--job.config_file", "train_configs/debug_llama2_tp2.toml"],
    )
    assert proc.returncode == 2
    assert "CONFIG_FILE=train_configs/debug_cola.toml and --job.config_file" in proc.stderr


@pytest.mark.parametrize(
    "argv",
    [["--job.config_file", "x.toml"], ["recipes/cola_llama2_7b.toml", "--job.config_file=x.toml"]],
)
def test_slurm_launcher_refuses_job_config_file(argv):
    """recipes/slurm_train.sh takes the config as its first argument; a --job.config_file
    anywhere is refused before SLURM is asked anything."""
    script = SCRIPT.parent / "recipes" / "slurm_train.sh"
    proc = subprocess.run(["bash", str(script), *argv], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "give the config as the first argument" in proc.stderr
