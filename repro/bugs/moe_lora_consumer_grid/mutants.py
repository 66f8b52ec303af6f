"""Fix-site mutants of moe_lora_consumer_grid: one launch of two short, the id bound off by one
or compared with the wrong limit (the Triton kernels run on both devices)."""

from __future__ import annotations

from harness.record import Mutant
from repro.bugs.moe_lora_consumer_grid import GRID, GUARD

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
    Mutant(
        "grid_plus_one_for_several_adapters_only",
        GRID,
        "boundary",
        KERNEL,
        "return max_loras + 1 if fixes.grid_plus_one else max_loras",
        "return max_loras + 1 if fixes.grid_plus_one and max_loras > 1 else max_loras",
        "the extra slot is launched only when there are several LoRA slots",
    ),
    Mutant(
        "lora_index_wraps",
        GRID,
        "wrong_row",
        KERNEL,
        "lora_id = tl.load(lora_ids_ptr + tl.program_id(2))",
        "lora_id = tl.load(lora_ids_ptr + tl.program_id(2) % max_loras)",
        "the grid has the extra slot, but its program reads the first id again",
    ),
    Mutant(
        "guard_in_shrink_only",
        GUARD,
        "partial",
        KERNEL,
        "ID_GUARD=fixes.id_guard,",
        "ID_GUARD=fixes.id_guard and row_div > 1,",
        "the expand launch (row_div 1) runs without the id bound",
    ),
    Mutant(
        "guard_in_expand_only",
        GUARD,
        "partial",
        KERNEL,
        "ID_GUARD=fixes.id_guard,",
        "ID_GUARD=fixes.id_guard and row_div == 1,",
        "the shrink launch (row_div top_k) runs without the id bound",
    ),
    Mutant(
        "guard_on_the_slot_not_the_id",
        GUARD,
        "wrong_row",
        KERNEL,
        "if lora_id >= max_loras:",
        "if tl.program_id(2) >= max_loras + 1:",
        "the bound tests the program's slot (always in the grid), not the id it read",
    ),
    Mutant(
        "consumer_ignores_adapter_enabled",
        GUARD,
        "partial",
        KERNEL,
        "    if tl.load(adapter_enabled_ptr + lora_id) == 0:\n        return\n",
        "",
        "the consumer runs a disabled adapter's program on align rows nobody wrote",
    ),
    Mutant(
        "consumer_enabled_check_inverted_index",
        GUARD,
        "wrong_row",
        KERNEL,
        "tl.load(adapter_enabled_ptr + lora_id) == 0",
        "tl.load(adapter_enabled_ptr + tl.program_id(2)) == 0",
        "the enabled flag is read by grid slot, not by LoRA id (off by the base model's -1)",
    ),
)
