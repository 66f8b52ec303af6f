"""`python -m repro.bugs.kv_block_stale_nan [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("kv_block_stale_nan")
