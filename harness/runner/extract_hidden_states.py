"""A cache-only layer (upstream's extract_hidden_states speculative method): it stores every
token's final hidden state in a KV cache of its own, through KV-cache group 0's slot mapping,
and computes no attention; a KV connector reads a request's states back from its blocks.

NOTE: the padding tokens of a padded batch (a captured graph's size) have slot -1
(kv_cache.py). Torch indexing reads -1 as "the last": `cache[slot // size, slot % size]`
with slot -1 is the last slot of the last block, a real token's whenever a request holds
that block (vLLM #43810). The paged cache-write kernel skips negative slots.
"""

from __future__ import annotations

import torch

from harness.fixes import Fix, Variant
from harness.runner.cudagraph import Launcher
from harness.runner.sleep_mode import TaggedPools
from kernels.paged_attention import reshape_and_cache

TAG = "kv_cache"


class CacheOnlyLayer:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,  # group 0's: the layer shares its block ids and slot mapping
        hidden_size: int,
        dtype: torch.dtype,
        pools: TaggedPools,
        fixes: Variant,
    ) -> None:
        """One head as wide as the hidden state (upstream: a head per extracted layer)."""
        self.kv_cache = pools.zeros(TAG, (num_blocks, block_size, 1, hidden_size), dtype)
        self.fixes = fixes

    def forward(
        self,
        hidden_states: torch.Tensor,  # [num_tokens, hidden] of the padded batch
        slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 for padding
        launch: Launcher,
    ) -> None:
        """Cache each token's hidden state at its slot (upstream: unified_kv_cache_update)."""
        to_cache = hidden_states.view(hidden_states.shape[0], 1, -1)
        cache = self.kv_cache
        if Fix.CACHE_ONLY_SKIP_PAD_SLOTS in self.fixes:
            # fix: cache_only_skip_pad_slots -- slot -1 is padding: write it nowhere (#43869:
            # the fixed-shape cache-write op, whose kernel skips negative slots)
            launch(reshape_and_cache, to_cache, to_cache, cache, cache, slot_mapping)
            return
        launch(basic_cache, to_cache, cache, slot_mapping)

    def extract(self, slots: list[int]) -> torch.Tensor:
        """[len(slots), hidden]: the states at a request's slots (the connector's read)."""
        return self.kv_cache.view(-1, self.kv_cache.shape[-1])[slots]


def basic_cache(
    to_cache: torch.Tensor,  # [num_tokens, 1, hidden]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, 1, hidden]
    slot_mapping: torch.Tensor,  # [num_tokens] int64
) -> None:
    """Upstream's torch indexing write (no sync, graph-safe): a negative slot wraps."""
    block_size = kv_cache.shape[1]
    kv_cache[slot_mapping // block_size, slot_mapping % block_size] = to_cache
