"""Fix-site mutants of capture_first_call: the prewarm of the wrong path, for some descriptors
only, never called, or on the capture's own state."""

from __future__ import annotations

from harness.record import Mutant
from repro.bugs.capture_first_call import PART
from repro.bugs.lazy_attn_state.mutants import FRESH, GRAPHS

CONDITION = "        if desc.cg_mode == CUDAGraphMode.FULL and Fix.CAPTURE_PREWARM in self.fixes:"
CALL = (
    "            create_forward_fn(desc, warmup=False)[0](CUDAGraphMode.NONE)  # a disposable state"
)

MUTANTS = (
    Mutant(
        "prewarm_of_the_eager_path",
        PART,
        "wrong_row",
        GRAPHS,
        CALL,
        CALL.replace("warmup=False", "warmup=True"),
        "the prewarm runs a warm-up function again (the eager path, tuned at warm-up), not "
        "the capture-compatible one",
    ),
    Mutant(
        "prewarm_for_piecewise_instead",
        PART,
        "wrong_row",
        GRAPHS,
        CONDITION,
        CONDITION.replace("CUDAGraphMode.FULL", "CUDAGraphMode.PIECEWISE"),
        "the PIECEWISE descriptors are prewarmed, the FULL ones are not",
    ),
    Mutant(
        "prewarm_for_the_largest_size_only",
        PART,
        "partial",
        GRAPHS,
        CONDITION,
        "        if (\n"
        "            desc.cg_mode == CUDAGraphMode.FULL\n"
        "            and Fix.CAPTURE_PREWARM in self.fixes\n"
        "            and not any(d.cg_mode == desc.cg_mode for d in self.graphs)\n"
        "        ):",
        "only the first (largest) FULL descriptor is prewarmed (tuning is per shape)",
    ),
    Mutant(
        "prewarm_skips_uniform_decode",
        PART,
        "partial",
        GRAPHS,
        CONDITION,
        CONDITION[:-1] + " and not desc.uniform_decode:",
        "the FULL decode graphs (uniform decode) are left out of the prewarm",
    ),
    Mutant(
        "prewarm_function_never_called",
        PART,
        "unused_state",
        GRAPHS,
        CALL,
        "            create_forward_fn(desc, warmup=False)  # a disposable state, made and dropped",
        "the disposable forward function is made but not run",
    ),
    Mutant(
        "prewarm_on_the_capture_state",
        PART,
        "ordering",
        GRAPHS,
        FRESH,
        FRESH + "\n            forward_fn(CUDAGraphMode.NONE)",
        "an extra eager run on the fresh capture state: it plans there, so the graph lacks "
        "the planner (the order #46523 avoids: disposable state first, fresh state after)",
    ),
    Mutant(
        "prewarm_uniform_decode_only",
        PART,
        "partial",
        GRAPHS,
        CONDITION,
        CONDITION.replace("Fix.CAPTURE_PREWARM", "desc.uniform_decode and Fix.CAPTURE_PREWARM"),
        "only the uniform-decode FULL graphs are prewarmed (FULL_AND_PIECEWISE's): pure FULL's "
        "graphs serve every batch and capture on a first call",
    ),
    Mutant(
        "prewarm_in_full_mode",
        PART,
        "wrong_row",
        GRAPHS,
        CALL,
        CALL.replace("(CUDAGraphMode.NONE)", "(desc.cg_mode)"),
        "the prewarm passes FULL, as the old order did, instead of NONE",
        equivalent="the runner's forward functions read no mode: the path (and its tuning) is "
        "the function's, set by warmup; tests/test_cudagraph.py pins the modes passed",
    ),
    Mutant(
        "prewarm_unspecialised_only",
        PART,
        "partial",
        GRAPHS,
        CONDITION,
        CONDITION.replace(
            "Fix.CAPTURE_PREWARM", "desc.num_active_loras is None and Fix.CAPTURE_PREWARM"
        ),
        "descriptors of a LoRA capture case (specialised LoRA) are not prewarmed (found by an "
        "independent regression)",
    ),
)
