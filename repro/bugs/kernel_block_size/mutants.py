"""Fix-site mutants of kernel_block_size: regressions of the block size attention is told, or
of the kernel-block layout it must agree with, that a refactor could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.KERNEL_BLOCK_SIZE_TO_BUILDERS
RUNNER, KV_CACHE = "harness/runner/model_runner.py", "harness/runner/kv_cache.py"
TABLES, MODEL = "harness/runner/block_table.py", "harness/runner/model.py"

MUTANTS = (
    Mutant(
        "largest_group_size",
        PART,
        "wrong_row",
        RUNNER,
        "return c.cache.kernel_block_sizes or c.cache.block_sizes",
        "return (max(c.cache.block_sizes),) * len(c.cache.block_sizes)",
        "one block size for every group, the largest manager's: a group of another size is "
        "paged by the wrong one",
    ),
    Mutant(
        "tables_not_expanded",
        PART,
        "partial",
        TABLES,
        "ids = [b * per + k for b in kv_ids for k in range(per)]",
        "ids = list(kv_ids)",
        "the kernel block size passed, the table left in manager blocks: kernel block ids "
        "that name another manager block's first half",
    ),
    Mutant(
        "expanded_by_the_wrong_stride",
        PART,
        "boundary",
        TABLES,
        "ids = [b * per + k for b in kv_ids for k in range(per)]",
        "ids = [b + k for b in kv_ids for k in range(per)]",
        "each manager block expanded into consecutive ids from its own number, not from its "
        "first kernel block: block 2 becomes kernel blocks 2 and 3",
    ),
    Mutant(
        "smallest_kernel_size_for_all",
        PART,
        "boundary",
        RUNNER,
        "return c.cache.kernel_block_sizes or c.cache.block_sizes",
        "return (min(c.cache.kernel_block_sizes or c.cache.block_sizes),) * len("
        "c.cache.block_sizes)",
        "one block size for every group, the smallest kernel's: a group that is not split is "
        "walked in blocks smaller than its table's",
    ),
    Mutant(
        "launcher_default_block_size",
        PART,
        "unused_state",
        MODEL,
        "            block_size=attn.block_sizes[i],\n",
        "",
        "the builder's size never reaches the kernel: it pages by the cache view's shape, "
        "right only while the view is in kernel blocks",
        equivalent=(
            "with the kernel views the cache's page size is the kernel block size: the same "
            "number the fixed builder passes"
        ),
    ),
    Mutant(
        "builder_size_of_group_one",
        PART,
        "wrong_row",
        KV_CACHE,
        "            block_sizes=self.builder_block_sizes,\n",
        "            block_sizes=self.builder_block_sizes[1:] + self.builder_block_sizes[:1],\n",
        "each group's attention told the next group's block size (group lists rotated)",
    ),
    Mutant(
        "slot_mapping_in_manager_blocks",
        PART,
        "partial",
        KV_CACHE,
        "self.kernel_block_sizes, max_num_reqs,",
        "block_sizes, max_num_reqs,",
        "the tables' layout (slot mappings, table widths) in manager blocks over kernel ids: "
        "the cache writes land in the wrong slots",
    ),
)
