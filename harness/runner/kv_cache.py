"""The paged KV cache of every group, its block tables and block allocation, in the kv_cache
memory pool; and the attention metadata of one step."""

from __future__ import annotations

import torch
import triton

from harness.runner.block_table import BlockTables
from harness.runner.input_batch import InputBatch
from harness.runner.model import AttentionMetadata
from harness.runner.sleep_mode import TaggedPools

TAG = "kv_cache"


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
        seed: int = 0,
    ) -> None:
        self.block_sizes, self.num_blocks = block_sizes, num_blocks
        self.max_model_len, self.seed = max_model_len, seed
        shape = lambda size: (num_blocks, size, num_heads, head_dim)
        self.k_caches = [pools.zeros(TAG, shape(size), torch.float32) for size in block_sizes]
        self.v_caches = [pools.zeros(TAG, shape(size), torch.float32) for size in block_sizes]
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

    def metadata(self, batch: InputBatch) -> AttentionMetadata:
        """The batch's block tables and slot mappings, gathered through the layout tensors."""
        tables = self.block_tables.gather_block_tables(batch.idx_mapping)
        slots = self.block_tables.compute_slot_mappings(batch.query_start_loc, batch.positions)
        starts = batch.query_start_loc.tolist()
        rows = [r for r in range(batch.num_reqs) for _ in range(starts[r + 1] - starts[r])]
        token_rows = torch.tensor(rows, dtype=torch.int32, device=batch.input_ids.device)
        return AttentionMetadata(
            self.k_caches,
            self.v_caches,
            slots,
            tables,
            token_rows,
            batch.positions,
            self.max_model_len,
        )
