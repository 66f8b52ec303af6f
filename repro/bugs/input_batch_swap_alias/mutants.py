"""Fix-site mutants of input_batch_swap_alias: regressions of the mask rows' swap that a
refactor of swap_states, or of the reorder that calls it, could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.INPUT_BATCH_SWAP_COPY
BATCH, RUNNER = "harness/runner/input_batch.py", "harness/runner/model_runner.py"
SWAP = "mask[[i1, i2]] = mask[[i2, i1]]"

MUTANTS = (
    Mutant(
        "clone_the_first_row_only",
        PART,
        "partial",
        BATCH,
        SWAP,
        "mask[i1], mask[i2] = mask[i2].clone(), mask[i1]",
        "a copy of the row written first, not of the row read last: row i2 is still written "
        "from the view of row i1 after row i1 was overwritten",
    ),
    Mutant(
        "copy_one_way",
        PART,
        "partial",
        BATCH,
        SWAP,
        "mask[i1] = mask[i2].clone()",
        "half a swap: row i1 takes row i2's mask, row i2 keeps its own",
    ),
    Mutant(
        "same_rows_back",
        PART,
        "wrong_row",
        BATCH,
        SWAP,
        "mask[[i1, i2]] = mask[[i1, i2]]",
        "the right-hand side in the left-hand side's order: a copy that swaps nothing",
    ),
    Mutant(
        "second_row_twice",
        PART,
        "wrong_row",
        BATCH,
        SWAP,
        "mask[[i1, i2]] = mask[[i2, i2]]",
        "both rows from row i2: what the aliasing swap leaves, written on purpose",
    ),
    Mutant(
        "swap_into_a_copy",
        PART,
        "unused_state",
        BATCH,
        "        mask = self.mask_cpu\n",
        "        mask = self.mask_cpu.clone()\n",
        "the swap goes to a temporary copy of the mask (a refactor that makes it contiguous "
        "first): the sampler reads rows nothing swapped",
    ),
    Mutant(
        "mask_not_reordered",
        PART,
        "ordering",
        RUNNER,
        "            self.sampling.swap_states(i, j)\n",
        "",
        "the reorder moves the requests and their KV-cache rows but not their sampling state: "
        "each mask row stays behind, with the request that came into its row",
    ),
)
