"""`python -m repro.bugs.pad_slot_negative_index [matrix options]`: fixed and buggy side by
side."""

from repro.cli import run_alone

run_alone("pad_slot_negative_index")
