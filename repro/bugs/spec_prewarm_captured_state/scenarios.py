"""Scenarios of spec_prewarm_captured_state (#46523 on #44253's design, fixed as #48261 does):
each function's docstring is its bug report.

The record (fix parts, expected outcomes) is in the package; see its docstring.
"""

from __future__ import annotations

import torch

from harness.oracle import mismatch
from harness.record import Context
from harness.runner.flashmla import DraftInputs, FlashMLASchedMeta
from harness.runner.model_runner import ModelRunner
from kernels.split_kv_attention import plan_reference
from repro.bugs.lazy_attn_state.scenarios import draft_decode_steps


def speculator_prewarm(ctx: Context) -> str:
    """FULL_AND_PIECEWISE capture of the target (FULL decode graphs of 4 and 8 requests, each
    prewarmed eagerly on a disposable state, then captured on a fresh one whose planner the
    graph records), then the draft attention's graphs through the same capture order: warm-up,
    prewarm of the capture path, capture (the 8-request graph first, then the 4-request one);
    then decode steps: the draft's replay vs its eager step vs the float64 split-KV reference.
    After every eager run of the draft (its warm-ups and prewarms of both sizes, the eager
    steps): the plan it ran on vs the plan of that run's own lengths (the planner's reference):
    the split kernel walks the plan's request range, and a plan is valid only for the lengths
    it was made from.

    Fixed: the draft warms up on the target's warm-up state (planned for the same dummy
    lengths), prewarms each size on a disposable state of its own (planned by that run) and
    captures on the target's captured state, which the target's replay plans: all match.
    Buggy: the prewarm (a warmup=False call, run eagerly) runs on the target's captured state;
    its plan was allocated inside the target's capture and never computed (poison), so the
    split-KV kernel walks a request range starting at int32 max: illegal address during
    capture_model. A prewarm on a computed plan of another size (the 8-request plan for the
    4-request batch, whose first rows it still computes right) reads the query and writes the
    partial outputs past the batch's rows: nothing checks that memory, its outputs are thrown
    away, and it need not fault; after the run, its plan is not its lengths': a wrong result
    (on the CPU the interpreter may crash first on the heap it overwrote).
    """
    return draft_decode_steps(ctx, watch=check_eager_plans) + "; eager plans their own"


def check_eager_plans(runner: ModelRunner) -> list[str | None]:
    """Wraps the draft attention's forward: after each eager run, the plan of the state it ran
    on vs plan_reference of the run's live lengths, as problems appended to the list returned
    (runs inside a capture are recorded, not run: their plan is the replay's)."""
    draft, problems, runs = runner.draft, [], []
    forward = draft.forward

    def checked(state: FlashMLASchedMeta, x: DraftInputs) -> torch.Tensor:
        out = forward(state, x)
        if draft.launch.capturing:
            return out
        lens = x.seq_lens.tolist()
        runs.append(lens)
        rows, splits = plan_reference(lens, draft.backend.num_parts)
        label = f"eager draft run {len(runs)} ({len(lens)} requests, lengths {lens})"
        problems.extend(
            (
                mismatch(
                    f"{label}: the plan it ran on",
                    state.tile_scheduler_metadata,
                    torch.tensor(rows, dtype=torch.int32),
                ),
                mismatch(
                    f"{label}: the splits it ran on",
                    state.num_splits,
                    torch.tensor(splits, dtype=torch.int32),
                ),
            )
        )
        return out

    draft.forward = checked
    return problems
