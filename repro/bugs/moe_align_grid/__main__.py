"""`python -m repro.bugs.moe_align_grid [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("moe_align_grid")
