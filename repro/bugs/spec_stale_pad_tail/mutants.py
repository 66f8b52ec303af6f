"""Fix-site mutants of spec_stale_pad_tail: regressions of the last_token_indices padding a
refactor of the speculator's input preparation could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.SPEC_PAD_LAST_TOKEN_INDICES
SPEC, RUNNER = "harness/runner/speculator.py", "harness/runner/model_runner.py"
PAD = "self.last_token_indices[r:].zero_()"

MUTANTS = (
    Mutant(
        "pad_from_one_past",
        PART,
        "boundary",
        SPEC,
        PAD,
        "self.last_token_indices[r + 1 :].zero_()",
        "the padding starts one entry late: the first padded request keeps a stale index",
    ),
    Mutant(
        "pad_one_entry",
        PART,
        "partial",
        SPEC,
        PAD,
        "self.last_token_indices[r : r + 1].zero_()",
        "only the first entry past the live requests is padded; a graph of more padded "
        "requests reads the rest",
    ),
    Mutant(
        "pad_with_minus_one",
        PART,
        "boundary",
        SPEC,
        PAD,
        "self.last_token_indices[r:].fill_(-1)",
        "padded with the padding sentinel -1 (PADDING_SLOT_ID's habit): an index the gather "
        "refuses, where a slot mapping's consumer would skip it",
    ),
    Mutant(
        "pad_a_copy",
        PART,
        "unused_state",
        SPEC,
        PAD,
        "self.last_token_indices.clone()[r:].zero_()",
        "the padding is written into a copy; the graph gathers through the buffer",
    ),
    Mutant(
        "pad_the_live_entries",
        PART,
        "wrong_row",
        SPEC,
        PAD,
        "self.last_token_indices[:r].zero_()",
        "the live requests' entries are zeroed instead of the tail's",
    ),
    Mutant(
        "prepare_only_for_eager_steps",
        PART,
        "ordering",
        RUNNER,
        "        if self.speculator is not None:\n            self.speculator.prepare(batch)\n",
        "        if self.speculator is not None and desc is None:\n"
        "            self.speculator.prepare(batch)\n",
        "the indices are prepared for eager steps only: a replay gathers the previous step's",
    ),
)
