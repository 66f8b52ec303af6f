"""Fix-site mutants of block_table_wake: regressions a refactor of the wake path could make."""

from __future__ import annotations

from harness.fixes import Fix
from harness.record import Mutant

PART = Fix.BLOCK_TABLE_REINIT_ON_WAKE
WORKER, BLOCK_TABLE = "harness/runner/worker.py", "harness/runner/block_table.py"
RELOAD = """        if self.sleep_level == 2 and (tags is None or "weights" in tags):
            self.model_runner.reload_weights()
"""
WAKE_CALL = """        if tags is None or "kv_cache" in tags:
            self.model_runner.post_kv_cache_wake_up()"""


def _rebuilt_once(attr: str) -> tuple[str, str]:
    """(old, new): `attr` is built at construction and never rewritten at wake."""
    old = "        for name, (values, dtype) in layout.items():\n"
    skip = f"            if name == {attr!r} and hasattr(self, name):\n                continue\n"
    return old, old + skip


MUTANTS = (
    Mutant(
        "wake_call_only_without_tags",
        PART,
        "partial",
        WORKER,
        'if tags is None or "kv_cache" in tags:',
        "if tags is None:",
        "a wake of kv_cache by tag (after the weights) no longer rebuilds the layout tensors",
    ),
    Mutant(
        "wake_call_only_after_level_2",
        PART,
        "partial",
        WORKER,
        'if tags is None or "kv_cache" in tags:',
        'if self.sleep_level == 2 and (tags is None or "kv_cache" in tags):',
        "only a level-2 sleep is followed by the rebuild",
    ),
    Mutant(
        "rebuild_before_the_pool_wakes",
        PART,
        "ordering",
        WORKER,
        "        self.pools.wake_up(tags)\n" + RELOAD + WAKE_CALL,
        WAKE_CALL + "\n        self.pools.wake_up(tags)\n" + RELOAD.rstrip("\n"),
        "the layout tensors are rebuilt while kv_cache still sleeps; waking discards them",
    ),
    Mutant(
        "input_table_pointers_not_rebuilt",
        PART,
        "partial",
        BLOCK_TABLE,
        *_rebuilt_once("input_block_table_ptrs"),
        "the rebuild forgets the pointer table of the batch's input block tables",
    ),
    Mutant(
        "strides_not_rebuilt",
        PART,
        "partial",
        BLOCK_TABLE,
        *_rebuilt_once("block_table_strides"),
        "the rebuild forgets the strides tensor",
    ),
    Mutant(
        "block_sizes_not_rebuilt",
        PART,
        "partial",
        BLOCK_TABLE,
        *_rebuilt_once("block_sizes_tensor"),
        "the rebuild forgets the block-size tensor",
    ),
    Mutant(
        "refresh_needs_live_blocks",
        Fix.BLOCK_TABLE_REINIT_ON_WAKE,
        "partial",
        "harness/runner/worker.py",
        "            self.model_runner.post_kv_cache_wake_up()\n",
        "            if self.model_runner.kv_cache.blocks:\n"
        "                self.model_runner.post_kv_cache_wake_up()\n",
        "the refresh is skipped while no request holds blocks: an engine slept before serving "
        "keeps garbage layout tensors (found by an independent regression)",
    ),
    Mutant(
        "tables_in_weights_pool",
        Fix.BLOCK_TABLE_REINIT_ON_WAKE,
        "ordering",
        "harness/runner/block_table.py",
        'TAG = "kv_cache"\n',
        'TAG = "weights"\n',
        "the block tables move to the weights pool: a wake of the KV cache before the weights "
        "refreshes them inside sleeping memory (found by an independent regression)",
    ),
)
