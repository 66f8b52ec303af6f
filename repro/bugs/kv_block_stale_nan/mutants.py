"""Fix-site mutants of kv_block_stale_nan: regressions of the new-block zeroing a refactor of
the step's allocation or of the zeroing kernel could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.ZERO_NEW_KV_BLOCKS
RUNNER, KV_CACHE = "harness/runner/model_runner.py", "harness/runner/kv_cache.py"
KERNELS = "kernels/paged_attention.py"
CACHES = "for cache in (self.kv_cache.k_caches[g], self.kv_cache.v_caches[g]):"
ALLOCATE = """        for row, q in enumerate(requests):
            self.kv_cache.ensure_blocks(row, q.num_computed_tokens + len(q.token_ids), q.token_ids)
"""
ZERO = "        self._zero_new_blocks()\n"

MUTANTS = (
    Mutant(
        "zero_first_group_only",
        PART,
        "partial",
        RUNNER,
        "for g, ids in enumerate(new):",
        "for g, ids in enumerate(new[:1]):",
        "only the group that shares blocks with the state group is zeroed (#35219 before "
        "#51749's generalization): group 1's fresh pages keep the wake's poison",
    ),
    Mutant(
        "zero_keys_only",
        PART,
        "partial",
        RUNNER,
        CACHES,
        "for cache in (self.kv_cache.k_caches[g],):",
        "the key pages are zeroed, the value pages, which the weights multiply, are not",
    ),
    Mutant(
        "zero_values_only",
        PART,
        "partial",
        RUNNER,
        CACHES,
        "for cache in (self.kv_cache.v_caches[g],):",
        "the value pages are zeroed, the key pages are not",
        equivalent=(
            "a stale key only reaches its score, which the kernel replaces by -inf at an "
            "unused slot (tl.where), as FA3 masks S: only values meet the 0 weight"
        ),
    ),
    Mutant(
        "zero_first_new_block_only",
        PART,
        "boundary",
        RUNNER,
        "self.launch(zero_kv_blocks, cache, block_ids)",
        "self.launch(zero_kv_blocks, cache, block_ids[:1])",
        "of a prefill's new pages only the first is zeroed; its last, partly written, keeps "
        "the old tenant's bytes",
    ),
    Mutant(
        "zero_before_allocation",
        PART,
        "ordering",
        RUNNER,
        ALLOCATE + ZERO,
        ZERO + ALLOCATE,
        "the zeroing runs before the step allocates: it zeroes the previous step's pages, "
        "which hold K/V by now, and leaves this step's stale",
    ),
    Mutant(
        "new_block_ids_never_taken",
        PART,
        "unused_state",
        KV_CACHE,
        "new, self.new_block_ids = self.new_block_ids, [[] for _ in self.block_sizes]",
        "new = self.new_block_ids",
        "the record of new blocks is never cleared: every step zeroes every page given so far, "
        "erasing the request's K/V",
    ),
    Mutant(
        "zero_half_a_page",
        PART,
        "boundary",
        KERNELS,
        "mask=cols < PAGE)",
        "mask=cols < PAGE // 2)",
        "the zeroing kernel covers the first half of each page: the last slots stay stale",
    ),
    Mutant(
        "every_program_zeroes_the_first_id",
        PART,
        "wrong_row",
        KERNELS,
        "block = tl.load(block_ids_ptr + tl.program_id(0))",
        "block = tl.load(block_ids_ptr)",
        "every program of the zeroing kernel reads the first block id: one page is zeroed "
        "as many times as there are new ones",
    ),
    Mutant(
        "zero_gated_on_prefix_caching",
        PART,
        "partial",
        RUNNER,
        "if not self.config.cache.hybrid or Fix.ZERO_NEW_KV_BLOCKS not in self.fixes:",
        "if not self.config.cache.enable_prefix_caching or Fix.ZERO_NEW_KV_BLOCKS not in "
        "self.fixes:",
        "the zeroing is gated on the wrong configuration: a hybrid runner never zeroes",
    ),
)
