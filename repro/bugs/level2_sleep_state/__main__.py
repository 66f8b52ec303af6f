"""`python -m repro.bugs.level2_sleep_state [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("level2_sleep_state")
