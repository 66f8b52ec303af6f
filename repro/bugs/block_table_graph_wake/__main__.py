"""`python -m repro.bugs.block_table_graph_wake [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("block_table_graph_wake")
