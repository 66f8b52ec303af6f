"""Fix-site mutants of sleep_prefix_cache: regressions of the reset at sleep, or of what the
reset relies on, that a refactor of the sleep path or of the allocator could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.RESET_PREFIX_CACHE_ON_SLEEP
WORKER, KV_CACHE = "harness/runner/worker.py", "harness/runner/kv_cache.py"
RUNNER = "harness/runner/model_runner.py"
GATE = "if Fix.RESET_PREFIX_CACHE_ON_SLEEP in self.fixes:"

MUTANTS = (
    Mutant(
        "reset_at_level_2_only",
        PART,
        "partial",
        WORKER,
        GATE,
        GATE[:-1] + " and level == 2:",
        "only a level-2 sleep (weights discarded too) resets the prefix cache",
    ),
    Mutant(
        "reset_at_level_1_only",
        PART,
        "partial",
        WORKER,
        GATE,
        GATE[:-1] + " and level == 1:",
        "only a level-1 sleep resets the prefix cache, as if level 2 reloaded everything",
    ),
    Mutant(
        "reset_refused_when_idle",
        PART,
        "boundary",
        KV_CACHE,
        "        if self.blocks:\n            return False",
        "        if not self.blocks:\n            return False",
        "the in-use check is inverted: the reset is refused exactly when it is allowed",
    ),
    Mutant(
        "reset_keeps_the_hash_table",
        PART,
        "partial",
        KV_CACHE,
        "for table in (*self.cached, *self.block_hash):",
        "for table in self.block_hash:",
        "the reset forgets which hash each block holds but keeps the hash -> block table",
    ),
    Mutant(
        "free_keeps_the_row",
        PART,
        "unused_state",
        KV_CACHE,
        "for g, ids in enumerate(self.blocks.pop(row, [])):",
        "for g, ids in enumerate(self.blocks.get(row, [])):",
        "a finished request's row still counts as holding blocks: every reset is refused",
    ),
    Mutant(
        "requests_not_finished_before_sleep",
        PART,
        "ordering",
        RUNNER,
        "        for row in rows:\n            kv.free(row)\n        return new, steps",
        "        return new, steps",
        "generate() leaves its requests' blocks held until the next call frees them: a sleep "
        "in between finds blocks in use and its reset is refused",
    ),
    Mutant(
        "reset_one_group_only",
        PART,
        "partial",
        KV_CACHE,
        "for table in (*self.cached, *self.block_hash):",
        "for table in (self.cached[0], self.block_hash[0]):",
        "only the first group's cached blocks are forgotten",
        equivalent=(
            "a hit must be cached in every group (the runner's lookup takes the shortest run): "
            "one forgotten group is no hit"
        ),
    ),
)
