"""``python -m boost_titan.gpu_check``: see :mod:`boost_titan.gpu_check.cli`."""

from boost_titan.gpu_check.cli import main

if __name__ == "__main__":
    main()
