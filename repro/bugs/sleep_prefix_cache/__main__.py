"""`python -m repro.bugs.sleep_prefix_cache [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("sleep_prefix_cache")
