"""Scenarios of spec_prewarm_captured_state (#46523 on #44253's design, fixed as #48261 does):
each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

from harness.record import Context
from repro.bugs.lazy_attn_state.scenarios import draft_decode_steps


def speculator_prewarm(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture of the target (FULL decode graphs of 4 and 8 requests, each
    prewarmed eagerly on a disposable state, then captured on a fresh one whose planner the
    graph records), then the draft attention's graphs through the same capture order: warm-up,
    prewarm of the capture path, capture; then decode steps: the draft's replay vs its eager
    step vs the float64 split-KV reference.

    Fixed: the draft warms up on the target's warm-up state, prewarms on a disposable state
    (planned by that run) and captures on the target's captured state, which the target's
    replay plans: all match. Buggy: the prewarm (a warmup=False call, run eagerly) runs on the
    target's captured state; its plan was allocated inside the target's capture and never
    computed (poison), so the split-KV kernel walks a request range starting at int32 max:
    illegal address during capture_model.
    """
    return draft_decode_steps(ctx)
