"""`python -m repro.bugs.kernel_block_size [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("kernel_block_size")
