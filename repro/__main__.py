"""`python -m repro`: the repro command."""

from repro.cli import main

main()
