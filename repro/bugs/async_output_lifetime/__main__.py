"""`python -m repro.bugs.async_output_lifetime [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("async_output_lifetime")
