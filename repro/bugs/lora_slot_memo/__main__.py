"""`python -m repro.bugs.lora_slot_memo [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("lora_slot_memo")
