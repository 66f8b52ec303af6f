"""`python -m repro.bugs.graph_output_alias [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("graph_output_alias")
