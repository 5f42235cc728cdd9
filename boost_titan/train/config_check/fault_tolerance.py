"""[fault_tolerance]: torchft replica groups (``boost_titan.train.replicas``). What works
is checked here, before any rank starts; what does not is refused in one line saying why
and what works instead."""

from __future__ import annotations

import importlib.util
import os
import socket
from urllib.parse import urlsplit

from boost_titan.train.config_check.common import ConfigError, _at_least, bad

INSTALL = ".venv/bin/pip install -e '.[ft]' (torchft==0.2.0)"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
#: how long the launch check waits for the lighthouse to accept a connection
CONNECT_TIMEOUT_S = 5.0
SEMI_SYNC = (None, "diloco", "local_sgd")


def _check_fault_tolerance(config, world_size: int | None) -> None:
    ft = config.fault_tolerance
    if not ft.enable:
        if ft.semi_sync_method is not None:
            raise bad(
                "fault_tolerance",
                "semi_sync_method",
                ft.semi_sync_method,
                "needs [fault_tolerance] enable = true (semi-synchronous training runs "
                "across torchft replica groups)",
            )
        return
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            f"[fault_tolerance] enable = true needs torchft, which is not installed: {INSTALL}"
        )
    _at_least("fault_tolerance", "group_size", ft.group_size, 1, " (the number of replica groups)")
    if not 0 <= ft.replica_id < ft.group_size:
        raise bad(
            "fault_tolerance",
            "replica_id",
            ft.replica_id,
            f"must be in 0..{ft.group_size - 1} (group_size {ft.group_size})",
        )
    if not 1 <= ft.min_replica_size <= ft.group_size:
        raise bad(
            "fault_tolerance",
            "min_replica_size",
            ft.min_replica_size,
            f"must be in 1..{ft.group_size} (group_size {ft.group_size})",
        )
    if ft.process_group not in ("gloo", "nccl"):
        raise bad("fault_tolerance", "process_group", ft.process_group, "must be 'gloo' or 'nccl'")
    _at_least("fault_tolerance", "process_group_timeout_ms", ft.process_group_timeout_ms, 1)
    if ft.semi_sync_method not in SEMI_SYNC:
        raise bad(
            "fault_tolerance",
            "semi_sync_method",
            ft.semi_sync_method,
            "is not a method: 'diloco', 'local_sgd' or none (every step synchronous)",
        )
    if ft.semi_sync_method is not None:
        _at_least(
            "fault_tolerance", "sync_steps", ft.sync_steps, 1,
            " (the inner steps between two synchronizations across the groups)",
        )  # fmt: skip
        if config.training.steps % ft.sync_steps:
            raise bad(
                "training",
                "steps",
                config.training.steps,
                f"with semi_sync_method = {ft.semi_sync_method!r} must be a multiple of "
                f"[fault_tolerance] sync_steps = {ft.sync_steps}: the run ends on a sync, "
                "where every replica group holds the same parameters",
            )
    p = config.parallelism
    if p.data_parallel_replicate_degree > 1:
        raise bad(
            "parallelism",
            "data_parallel_replicate_degree",
            p.data_parallel_replicate_degree,
            "with [fault_tolerance]: the replica groups are the replicate dimension; "
            "set it to 1 and launch more groups (--fault_tolerance.group_size)",
        )
    if p.pipeline_parallel_degree > 1:
        raise bad(
            "parallelism",
            "pipeline_parallel_degree",
            p.pipeline_parallel_degree,
            "with [fault_tolerance]: a pipeline's stages would each need their own "
            "recovery; use TP/BTP and FSDP2 inside each replica group",
        )
    if p.context_parallel_degree > 1:
        raise bad(
            "parallelism",
            "context_parallel_degree",
            p.context_parallel_degree,
            "with [fault_tolerance] is not supported (not tested across replica groups); "
            "use TP/BTP and FSDP2 inside each replica group",
        )
    if config.optimizer.early_step_in_backward:
        raise bad(
            "optimizer",
            "early_step_in_backward",
            True,
            "with [fault_tolerance]: the step must wait for the replica groups' gradients",
        )
    from boost_titan.data.loader import EMBEDDED, TOKENIZED
    from boost_titan.data.local_text import LOCAL_DATASETS

    # by name, nothing loaded: a parse-time check must not open the Hub (c4 raised
    # ConnectionError here) or a dataset's files (a missing c4_test was a FileNotFoundError
    # that did not say why FT refuses it)
    if config.training.dataset not in (TOKENIZED, *EMBEDDED, *LOCAL_DATASETS):
        raise bad(
            "training",
            "dataset",
            config.training.dataset,
            "with [fault_tolerance]: replica groups need boost_titan's global data order "
            "(a recovered group continues at the live groups' position), which torchtitan's "
            "datasets do not have; use a tokenized corpus, your own text (local_text) or "
            "the embedded corpus (docs/training.md#data)",
        )
    if world_size is not None:
        check_lighthouse(os.environ.get(LIGHTHOUSE_ENV))


def check_lighthouse(address: str | None) -> None:
    """The lighthouse answers within :data:`CONNECT_TIMEOUT_S` (a launch never hangs on
    an address that leads nowhere)."""
    if not address:
        raise ConfigError(
            f"[fault_tolerance] enable = true needs the lighthouse's address in "
            f"{LIGHTHOUSE_ENV} (e.g. http://host:29510); start one with "
            "`boost-titan replicas` or `torchft_lighthouse --min_replicas 1` "
            "(docs/fault-tolerance.md)"
        )
    parts = urlsplit(address if "://" in address else f"http://{address}")
    try:
        host, port = parts.hostname, parts.port
    except ValueError:
        host = port = None
    if not host or not port:
        raise ConfigError(
            f"{LIGHTHOUSE_ENV} = {address!r} is not an address: give http://HOST:PORT"
        )
    try:
        socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(
            f"{LIGHTHOUSE_ENV} = {address!r}: no lighthouse answers there within "
            f"{CONNECT_TIMEOUT_S:g} s ({e.strerror or e}); start it first "
            "(`torchft_lighthouse --min_replicas 1 --bind [::]:PORT`)"
        ) from None
