"""Fix-site mutants of spec_prewarm_captured_state: the speculator's eager prewarm put on the
target's captured state again, for some descriptors, or on a copy that shares its plan."""

from __future__ import annotations

from harness.record import Mutant
from repro.bugs.spec_prewarm_captured_state import PART

FLASHMLA = "harness/runner/flashmla.py"
EAGER = "                eager = not self.launch.capturing"
CONDITION = (
    "                if not warmup and eager and Fix.SPEC_DISPOSABLE_PREWARM_STATE in self.fixes:"
)
DISPOSABLE = "                    run_on = FlashMLASchedMeta()"

MUTANTS = (
    Mutant(
        "disposable_state_for_the_warmup_call",
        PART,
        "wrong_row",
        FLASHMLA,
        CONDITION,
        CONDITION.replace("not warmup", "warmup"),
        "the warm-up call (already on the target's warm-up state) gets the disposable state; "
        "the prewarm keeps the captured one",
    ),
    Mutant(
        "disposable_state_at_capture_instead",
        PART,
        "ordering",
        FLASHMLA,
        EAGER,
        EAGER.replace("not ", ""),
        "the capture runs on a disposable state and the eager prewarm on the captured one",
    ),
    Mutant(
        "disposable_state_made_but_unused",
        PART,
        "unused_state",
        FLASHMLA,
        "                return self.forward(run_on, inputs(desc))",
        "                return self.forward(state, inputs(desc))",
        "a disposable state is picked for the prewarm, the forward runs on the captured one",
    ),
    Mutant(
        "disposable_for_the_largest_size_only",
        PART,
        "partial",
        FLASHMLA,
        CONDITION,
        CONDITION[:-1] + " and desc.num_tokens == max(\n"
        "                    d.num_tokens for d in target_states\n"
        "                ):",
        "only the largest decode graph's prewarm gets a disposable state",
    ),
    Mutant(
        "disposable_state_shares_the_plan",
        PART,
        "partial",
        FLASHMLA,
        DISPOSABLE,
        "                    run_on = FlashMLASchedMeta(state.tile_scheduler_metadata, "
        "state.num_splits)",
        "a new state object for the prewarm that shares the captured state's plan tensors (a "
        "shallow copy), not an empty one",
    ),
    Mutant(
        "fresh_state_for_the_capture_too",
        PART,
        "ordering",
        FLASHMLA,
        EAGER,
        "                eager = True",
        "every warmup=False pass gets a fresh state, the capture's too (#48261's own mechanism)",
        equivalent="the draft's graph then records a planner of its own, which reads the live "
        "lengths at replay: correct on the fixed runner (only lazy_attn_state's captured-state "
        "consumer, with #42444's fix off, tells it from reading the target's plan)",
    ),
    Mutant(
        "prewarm_on_the_target_warmup_state",
        PART,
        "wrong_row",
        FLASHMLA,
        DISPOSABLE,
        "                    run_on = warmup_state",
        "the prewarm runs on the target's warm-up state instead of a disposable one",
        equivalent="that state was planned eagerly for the same dummy lengths (the draft's "
        "warm-up ran on it): its plan is computed, so the prewarm reads valid memory",
    ),
)
