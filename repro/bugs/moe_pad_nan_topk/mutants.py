"""Fix-site mutants of moe_pad_nan_topk: regressions of the gate's NaN clamp that a rewrite of
the top-k kernel or of its launch could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.MOE_GATE_NAN_CLAMP
KERNEL, MODEL = "kernels/topk_gate.py", "harness/runner/model.py"
CLAMP = '                p = tl.where(tl.abs(p) < float("inf"), p, 0.0)\n'
IF_CLAMP = (
    "            if CLAMP_NONFINITE:  # fix: moe_gate_nan_clamp -- NaN compares false: every pick "
    "is 0.\n"
)
EXCLUDE = '            p = tl.where(((taken >> e) & 1) != 0, float("-inf"), p)  # picked already\n'
SELECT = """            better = (p > best) | (e == 0)
            best = tl.where(better, p, best)
            pick = tl.where(better, e, pick)
        taken = taken | (tl.full([BLOCK_T], 1, dtype=tl.int64) << pick.to(tl.int64))
"""

MUTANTS = (
    Mutant(
        "clamp_to_minus_inf",
        PART,
        "boundary",
        KERNEL,
        CLAMP,
        '                p = tl.where(tl.abs(p) < float("inf"), p, float("-inf"))\n',
        "NaN becomes -inf, 'out of the running', as a picked expert is: a padding row has no "
        "candidate above the first and picks expert 0 every time",
    ),
    Mutant(
        "clamp_inf_only",
        PART,
        "partial",
        KERNEL,
        CLAMP,
        '                p = tl.where(tl.abs(p) == float("inf"), 0.0, p)\n',
        "only infinite probabilities are clamped; NaN, what a padding row holds, is not",
    ),
    Mutant(
        "clamp_after_exclusion",
        PART,
        "ordering",
        KERNEL,
        IF_CLAMP + CLAMP + EXCLUDE,
        EXCLUDE + IF_CLAMP + CLAMP,
        "the clamp runs after the picked experts are set to -inf and turns them back to 0: an "
        "all-zero row picks expert 0 again",
    ),
    Mutant(
        "clamp_first_pick_only",
        PART,
        "partial",
        KERNEL,
        IF_CLAMP,
        IF_CLAMP.replace("if CLAMP_NONFINITE:", "if CLAMP_NONFINITE and k == 0:"),
        "the clamp serves the first pick's pass only: the second pick of a NaN row compares "
        "NaN again and stays on expert 0",
    ),
    Mutant(
        "clamp_written_weight_only",
        PART,
        "partial",
        KERNEL,
        IF_CLAMP + CLAMP + EXCLUDE + SELECT + "        weight = best\n",
        EXCLUDE
        + SELECT
        + "        weight = best\n"
        + IF_CLAMP.replace("            ", "        ", 1)
        + '            weight = tl.where(tl.abs(best) < float("inf"), best, 0.0)\n',
        "the weights written are clamped, the probabilities compared are not: the ids stay "
        "duplicates (a nan_to_num on the outputs of top-k)",
    ),
    Mutant(
        "clamp_in_eager_only",
        PART,
        "partial",
        MODEL,
        "clamp = gate_clamps(self.fixes)",
        "clamp = gate_clamps(self.fixes) and not launch.capturing",
        "the clamp reaches eager launches only; the graph's top-k, whose replays have padding "
        "rows, was captured without it",
    ),
)
