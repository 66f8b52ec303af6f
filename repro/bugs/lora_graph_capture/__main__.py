"""`python -m repro.bugs.lora_graph_capture [matrix options]`: fixed and buggy side by side."""

from repro.cli import run_alone

run_alone("lora_graph_capture")
