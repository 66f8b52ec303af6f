"""`python -m repro.bugs.spec_stale_pad_tail [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("spec_stale_pad_tail")
