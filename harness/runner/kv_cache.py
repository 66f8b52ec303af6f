"""The paged KV cache of every group, its block tables and block allocation, in the kv_cache
memory pool; and the attention metadata of one step.

NOTE: the metadata of a step is views of persistent buffers (input buffers, block tables, slot
mappings), refreshed in place every step: a captured graph, and the attention a PIECEWISE
graph runs eagerly between its pieces, read the live step through them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from harness.runner.block_table import BlockTables, run_now
from harness.runner.input_batch import InputBatch
from harness.runner.sleep_mode import TaggedPools

TAG = "kv_cache"


@dataclass(eq=False)
class AttentionMetadata:
    """One step's KV-cache view (batch rows and tokens, padding included)."""

    k_caches: list[torch.Tensor]  # per group [num_blocks, block_size, heads, head_dim]
    v_caches: list[torch.Tensor]
    slot_mappings: torch.Tensor  # [num_groups, num_tokens] int64, -1 for padding
    block_tables: list[torch.Tensor]  # per group [num_reqs, max_num_blocks] int32
    token_rows: torch.Tensor  # [num_tokens] int32, batch row of each token
    positions: torch.Tensor  # [num_tokens] int64
    seq_lens: torch.Tensor  # [num_reqs] int32
    max_model_len: int
    uniform_decode: bool  # one token per request: the split-KV decode backend may serve it
    sched: object | None = None  # the decode backend's lazily planned state (flashmla.py)


class KVCache:
    def __init__(
        self,
        block_sizes: tuple[int, ...],
        num_blocks: int,
        num_heads: int,
        head_dim: int,
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        pools: TaggedPools,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
    ) -> None:
        self.block_sizes, self.num_blocks = block_sizes, num_blocks
        self.max_model_len, self.seed = max_model_len, seed
        shape = lambda size: (num_blocks, size, num_heads, head_dim)
        self.k_caches = [pools.zeros(TAG, shape(size), dtype) for size in block_sizes]
        self.v_caches = [pools.zeros(TAG, shape(size), dtype) for size in block_sizes]
        self.block_tables = BlockTables(
            block_sizes, max_num_reqs, max_num_tokens, max_model_len, pools
        )
        self.reset()

    def reset(self) -> None:
        """Forget every request; blocks are handed out in a seeded order."""
        gen = torch.Generator().manual_seed(self.seed)
        self.free = [
            torch.randperm(self.num_blocks, generator=gen).tolist() for _ in self.block_sizes
        ]
        self.blocks: dict[int, list[list[int]]] = {}

    def fill_random(self, seed: int) -> None:
        """Seeded K/V everywhere: the context of requests whose earlier steps are not run."""
        gen = torch.Generator().manual_seed(seed)
        for cache in (*self.k_caches, *self.v_caches):
            cache.copy_(torch.randn(cache.shape, generator=gen))

    def ensure_blocks(self, row: int, seq_len: int) -> None:
        """Enough blocks in every group for `seq_len` tokens of request row `row`."""
        if seq_len > self.max_model_len:
            raise ValueError(
                f"sequence of {seq_len} tokens over max_model_len {self.max_model_len}"
            )
        owned = self.blocks.setdefault(row, [[] for _ in self.block_sizes])
        for g, size in enumerate(self.block_sizes):
            while len(owned[g]) < triton.cdiv(seq_len, size):
                owned[g].append(self.free[g].pop())
        self.block_tables.set_row(row, owned)

    def slot(self, group: int, row: int, position: int) -> int:
        """Where position `position` of request row `row` lives in group `group` (host side)."""
        size = self.block_sizes[group]
        return self.blocks[row][group][position // size] * size + position % size

    def metadata(self, batch: InputBatch, launch=None) -> AttentionMetadata:
        """The batch's block tables and slot mappings, gathered through the layout tensors; a
        dummy batch gets block 0 everywhere and no slot (nothing is written to the cache).
        With `launch` (a graph that gathers at every replay) the kernels go through it, a dummy
        batch's included: its buffers are the ones each replayed step refreshes."""
        tables = self.block_tables
        t, r = batch.num_tokens_after_padding, batch.num_reqs_after_padding
        run = launch or run_now
        run(torch.Tensor.fill_, tables.slot_mappings[:, :t], -1)
        if batch.is_dummy and launch is None:
            gathered = [table[:r].zero_() for table in tables.input_block_tables]
        else:
            gathered = tables.gather_block_tables(batch.idx_mapping, run)
            tables.compute_slot_mappings(
                batch.query_start_loc[: batch.num_reqs + 1], batch.positions, run
            )
        return AttentionMetadata(
            self.k_caches,
            self.v_caches,
            tables.slot_mappings[:, :t],
            gathered,
            batch.token_rows,
            batch.positions,
            batch.seq_lens,
            self.max_model_len,
            batch.uniform_decode,
        )
