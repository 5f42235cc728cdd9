"""A command's peak resident memory, printed at its end (``checkpoint from-dense``,
``checkpoint export``): one reading, so the figures compare."""

from __future__ import annotations

import resource


def peak_rss_gib() -> float:
    """This process' peak resident memory in GiB: ``VmHWM`` (reset by exec;
    ``getrusage``'s ``ru_maxrss`` carries over the peak of the parent a process was
    forked from, e.g. the test suite's fork server)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
