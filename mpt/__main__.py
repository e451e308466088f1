"""`python -m mpt` is the `mpt` command."""

from mpt.cli import main

main()
