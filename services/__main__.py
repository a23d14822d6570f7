"""`python -m rlfabric ...` is the `rlfabric` command."""

from rlfabric.cli import main

main()
