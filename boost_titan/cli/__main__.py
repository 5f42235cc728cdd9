"""``python -m boost_titan.cli <command>``: ``boost-titan`` where the script is not on PATH."""

from boost_titan.cli.main import console_script

console_script()
