"""Scenarios of capture_first_call (vLLM #46523): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.record import Context
from harness.runner.cudagraph import CUDAGraphMode
from repro.bugs.lazy_attn_state.scenarios import decode_steps, lora_case_decode_graphs


def full_decode_capture(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture (FULL decode graphs of 4 and 8 requests), then decode steps:
    replay vs the dense float64 reference (and vs an eager step where they differ).

    Each path tunes on its first call per size (host syncs). Fixed: after the eager warm-up,
    a capture-compatible function (warmup=False) runs once eagerly on a disposable state, so
    the capture path's tuning is done when a second one is captured: captures and replays
    match. Buggy: the capture path's first call is the capture: its tuning synchronises while
    the stream captures: the driver (CPU: the graph emulation) refuses: an exception at
    capture_model.
    """
    return decode_steps(ctx, CUDAGraphMode.FULL_AND_PIECEWISE)


def piecewise_capture(ctx: Context) -> str:
    """The same steps under PIECEWISE capture only: the function captured is the warm-up's,
    whose path the warm-up tuned. Buggy and fixed pass: the hazard is the FULL capture's
    alone."""
    return decode_steps(ctx, CUDAGraphMode.PIECEWISE)


def pure_full_capture(ctx: Context) -> str:
    """FULL capture alone (no PIECEWISE graphs: one FULL graph per size serves every batch),
    then the same decode steps. Fixed: prewarmed, captures and replays match. Buggy: as in
    FULL_AND_PIECEWISE, the first call of the FULL path is the capture: its tuning's host sync
    is refused: an exception at capture_model."""
    return decode_steps(ctx, CUDAGraphMode.FULL)


def lora_case_capture(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture with LoRA specialised by active-adapter count: a FULL decode
    graph per LoRA capture case (1, 2, 3), each prewarmed before its capture; then decode steps
    in every case. Fixed: captures and replays match. Buggy: the capture path's first call for
    each size is the capture of the first LoRA case: an exception at capture_model. A prewarm
    that skips specialised descriptors (num_active_loras set) fails the same way."""
    return lora_case_decode_graphs(ctx)
