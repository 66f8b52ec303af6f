"""`python -m repro.bugs.spec_capture_state [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("spec_capture_state")
