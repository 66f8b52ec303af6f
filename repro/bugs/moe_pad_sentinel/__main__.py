"""`python -m repro.bugs.moe_pad_sentinel [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("moe_pad_sentinel")
