"""A launch's config, checked once, in one process, before ``torchrun`` starts.

    boost-titan check-config WORLD_SIZE --job.config_file X.toml [overrides...]

``run_train.sh`` runs it with WORLD_SIZE = NGPU x NNODES and ``recipes/slurm_train.sh``
with GPUS_PER_NODE x SLURM_NNODES, with the arguments the ranks will get. It runs the
checks every rank runs before it builds anything (:func:`parse_launch_config`: the
config file, the flags, ``boost_titan.train.config_check`` with the world size, what this
machine cannot run, ``BOOST_TITAN_INJECT``). A config error is one line on stderr
(``boost-titan check-config: error: [section] key = value ...``: the key, the value,
what is valid; ``boost_titan.config.refusal``, as every command's) and exit status 2
(:data:`CONFIG_ERROR_EXIT`); a good config prints nothing and exits 0.

Without it a bad value is found by every rank at once: a traceback per rank and
torchrun's ChildFailedError report (56 lines for a TP degree of 3 on 2 processes), and
on a cluster only after the job got its nodes and every node's ranks imported torch.

Inside a rank (``boost_titan.train.trainer.main``) the same checks end the same way,
:func:`parse_or_exit`: one line (``boost_titan.train: error: ...``), no traceback, exit
status 2.
"""

from __future__ import annotations

import os
import sys

from boost_titan.config import refuse

PROG = "boost-titan check-config"
RANK_PROG = "boost_titan.train"  # what torchrun runs: -m boost_titan.train
CONFIG_ERROR_EXIT = 2  # as tyro's usage errors (an unknown flag) and run_train.sh's own
# what a config check raises (boost_titan.train.config_check.common: ConfigError, ConfigPathError)
CONFIG_ERRORS = (ValueError, FileNotFoundError)


def parse_launch_config(argv: list[str]):
    """CLI + TOML -> the checked JobConfig, with every check a rank makes before it
    builds anything (``WORLD_SIZE`` from the environment: the launch checks)."""
    from boost_titan.parallel.pipeline import check_schedule_runs_here
    from boost_titan.train import fault
    from boost_titan.train.config_check import parse_config
    from boost_titan.train.config_check.converters import check_converters_run_here

    config = parse_config(argv)
    check_schedule_runs_here(config)
    check_converters_run_here(config)
    fault.parse_injections(os.environ.get(fault.INJECT_ENV, ""))  # a bad spec fails here
    return config


def parse_or_exit(argv: list[str], prog: str = RANK_PROG):
    """:func:`parse_launch_config`; a config error is one refusal line on stderr (the
    message alone) and exit status :data:`CONFIG_ERROR_EXIT` (a SystemExit: no
    traceback, and torchelastic's error file gets none to print once per rank)."""
    try:
        return parse_launch_config(argv)
    except CONFIG_ERRORS as e:
        refuse(prog, e, CONFIG_ERROR_EXIT)


USAGE = (
    "usage: boost-titan check-config WORLD_SIZE --job.config_file CONFIG [--section.key VALUE ...]"
)
HELP = f"""{USAGE}

Check a training config for a launch of WORLD_SIZE processes, as run_train.sh does before
torchrun starts: every check a rank makes before it builds anything, in one process.

  WORLD_SIZE               the launch's process count (NGPU x NNODES), a positive integer
  --job.config_file CONFIG the training config (TOML), required
  --section.key VALUE      overrides, as the ranks will get them

A good config prints nothing and exits 0; a bad one prints one line (the key, the value,
what is valid) and exits {CONFIG_ERROR_EXIT}."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(HELP)
        raise SystemExit(0)
    if not argv or not argv[0].isdigit() or int(argv[0]) < 1:
        got = f"got {argv[0]!r}" if argv else "none given"
        refuse(
            PROG,
            f"WORLD_SIZE must come first, a positive process count ({got}); {USAGE}",
            CONFIG_ERROR_EXIT,
        )
    os.environ["WORLD_SIZE"] = argv[0]  # the launch checks: degrees against it, files

    from boost_titan.parallel import cpu_runtime

    cpu_runtime.activate()  # before torchtitan is imported, as in boost_titan.train
    parse_or_exit(argv[1:], PROG)


if __name__ == "__main__":
    main()
