"""Fix-site mutants of mamba_align_prefix_poison: regressions of the alignment past the last
cache position that a refactor of the split (another stop, a progress guard, another block
grid) could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.MAMBA_ALIGN_PAST_LAST_CACHE
ALIGN = "harness/runner/mamba_align.py"
GATE = "if Fix.MAMBA_ALIGN_PAST_LAST_CACHE in fixes and end < num_tokens:"
FLOOR = "end = max(end // block * block, start)"

MUTANTS = (
    Mutant(
        "fix_without_eagle_only",
        PART,
        "partial",
        ALIGN,
        GATE,
        GATE[:-1] + " and not eagle:",
        "the alignment past the last cache position kept only where EAGLE backs nothing off",
    ),
    Mutant(
        "fix_for_two_blocks_or_more",
        PART,
        "partial",
        ALIGN,
        GATE,
        GATE[:-1] + " and num_tokens >= 2 * block:",
        "only prompts of two blocks or more aligned (where the back-off leaves a cache "
        "position above 0): the short prompts of the report are not",
    ),
    Mutant(
        "progress_guard",
        PART,
        "boundary",
        ALIGN,
        FLOOR,
        "end = max(end // block * block, start + 1)",
        "a guard against starving a request (a split of 0 forever) schedules one token: a chunk "
        "ending mid-block again",
    ),
    Mutant(
        "final_margin",
        PART,
        "boundary",
        ALIGN,
        "in fixes and end < num_tokens:",
        "in fixes and end < num_tokens - block:",
        "chunks ending within a block of the prompt's end are taken as its last chunk",
    ),
    Mutant(
        "first_chunk_exempt",
        PART,
        "partial",
        ALIGN,
        FLOOR,
        FLOOR + " if start else end",
        "a request's first chunk is left as the budget cut it",
    ),
    Mutant(
        "half_block_grid",
        PART,
        "wrong_row",
        ALIGN,
        FLOOR,
        "end = max(end // (block // 2) * (block // 2), start)",
        "chunks aligned on another group's smaller block (the smallest over groups, as #54076 "
        "found): the Mamba entry still ends mid-block",
    ),
    Mutant(
        "resume_not_realigned",
        PART,
        "partial",
        ALIGN,
        "if Fix.MAMBA_ALIGN_PAST_LAST_CACHE in fixes and start % block:",
        "if Fix.MAMBA_ALIGN_PAST_LAST_CACHE in fixes and start % block and end < num_tokens:",
        "a chunk resuming mid-block is stopped at its block's end only when not the prompt's last",
    ),
)
