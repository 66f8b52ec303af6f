"""`python -m repro.bugs.async_placeholder_leak [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("async_placeholder_leak")
