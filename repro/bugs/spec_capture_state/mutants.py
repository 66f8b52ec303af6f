"""Fix-site mutants of spec_capture_state: the speculator's warm-up state, partly or wrongly
separated from its capture state."""

from __future__ import annotations

from harness.record import Mutant
from repro.bugs.spec_capture_state import PART

FLASHMLA, GRAPHS = "harness/runner/flashmla.py", "harness/runner/cudagraph.py"
CONDITION = "            if warmup and Fix.SPEC_SEPARATE_WARMUP_STATE in self.fixes:"

MUTANTS = (
    Mutant(
        "pair_unpacked_in_the_wrong_order",
        PART,
        "wrong_row",
        FLASHMLA,
        "            warmup_state, captured_state = target_states[desc]",
        "            captured_state, warmup_state = target_states[desc]",
        "the (warm-up, captured) pair read the other way round",
    ),
    Mutant(
        "separated_at_capture_instead",
        PART,
        "ordering",
        FLASHMLA,
        CONDITION,
        "            if not warmup and Fix.SPEC_SEPARATE_WARMUP_STATE in self.fixes:",
        "the warm-up runs on the captured state and the capture on the warm-up one",
    ),
    Mutant(
        "separated_for_the_largest_size_only",
        PART,
        "partial",
        FLASHMLA,
        CONDITION,
        CONDITION[:-1] + " and desc.num_tokens == max(\n"
        "                d.num_tokens for d in target_states\n"
        "            ):",
        "only the largest decode graph's warm-up gets the warm-up state",
    ),
    Mutant(
        "forward_runs_on_the_captured_state",
        PART,
        "unused_state",
        FLASHMLA,
        "                run_on = state",
        "                run_on = captured_state",
        "the warm-up state is picked and returned, but the forward runs on the captured one",
    ),
    Mutant(
        "target_keeps_the_captured_state_as_warmup",
        PART,
        "ordering",
        GRAPHS,
        "        self.warmup_attn_states[desc] = warmup_state",
        "        self.warmup_attn_states[desc] = attn_state",
        "the target records its warm-up state after the fresh one replaced it",
    ),
)
