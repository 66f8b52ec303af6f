"""`python -m repro.bugs.async_pinned_race [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("async_pinned_race")
