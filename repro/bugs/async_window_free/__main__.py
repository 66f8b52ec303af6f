"""`python -m repro.bugs.async_window_free [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("async_window_free")
