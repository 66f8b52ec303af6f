"""`python -m repro.bugs.input_batch_swap_alias [matrix options]`: fixed and buggy side by
side."""

from repro.cli import run_alone

run_alone("input_batch_swap_alias")
