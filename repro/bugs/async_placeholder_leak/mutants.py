"""Fix-site mutants of async_placeholder_leak: regressions of the worker's placeholder fill for
requests with no previous-step row, as a refactor of TokenRows.prepare could make them."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.ASYNC_PLACEHOLDER_HOST_FILL
INPUTS = "harness/runner/async_inputs.py"
GUARD = "if prev < 0 and Fix.ASYNC_PLACEHOLDER_HOST_FILL"
FILL = "row[s.start : end] = s.token_ids"

MUTANTS = (
    Mutant(
        "rows_with_a_previous_row",
        PART,
        "boundary",
        INPUTS,
        GUARD,
        "if prev > 0 and Fix.ASYNC_PLACEHOLDER_HOST_FILL",
        "the guard's sign turned: requests the device fills take the host's tokens, a request "
        "with no previous row keeps its placeholders",
    ),
    Mutant(
        "skipped_rows_only",
        PART,
        "partial",
        INPUTS,
        GUARD,
        "if prev < 0 and s.start > 0 and Fix.ASYNC_PLACEHOLDER_HOST_FILL",
        "only a request that continues (skipped by the budget) is filled; one that prefills "
        "again from position 0 after a preemption keeps its placeholders",
    ),
    Mutant(
        "last_token_only",
        PART,
        "partial",
        INPUTS,
        FILL,
        "row[end - 1 : end] = s.token_ids[-1:]",
        "the host fills the last scheduled token (what a decode needs); a resumed prefill's "
        "earlier sampled tokens stay -1",
    ),
    Mutant(
        "all_but_the_last",
        PART,
        "boundary",
        INPUTS,
        FILL,
        "row[s.start : end - 1] = s.token_ids[:-1]",
        "one position short: the last scheduled token keeps its placeholder",
    ),
    Mutant(
        "fill_a_slice_copy",
        PART,
        "unused_state",
        INPUTS,
        FILL,
        "row[s.start : end][:] = s.token_ids",
        "the host's tokens go into a copy (a list slice), not into the row the inputs are read "
        "from",
    ),
    Mutant(
        "previous_rows_never_reset",
        PART,
        "ordering",
        INPUTS,
        "self.prev_rows = {s.req_id: r for r, s in enumerate(step)}",
        "self.prev_rows |= {s.req_id: r for r, s in enumerate(step)}",
        "the previous-step rows accumulate across steps: a resumed request still has the row "
        "it held before its preemption, so the fix is skipped and the device gathers a row the "
        "last step did not have",
    ),
)
