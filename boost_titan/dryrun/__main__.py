import sys

from boost_titan.dryrun.cli import main

sys.exit(main())
