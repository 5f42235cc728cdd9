"""``python -m boost_titan.bench``: see :mod:`boost_titan.bench.cli`."""

from boost_titan.bench.cli import main

if __name__ == "__main__":
    main()
