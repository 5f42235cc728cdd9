"""argparse for the commands of ``boost_titan.cli``: a usage error is one line.

The parser and the refusal line are ``boost_titan.config``'s (``Parser``, ``refuse``),
shared by every command, those of the folders below too. argparse's own ``error`` prints
the whole usage (13 lines for ``checkpoint from-dense``) before the message; here it is
the message alone, naming the option and the bad value, then where the usage is:

    boost-titan checkpoint export: error: the following arguments are required: --to
        (boost-titan checkpoint export --help)

(one line on the terminal) and exit status 2, as argparse's. ``--help`` is argparse's.
"""

from __future__ import annotations

from boost_titan.config import USAGE_ERROR_EXIT, Parser
from boost_titan.config import refuse as fail

__all__ = ["USAGE_ERROR_EXIT", "Parser", "fail"]
