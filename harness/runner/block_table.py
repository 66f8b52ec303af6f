"""Block tables per KV-cache group, and the layout tensors the kernels find them through.

NOTE: everything here lives in the kv_cache memory pool, the layout tensors included: after a
sleep that discards kv_cache, wake maps new memory at the same addresses with undefined
contents, so init_block_table_layout_tensors() must run again (vLLM #40648). A graph that runs
the gather or the slot mappings holds the layout tensors' addresses: refreshing them as new
tensors leaves it reading the old ones (vLLM #53197's hazard); `in_place` refreshes them where
they are.

The tables are in kernel blocks: a group whose attention kernel takes blocks smaller than the KV
manager's (`blocks_per_kv_block` > 1) gets each manager block expanded into its kernel blocks
(vLLM #24486; Model Runner V2: #38831), and slot mappings are computed in kernel blocks.

A row is max_model_len's blocks rounded up to 128 tokens (vLLM #39324, for attention backends
that need a multiple of 128 / block_size columns): its columns past max_model_len's blocks are
never written, 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton

from harness.runner.sleep_mode import TaggedPools
from kernels.block_table import compute_slot_mappings, gather_block_tables

TAG = "kv_cache"


def row_width(max_model_len: int, kv_block_size: int) -> int:
    """A request row's width in KV-manager blocks of `kv_block_size` tokens: max_model_len's
    blocks, rounded up to a multiple of 128 tokens where a block is at most 128 (upstream:
    MultiGroupBlockTable and Model Runner V2's BlockTables since vLLM #39324, for attention
    backends that need it). Columns past max_model_len's blocks are never a request's: they
    stay 0."""
    blocks = triton.cdiv(max_model_len, kv_block_size)
    if kv_block_size <= 128:
        multiple = 128 // kv_block_size
        blocks = triton.cdiv(blocks, multiple) * multiple
    return blocks


def run_now(fn, *args, **kwargs) -> None:
    """Run device work at once (the default for a `launch` argument)."""
    fn(*args, **kwargs)


class BlockTables:
    def __init__(
        self,
        block_sizes: Sequence[int],  # the kernels' (tokens per table entry)
        max_num_reqs: int,
        max_num_tokens: int,
        max_model_len: int,
        pools: TaggedPools,
        blocks_per_kv_block: Sequence[int] = (),  # kernel blocks per manager block (1s)
    ) -> None:
        self.block_sizes = list(block_sizes)
        self.blocks_per_kv_block = list(blocks_per_kv_block) or [1] * len(self.block_sizes)
        self.max_num_tokens = max_num_tokens
        self.pools = pools
        self.max_num_blocks = [
            row_width(max_model_len, size * per) * per  # in kernel blocks
            for size, per in zip(self.block_sizes, self.blocks_per_kv_block, strict=True)
        ]
        num_groups, i32 = len(self.block_sizes), torch.int32
        # NOTE: stable storage: the layout tensors below hold these tables' addresses
        self.block_tables = [pools.zeros(TAG, (max_num_reqs, n), i32) for n in self.max_num_blocks]
        self.input_block_tables = [
            pools.zeros(TAG, (max_num_reqs, n), i32) for n in self.max_num_blocks
        ]
        self.num_blocks = pools.zeros(TAG, (num_groups, max_num_reqs), i32)
        self.slot_mappings = pools.zeros(TAG, (num_groups, max_num_tokens), torch.int64)
        self.init_block_table_layout_tensors()

    def init_block_table_layout_tensors(self, in_place: bool = False) -> None:
        """(Re)build the pointer, stride and block-size tensors from the tables: as new tensors,
        or (`in_place`, once they exist) by writing the values into the ones there are."""
        ptrs = lambda tables: [t.data_ptr() for t in tables]
        layout = {
            "block_table_ptrs": (ptrs(self.block_tables), torch.int64),
            "input_block_table_ptrs": (ptrs(self.input_block_tables), torch.int64),
            "block_table_strides": ([t.stride(0) for t in self.block_tables], torch.int64),
            "block_sizes_tensor": (self.block_sizes, torch.int32),
        }
        for name, (values, dtype) in layout.items():
            if in_place and hasattr(self, name):
                getattr(self, name).copy_(torch.tensor(values, dtype=dtype))
            else:
                setattr(self, name, self.pools.tensor(TAG, values, dtype))

    def set_row(self, req_index: int, block_ids: Sequence[Sequence[int]]) -> None:
        """The whole block list of request row `req_index`, one list of KV-manager blocks per
        group (expanded into kernel blocks), written by
        device kernels from staged ids (upstream's Model Runner V2 stages block ids and applies
        them with a kernel): a row written into released memory faults as an illegal address,
        as upstream's did (vLLM #44395), where a host-to-device copy is refused there
        ("invalid argument")."""
        for g, kv_ids in enumerate(block_ids):
            table, per = self.block_tables[g], self.blocks_per_kv_block[g]
            ids = [b * per + k for b in kv_ids for k in range(per)]  # manager -> kernel blocks
            staged = torch.tensor(ids, dtype=torch.int32).to(table.device)
            columns = torch.arange(len(ids), device=table.device)
            table[req_index].index_copy_(0, columns, staged)
            self.num_blocks[g, req_index] = len(ids)

    def gather_block_tables(self, idx_mapping: torch.Tensor, launch=run_now) -> list[torch.Tensor]:
        """Input block tables of the batch (rows idx_mapping of the request tables)."""
        launch(
            gather_block_tables,
            idx_mapping,
            self.block_table_ptrs,
            self.input_block_table_ptrs,
            self.block_table_strides,
            self.num_blocks,
            max(self.max_num_blocks),
        )
        return [t[: idx_mapping.shape[0]] for t in self.input_block_tables]

    def compute_slot_mappings(
        self, query_start_loc: torch.Tensor, positions: torch.Tensor, launch=run_now
    ) -> torch.Tensor:
        """[num_groups, num_tokens] KV slot of every token of the batch."""
        launch(
            compute_slot_mappings,
            query_start_loc,
            positions,
            self.input_block_table_ptrs,
            self.block_table_strides,
            self.block_sizes_tensor,
            self.slot_mappings,
            self.max_num_tokens,
        )
        return self.slot_mappings[:, : positions.shape[0]]
