"""`python -m repro.bugs.lora_dummy_run [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("lora_dummy_run")
