"""The flight recorder's folder, ``<dump_folder>/<[comm] save_traces_folder>``, is kept
only when something was written to it.

torchtitan turns the flight recorder on by default (``[comm] trace_buf_size`` > 0) and
creates that folder (``comm_traces/``) when it starts the process group, so that NCCL can
dump its recorded collectives there if one times out. Most runs never time out and end
with an empty folder; :func:`remove_if_empty` removes it after a clean end. The recorder
itself stays as configured: a run that hangs keeps the folder and its dumps.
"""

from __future__ import annotations

import errno
import os


def folder(job_config) -> str | None:
    """The flight recorder's dump folder of this config, or None when it is off (torchtitan
    then creates none)."""
    if job_config.comm.trace_buf_size <= 0:
        return None
    return os.path.join(job_config.job.dump_folder, job_config.comm.save_traces_folder)


def remove_if_empty(job_config) -> None:
    """Remove the flight recorder's folder if nothing was dumped into it. Call after every
    rank has passed its last collective (the end-of-training barrier), so no timeout dump
    can still arrive; every rank may call it (``rmdir`` removes only an empty folder)."""
    path = folder(job_config)
    if path is None:
        return
    try:
        os.rmdir(path)
    except FileNotFoundError:  # another rank (or node, on a shared file system) removed it
        pass
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):  # dumps are kept
            raise
