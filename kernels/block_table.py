"""Block-table kernels that read through pointer tables, as Model Runner V2's do.

Per KV-cache group g, the runner keeps a block table [max_num_reqs, max_num_blocks_g] and an
input block table for the batch; the kernels find them through layout tensors:
  block_table_ptrs[g], input_block_table_ptrs[g]  # int64 addresses of the tables
  block_table_strides[g]                          # row stride of both (elements)
  block_sizes[g]                                  # tokens per block
A kernel loads a 64-bit address, casts it to a pointer and reads the table: if the layout
tensors hold garbage (CuMem wake, vLLM #40648), it dereferences a wild address.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import launch  # noqa: F401  # the interpreter's patches (CPU runs)

BLOCK = 64


def gather_block_tables_reference(block_tables, idx_mapping, num_blocks) -> list[torch.Tensor]:
    """Per group: rows idx_mapping of the block table, past num_blocks left as zero."""
    out = []
    for g, table in enumerate(block_tables):
        rows = torch.zeros(len(idx_mapping), table.shape[1], dtype=torch.int32)
        for b, req in enumerate(idx_mapping.tolist()):
            n = int(num_blocks[g, req])
            rows[b, :n] = table[req, :n].cpu()
        out.append(rows)
    return out


def slot_mappings_reference(input_tables, block_sizes, query_start_loc, positions) -> torch.Tensor:
    """[num_groups, num_tokens]: block_number * block_size + position % block_size."""
    starts = query_start_loc.tolist()
    out = torch.zeros(len(block_sizes), starts[-1], dtype=torch.int64)
    for g, size in enumerate(block_sizes):
        for b in range(len(starts) - 1):
            for t in range(starts[b], starts[b + 1]):
                pos = int(positions[t])
                out[g, t] = int(input_tables[g][b, pos // size]) * size + pos % size
    return out


def gather_block_tables(
    idx_mapping: torch.Tensor,  # [num_reqs] int32, batch row -> request state row
    block_table_ptrs: torch.Tensor,  # [num_groups] int64
    input_block_table_ptrs: torch.Tensor,  # [num_groups] int64
    block_table_strides: torch.Tensor,  # [num_groups] int64
    num_blocks: torch.Tensor,  # [num_groups, max_num_reqs] int32
    max_num_blocks: int,  # longest row over the groups
) -> None:
    num_groups, num_reqs = block_table_ptrs.shape[0], idx_mapping.shape[0]
    assert block_table_ptrs.dtype == input_block_table_ptrs.dtype == torch.int64
    assert num_blocks.shape[0] == num_groups and num_blocks.dtype == torch.int32
    _gather_block_tables_kernel[(num_groups, num_reqs)](
        idx_mapping,
        block_table_ptrs,
        input_block_table_ptrs,
        block_table_strides,
        num_blocks,
        num_blocks.stride(0),
        MAX_NUM_BLOCKS=max_num_blocks,
        BLOCK=BLOCK,
    )


def compute_slot_mappings(
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    positions: torch.Tensor,  # [num_tokens] int64
    input_block_table_ptrs: torch.Tensor,  # [num_groups] int64
    block_table_strides: torch.Tensor,  # [num_groups] int64
    block_sizes: torch.Tensor,  # [num_groups] int32
    slot_mappings: torch.Tensor,  # [num_groups, >= num_tokens] int64, written
    max_query_len: int,  # bound on one request's tokens this step (the runner's token budget)
) -> None:
    num_groups, num_reqs = input_block_table_ptrs.shape[0], query_start_loc.shape[0] - 1
    assert slot_mappings.dtype == torch.int64 and slot_mappings.shape[0] == num_groups
    _compute_slot_mappings_kernel[(num_groups, num_reqs)](
        query_start_loc,
        positions,
        input_block_table_ptrs,
        block_table_strides,
        block_sizes,
        slot_mappings,
        slot_mappings.stride(0),
        MAX_QUERY_LEN=max_query_len,
        BLOCK=BLOCK,
    )


@triton.jit
def _load_ptr(ptr_to_ptr, group):
    """The int64 address at ptr_to_ptr[group], as an int32 pointer."""
    return tl.cast(tl.load(ptr_to_ptr + group), tl.pointer_type(tl.int32))


@triton.jit
def _gather_block_tables_kernel(
    idx_mapping_ptr,
    block_table_ptrs,
    input_block_table_ptrs,
    strides_ptr,
    num_blocks_ptr,
    num_blocks_stride,
    MAX_NUM_BLOCKS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    group, row = tl.program_id(0), tl.program_id(1)
    req = tl.load(idx_mapping_ptr + row)
    stride = tl.load(strides_ptr + group)
    src = _load_ptr(block_table_ptrs, group) + req * stride
    dst = _load_ptr(input_block_table_ptrs, group) + row * stride
    n = tl.load(num_blocks_ptr + group * num_blocks_stride + req)
    for i0 in range(0, MAX_NUM_BLOCKS, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        # NOTE: rows of a group are `stride` long; MAX_NUM_BLOCKS is the longest group's
        tl.store(dst + i, tl.load(src + i, mask=i < n, other=0), mask=i < stride)


@triton.jit
def _compute_slot_mappings_kernel(
    query_start_loc_ptr,
    positions_ptr,
    input_block_table_ptrs,
    strides_ptr,
    block_sizes_ptr,
    slot_mappings_ptr,
    slot_mappings_stride,
    MAX_QUERY_LEN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    group, row = tl.program_id(0), tl.program_id(1)
    start = tl.load(query_start_loc_ptr + row)
    end = tl.load(query_start_loc_ptr + row + 1)
    size = tl.load(block_sizes_ptr + group).to(tl.int64)
    table = _load_ptr(input_block_table_ptrs, group) + row * tl.load(strides_ptr + group)
    for t0 in range(0, MAX_QUERY_LEN, BLOCK):
        offs = start + t0 + tl.arange(0, BLOCK)
        mine = offs < end
        pos = tl.load(positions_ptr + offs, mask=mine, other=0)
        block = tl.load(table + pos // size, mask=mine, other=0).to(tl.int64)
        slots = slot_mappings_ptr + group * slot_mappings_stride + offs
        tl.store(slots, block * size + pos % size, mask=mine)
