"""`python -m repro.bugs.moe_lora_consumer_grid [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("moe_lora_consumer_grid")
