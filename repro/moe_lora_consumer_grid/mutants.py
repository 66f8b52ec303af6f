"""Fix-site mutants of moe_lora_consumer_grid: one launch of two short, the id bound off by one
or compared with the wrong limit (the Triton kernels run on both devices)."""

from __future__ import annotations

from harness.record import Mutant
from repro.moe_lora_consumer_grid import GRID, GUARD

KERNEL = "kernels/fused_moe_lora.py"
SHRINK_LAUNCH = "_launch(x, lora_a, out, align, slots, top_k, 1.0, block_size, fixes)"
EXPAND_LAUNCH = "_launch(shrunk, lora_b, out, align, slots, 1, scale, block_size, fixes)"

MUTANTS = (
    Mutant(
        "grid_short",
        GRID,
        "boundary",
        KERNEL,
        "return max_loras + 1 if fixes.grid_plus_one else max_loras",
        "return max_loras",
        "both kernels launch max_loras programs on the LoRA axis again",
    ),
    Mutant(
        "shrink_grid_short",
        GRID,
        "partial",
        KERNEL,
        SHRINK_LAUNCH,
        SHRINK_LAUNCH.replace("slots,", "max_loras,"),
        "the shrink launch keeps the short grid, the expand has the fix",
    ),
    Mutant(
        "expand_grid_short",
        GRID,
        "partial",
        KERNEL,
        EXPAND_LAUNCH,
        EXPAND_LAUNCH.replace("slots,", "max_loras,"),
        "the expand launch keeps the short grid, the shrink has the fix",
    ),
    Mutant(
        "guard_off_by_one",
        GUARD,
        "boundary",
        KERNEL,
        "if lora_id >= max_loras:",
        "if lora_id > max_loras:",
        "the bound lets id max_loras through (the first row that does not exist)",
    ),
    Mutant(
        "guard_against_grid_size",
        GUARD,
        "wrong_row",
        KERNEL,
        "if lora_id >= max_loras:",
        "if lora_id >= max_loras + 1:",
        "the bound compares with the grid's slot count, not the rows the outputs have",
    ),
)
