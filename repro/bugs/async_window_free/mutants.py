"""Fix-site mutants of async_window_free: regressions of the free boundary under a scheduler
one step ahead, as a refactor of the scheduler or of remove_skipped_blocks could make them."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.ASYNC_WINDOW_FREE_PROCESSED
SCHED = "harness/runner/async_scheduler.py"
SETTLE = "computed -= req.num_in_flight_tokens"

MUTANTS = (
    Mutant(
        "in_flight_added",
        PART,
        "boundary",
        SCHED,
        SETTLE,
        "computed += req.num_in_flight_tokens",
        "the sign turned: the boundary runs further ahead of the optimistic count",
    ),
    Mutant(
        "in_flight_steps_not_tokens",
        PART,
        "partial",
        SCHED,
        SETTLE,
        "computed -= req.num_in_flight_steps",
        "subtracts the steps in flight (1), not their tokens (the sampled token and the drafts)",
    ),
    Mutant(
        "free_on_the_step_end",
        PART,
        "wrong_row",
        SCHED,
        "self.kv.remove_skipped_blocks(row, computed)",
        "self.kv.remove_skipped_blocks(row, self._end(req))",
        "frees on the end of the step being scheduled: further ahead still",
    ),
    Mutant(
        "free_before_settling",
        PART,
        "ordering",
        SCHED,
        "            computed = req.num_computed_tokens\n",
        "            computed = req.num_computed_tokens\n"
        "            self.kv.remove_skipped_blocks(row, computed)\n",
        "a free on the optimistic count before the settled one (a second call site left behind)",
    ),
    Mutant(
        "in_flight_cleared_on_output",
        PART,
        "unused_state",
        SCHED,
        "req.num_in_flight_tokens -= len(s.token_ids)",
        "req.num_in_flight_tokens = 0",
        "the counter is cleared when any step's output arrives: the step still in flight is "
        "forgotten, so the settled count is the optimistic one",
    ),
    Mutant(
        "drafts_counted_as_computed",
        PART,
        "partial",
        SCHED,
        SETTLE,
        "computed -= req.num_in_flight_tokens - self.num_spec_tokens",
        "only the in-flight sampled token is settled; its drafts count as computed, as if "
        "every draft were accepted",
    ),
)
