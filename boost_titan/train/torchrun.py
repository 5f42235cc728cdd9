"""torchrun (``torch.distributed.run``), less its failure report when the ranks already
said why they stopped, in one line.

A refusal the ranks explain themselves (a damaged or refused checkpoint, a data position
that cannot be resumed, a failed save, a folder another run holds: ``trainer.main``)
ends every rank with exit 1 and its line in the log; local rank 0 also writes it to
``BOOST_TITAN_STATUS_FILE`` (:func:`fault.report_failure`), which ``run_train.sh``
repeats last. torchrun then adds its own traceback and a failure table that names the
exit code only (~35 lines after a one-line data-position refusal on 2 ranks): left out
here. Any other failure (a crash, a signal, a bug's traceback) gets torchrun's report
as it always does."""

from __future__ import annotations

import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from boost_titan.train.fault import explained_failure


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except ChildFailedError as e:
        if explained_failure() is None:
            raise
        _rank, failure = e.get_first_failure()
        raise SystemExit(failure.exitcode if failure.exitcode > 0 else 1) from None


if __name__ == "__main__":
    main()
