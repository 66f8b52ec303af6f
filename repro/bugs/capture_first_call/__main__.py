"""`python -m repro.bugs.capture_first_call [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("capture_first_call")
