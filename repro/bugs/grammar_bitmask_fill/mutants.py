"""Fix-site mutants of grammar_bitmask_fill: regressions of the mask's neutral rows, of the rows
scattered into it, and of what the scatter and the apply kernel rely on."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

FILL, COUNT = Fix.GRAMMAR_NEUTRAL_FILL, Fix.GRAMMAR_GUIDED_ROW_COUNT
WORKER, KERNEL = "harness/runner/structured_output.py", "kernels/grammar_bitmask.py"

MUTANTS = (
    Mutant(
        "fill_bit_31_clear",
        FILL,
        "boundary",
        WORKER,
        "mask.fill_(NEUTRAL)",
        "mask.fill_(0x7FFFFFFF)",
        "the neutral word without its sign bit: tokens 31 and 63 forbidden in free rows",
    ),
    Mutant(
        "fill_first_row_only",
        FILL,
        "partial",
        WORKER,
        "mask.fill_(NEUTRAL)",
        "mask[:1].fill_(NEUTRAL)",
        "only the first row made neutral: a free row later in the batch forbids every token",
    ),
    Mutant(
        "fill_the_guided_rows",
        FILL,
        "wrong_row",
        WORKER,
        "mask.fill_(NEUTRAL)",
        "mask[: len(grammar.req_ids)].fill_(NEUTRAL)",
        "as many rows made neutral as there are guided requests, from the top: the free rows "
        "past them keep zeros",
    ),
    Mutant(
        "fill_after_scatter",
        FILL,
        "ordering",
        WORKER,
        "        for i in range(count):\n            mask[self.batch_rows[i]] = "
        "self.sched_rows[i]\n",
        "        for i in range(count):\n            mask[self.batch_rows[i]] = "
        "self.sched_rows[i]\n        if Fix.GRAMMAR_NEUTRAL_FILL in self.fixes:\n"
        "            mask.fill_(NEUTRAL)\n",
        "the neutral fill also after the scatter: every guided row unconstrained",
    ),
    Mutant(
        "fill_the_device_mask_only",
        FILL,
        "unused_state",
        WORKER,
        "mask.fill_(NEUTRAL)",
        "self.mask.fill_(NEUTRAL)",
        "the device mask made neutral, then overwritten by the host mask's zero rows",
    ),
    Mutant(
        "count_one_past",
        COUNT,
        "boundary",
        WORKER,
        "count = num_guided",
        "count = min(num_guided + 1, mask.shape[0])",
        "one row past the scheduler's: a stale staging row (zeros) copied to a stale batch row",
    ),
    Mutant(
        "count_one_short",
        COUNT,
        "boundary",
        WORKER,
        "count = num_guided",
        "count = num_guided - 1",
        "the last guided row in the scheduler's order never scattered: it stays neutral",
    ),
    Mutant(
        "rows_in_scheduler_order",
        COUNT,
        "wrong_row",
        WORKER,
        "torch.tensor([row_of[r] for r in grammar.req_ids])",
        "torch.tensor(sorted(row_of[r] for r in grammar.req_ids))",
        "the batch rows sorted while the scheduler's rows are not: each guided request gets "
        "another's grammar",
    ),
    Mutant(
        "stale_rows_kept",
        COUNT,
        "unused_state",
        WORKER,
        "self.sched_rows[:num_guided] = grammar.bitmask",
        "self.sched_rows[:num_guided] = self.sched_rows[:num_guided]",
        "the scheduler's rows never staged: the staging buffer's old rows (zeros) scattered",
    ),
    Mutant(
        "count_from_the_scheduler_buffer",
        COUNT,
        "partial",
        WORKER,
        "count = num_guided",
        "count = len(self.sched_rows)",
        "the count from the staging buffer's length (max_num_reqs): past the batch's rows",
    ),
    Mutant(
        "kernel_bit_order_reversed",
        COUNT,
        "boundary",
        KERNEL,
        "allowed = ((words >> (offs % 32)) & 1) != 0",
        "allowed = ((words >> (31 - offs % 32)) & 1) != 0",
        "the apply kernel reads each word's bits from the top: a guided row's grammar mirrored",
    ),
)
