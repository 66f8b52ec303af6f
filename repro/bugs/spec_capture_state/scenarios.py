"""Scenarios of spec_capture_state (vLLM #44253): each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.record import Context
from repro.bugs.lazy_attn_state.scenarios import draft_decode_steps


def speculator_capture(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture of the target (FULL decode graphs of 4 and 8 requests, each
    captured with a fresh attention state whose planner the graph records), then the draft
    attention's graphs on the target's states; then decode steps: the draft's replay vs its
    eager step vs the float64 split-KV reference.

    Fixed: the draft warms up on the target's warm-up state (planned eagerly, for the dummy
    lengths) and captures on the captured one, which the target's replay plans: all match.
    Buggy: the draft's warm-up runs on the captured state too; its plan was allocated inside
    the target's capture and never computed (poison), so the split-KV kernel walks a request
    range starting at int32 max: illegal address during capture_model.
    """
    return draft_decode_steps(ctx)
