"""Fix-site mutants of moe_pad_sentinel: regressions of the consumer's -1 guard that a rewrite of
the finalize, or of its launch, could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.MOE_PAD_SENTINEL_GUARD
KERNEL, MODEL = "kernels/moe_permute.py", "harness/runner/model.py"
VALID = "valid = (expert >= 0) & (expert < num_experts)"
SKIP = "skip = finalize_skips(self.fixes)"

MUTANTS = (
    Mutant(
        "upper_bound_only",
        PART,
        "boundary",
        KERNEL,
        VALID,
        "valid = expert < num_experts",
        "the bound check of an id past the experts (the num_experts sentinel an older top-k "
        "wrote for non-local experts) lets -1 through",
    ),
    Mutant(
        "num_experts_sentinel",
        PART,
        "partial",
        KERNEL,
        VALID,
        "valid = expert != num_experts",
        "the guard knows the other contract's sentinel (num_experts, vLLM #42034), not -1",
    ),
    Mutant(
        "expert_0_skipped",
        PART,
        "boundary",
        KERNEL,
        VALID,
        "valid = (expert > 0) & (expert < num_experts)",
        "off by one: expert 0's real pairs are skipped with the padding",
    ),
    Mutant(
        "weight_only",
        PART,
        "partial",
        KERNEL,
        "row, weight = tl.where(valid, row, 0), tl.where(valid, weight, 0.0)",
        "weight = tl.where(valid, weight, 0.0)",
        "a padding pair's weight is zeroed but its row is still gathered: a weight of 0 does "
        "not make the unwritten entry's load safe",
    ),
    Mutant(
        "first_slot_only",
        PART,
        "partial",
        KERNEL,
        "if SKIP_INVALID:",
        "if SKIP_INVALID and k == 0:",
        "the guard serves the first slot: a padding row's second -1 is gathered",
    ),
    Mutant(
        "guard_in_eager_only",
        PART,
        "partial",
        MODEL,
        SKIP,
        SKIP + " and not launch.capturing",
        "the guard reaches eager launches only; the graphs, whose replays have padding rows, "
        "were captured without it",
    ),
    Mutant(
        "route_to_expert_0",
        PART,
        "partial",
        MODEL,
        SKIP,
        "launch(torch.clamp_, topk_ids, min=0)  # -1: expert 0, weight 0 (vLLM #57036)\n"
        "        skip = False",
        "#57036's rewrite (padding rows to expert 0 with weight 0) in front of a sort that "
        "assumes distinct experts: a padding row names expert 0 twice, moe_pad_nan_topk's "
        "hazard",
    ),
)
