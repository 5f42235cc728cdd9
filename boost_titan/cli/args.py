"""argparse for the commands of :mod:`boost_titan.cli`: a usage error is one line.

argparse's own ``error`` prints the whole usage (13 lines for ``checkpoint from-dense``)
before the message; here it is the message alone, naming the option and the bad value,
then where the usage is::

    boost-titan checkpoint export: error: the following arguments are required: --to
        (boost-titan checkpoint export --help)

(one line on the terminal) and exit status 2, as argparse's. ``--help`` is argparse's.
"""

from __future__ import annotations

import argparse
import sys

USAGE_ERROR_EXIT = 2  # argparse's


class Parser(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        self.exit(USAGE_ERROR_EXIT, f"{self.prog}: error: {message} ({self.prog} --help)\n")


def fail(prog: str, message: str, code: int = USAGE_ERROR_EXIT):
    """One line on stderr, then exit ``code`` (a SystemExit: no traceback)."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(code)
