"""`python -m repro.bugs.lazy_attn_state [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("lazy_attn_state")
