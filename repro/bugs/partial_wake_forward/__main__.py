"""`python -m repro.bugs.partial_wake_forward [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("partial_wake_forward")
