"""Paged KV cache writes and paged causal attention, with float64 references.

KV cache of one group: [num_blocks, block_size, num_heads, head_dim]; token t's K/V go to slot
slot_mapping[t] = block_number * block_size + offset. A query at position p of batch row b
attends to positions 0..p of that row, found through the row's block table.

Any head size is served, as upstream's Triton kernels serve it: a tl.arange extent must be a
power of two, so the kernels range over DIM_PAD = next_power_of_2(head_dim) (the cache write over
the next power of two of num_heads * head_dim) and mask the columns past the real extent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_P = 32


def reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping) -> None:
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding
            continue
        k_cache[slot // block_size, slot % block_size] = key[t]
        v_cache[slot // block_size, slot % block_size] = value[t]


def paged_attention_reference(
    query, k_cache, v_cache, block_table, token_rows, positions, scale
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] in float64."""
    block_size = k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for t, (row, pos) in enumerate(zip(token_rows.tolist(), positions.tolist(), strict=True)):
        slots = [
            int(block_table[row, p // block_size]) * block_size + p % block_size
            for p in range(pos + 1)
        ]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double().cpu()  # [p+1, H, D]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double().cpu()
        scores = torch.einsum("hd,phd->hp", query[t].double().cpu(), keys) * scale
        out[t] = torch.einsum("hp,phd->hd", scores.softmax(-1), values)
    return out


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64, -1 for padding tokens
    num_warps: int = 4,  # a launch config: the bytes written do not depend on it
) -> None:
    num_tokens, heads, dim = key.shape
    assert k_cache.shape[2:] == (heads, dim) and k_cache.is_contiguous() and key.is_contiguous()
    width = heads * dim
    _reshape_and_cache_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        WIDTH=width,
        WIDTH_PAD=triton.next_power_of_2(width),
        num_warps=num_warps,
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_heads, head_dim]
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= num_rows, max_num_blocks] int32, the batch's rows
    token_rows: torch.Tensor,  # [num_tokens] int32, batch row of each token
    positions: torch.Tensor,  # [num_tokens] int64
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32
    scale: float,
    max_model_len: int,
) -> None:
    num_tokens, heads, dim = query.shape
    assert query.is_contiguous() and out.is_contiguous() and block_table.is_contiguous()
    _paged_attention_kernel[(num_tokens, heads)](
        query,
        k_cache,
        v_cache,
        block_table,
        token_rows,
        positions,
        out,
        scale,
        block_table.stride(0),
        k_cache.shape[1],
        HEADS=heads,
        DIM=dim,
        DIM_PAD=triton.next_power_of_2(dim),
        MAX_MODEL_LEN=max_model_len,
        BLOCK_P=BLOCK_P,
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t)
    cols = tl.arange(0, WIDTH_PAD)
    # NOTE: slot -1 is a padding token; columns from WIDTH on pad the block to a power of two
    keep = cols < tl.where(slot >= 0, WIDTH, 0)
    slot = tl.maximum(slot, 0)
    key = tl.load(key_ptr + t * WIDTH + cols, mask=keep)
    value = tl.load(value_ptr + t * WIDTH + cols, mask=keep)
    tl.store(k_cache_ptr + slot * WIDTH + cols, key, mask=keep)
    tl.store(v_cache_ptr + slot * WIDTH + cols, value, mask=keep)


@triton.jit
def attend_positions(
    q,
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,
    lo,
    hi,
    h,
    scale,
    block_size,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Online softmax of q (one head, [DIM_PAD], zero past DIM) over positions [lo, hi) of one
    block-table row.

    Returns (running max, denominator, unnormalized output [DIM_PAD], zero past DIM);
    denominator 0: no live position.
    """
    dims = tl.arange(0, DIM_PAD)
    in_head = dims < DIM
    m = tl.full([], float("-inf"), tl.float32)
    denom = tl.zeros([], tl.float32)
    acc = tl.zeros([DIM_PAD], tl.float32)
    for p0 in range(0, MAX_MODEL_LEN, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P)
        live = (ps >= lo) & (ps < hi)
        block = tl.load(table_row_ptr + ps // block_size, mask=live, other=0).to(tl.int64)
        kv = ((block * block_size + ps % block_size)[:, None] * HEADS + h) * DIM + dims[None, :]
        k = tl.load(k_cache_ptr + kv, mask=live[:, None] & in_head[None, :], other=0.0)
        scores = tl.where(live, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing live yet
        correction = tl.exp(m - safe)
        weights = tl.exp(scores - safe)
        v = tl.load(v_cache_ptr + kv, mask=live[:, None] & in_head[None, :], other=0.0)
        acc = acc * correction + tl.sum(weights[:, None] * v, axis=0)
        denom = denom * correction + tl.sum(weights, axis=0)
        m = m_new
    return m, denom, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    token_rows_ptr,
    positions_ptr,
    out_ptr,
    scale,
    table_stride,
    block_size,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One (token, head): attention over the token's row, positions 0..pos."""
    t, h = tl.program_id(0), tl.program_id(1)
    row = tl.load(token_rows_ptr + t).to(tl.int64)
    dims = tl.arange(0, DIM_PAD)
    in_head = dims < DIM
    q = tl.load(q_ptr + (t * HEADS + h) * DIM + dims, mask=in_head, other=0.0)
    _, denom, acc = attend_positions(
        q,
        k_cache_ptr,
        v_cache_ptr,
        block_table_ptr + row * table_stride,
        0,
        tl.load(positions_ptr + t) + 1,
        h,
        scale,
        block_size,
        HEADS,
        DIM,
        DIM_PAD,
        MAX_MODEL_LEN,
        BLOCK_P,
    )
    tl.store(out_ptr + (t * HEADS + h) * DIM + dims, acc / denom, mask=in_head)
