"""Fix-site mutants of async_output_lifetime: references that do not keep the device memory."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.ASYNC_OUTPUT_KEEP_REF
FILE = "harness/runner/async_output.py"
GUARD = "        if Fix.ASYNC_OUTPUT_KEEP_REF in fixes:\n"
KEEP = "            self.sampled = sampled\n"

MUTANTS = (
    Mutant(
        "keep_a_clone",
        PART,
        "unused_state",
        FILE,
        KEEP,
        "            self.sampled = sampled.clone()\n",
        "a clone is kept alive; the memory the download reads is free",
    ),
    Mutant(
        "detach_for_a_reference",
        PART,
        "unused_state",
        FILE,
        KEEP,
        "            self.sampled = sampled.detach()\n",
        "detach() makes a new tensor on the same memory: the arena's tensor still dies",
    ),
    Mutant(
        "keep_the_host_rows",
        PART,
        "wrong_row",
        FILE,
        KEEP,
        "            self.sampled = self.host\n",
        "the download's destination is kept, not its source",
    ),
    Mutant(
        "weak_reference",
        PART,
        "unused_state",
        FILE,
        KEEP,
        "            self.sampled = weakref.ref(sampled)\n",
        "a weak reference does not keep the tensor alive",
    ),
    Mutant(
        "keep_for_larger_steps_only",
        PART,
        "boundary",
        FILE,
        GUARD,
        GUARD.replace(":\n", " and rows > 2:\n"),
        "only steps of more than two requests keep their tokens' memory",
    ),
    Mutant(
        "keep_contiguous",
        PART,
        "unused_state",
        FILE,
        KEEP,
        "            self.sampled = sampled.contiguous()\n",
        "contiguous() of a contiguous tensor is the tensor itself",
        equivalent="the slot's row is contiguous: the same tensor object is kept",
    ),
)
