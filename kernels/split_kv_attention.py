"""FlashMLA-style split-KV decode attention with a planned work partition.

A planner kernel reads the live seq_lens and splits the batch's total KV work (sum of lengths)
into NUM_PARTS contiguous chunks; per part it writes
  tile_scheduler_metadata[p] = (begin_req, begin_pos, end_req, end_pos)   # end exclusive
and per request num_splits[r] = the number of parts covering it. The split kernel computes,
per (part, pack of heads: paged_attention.head_pack), a partial output and log-sum-exp for
each request it covers; the combine kernel merges, per (request, pack of heads), the partials
of the parts the plan says cover it. A plan is valid
only for the lengths it was made from: nothing checks that (upstream's contract). Any head size
is served: the kernels range over DIM_PAD = next_power_of_2(dim) and mask the rest
(paged_attention.py), and any part count (FlashMLA's is the SM count over the heads' tiles:
132, 66 or 33 on an H100): the parts range over PARTS_PAD = next_power_of_2(NUM_PARTS), masked.
Dtypes and the fp8 KV cache are paged_attention.py's; the partial
workspaces are float32, as FlashMLA's are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype
from kernels.paged_attention import attend_positions, head_pack, kv_heads_of, kv_scale_args

BLOCK_P = 32


def split_kv_attention_reference(
    query,
    k_cache,
    v_cache,
    block_table,
    seq_lens,
    scale,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """[num_reqs, heads, dim] in float64: each query attends to its request's seq_len keys
    (the cache's entries times their scales)."""
    block_size = k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    group = query.shape[1] // k_cache.shape[2]  # query heads per KV head
    flat_k = k_cache.reshape(-1, *k_cache.shape[2:]).double().cpu() * k_scale
    flat_v = v_cache.reshape(-1, *v_cache.shape[2:]).double().cpu() * v_scale
    flat_k, flat_v = flat_k.repeat_interleave(group, 1), flat_v.repeat_interleave(group, 1)
    for r, length in enumerate(seq_lens.tolist()):
        slots = [
            int(block_table[r, p // block_size]) * block_size + p % block_size
            for p in range(length)
        ]
        scores = torch.einsum("hd,phd->hp", query[r].double().cpu(), flat_k[slots]) * scale
        out[r] = torch.einsum("hp,phd->hd", scores.softmax(-1), flat_v[slots])
    return out


def plan_reference(seq_lens: list[int], num_parts: int) -> tuple[list[tuple], list[int]]:
    """(tile_scheduler_metadata rows, num_splits) as the planner computes them."""
    total, starts = sum(seq_lens), [sum(seq_lens[:r]) for r in range(len(seq_lens))]
    chunk = -(-total // num_parts)
    owner = [r for r, n in enumerate(seq_lens) for _ in range(n)]  # request of each work item
    rows, splits = [], [0] * len(seq_lens)
    for p in range(num_parts):
        lo, hi = p * chunk, min((p + 1) * chunk, total)
        if lo >= hi:
            rows.append((-1, 0, -1, 0))
            continue
        first, last = owner[lo], owner[hi - 1]
        rows.append((first, lo - starts[first], last, hi - starts[last]))
        for r in range(first, last + 1):
            splits[r] += 1
    return rows, splits


def plan_schedule(
    seq_lens: torch.Tensor,  # [num_reqs] int32, live
    tile_scheduler_metadata: torch.Tensor,  # [num_parts, 4] int32, written
    num_splits: torch.Tensor,  # [num_reqs] int32, written
) -> None:
    num_parts, num_reqs = tile_scheduler_metadata.shape[0], seq_lens.shape[0]
    _plan_kernel[(1,)](
        seq_lens,
        tile_scheduler_metadata,
        num_splits,
        num_reqs,
        NUM_PARTS=num_parts,
        PARTS_PAD=triton.next_power_of_2(num_parts),
        REQ_BLOCK=triton.next_power_of_2(num_reqs),
    )


def split_kv_attention(
    query: torch.Tensor,  # [num_reqs, heads, dim] float32 | float16 | bfloat16
    k_cache: torch.Tensor,  # [num_blocks, block_size, kv_heads, dim] query's dtype | fp8
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_reqs, max_num_blocks] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32, live
    tile_scheduler_metadata: torch.Tensor,  # [num_parts, 4] int32
    partial_out: torch.Tensor,  # [num_parts, num_reqs, heads, dim] float32 workspace
    partial_lse: torch.Tensor,  # [num_parts, num_reqs, heads] float32 workspace
    scale: float,
    max_model_len: int,
    *,
    k_scale: torch.Tensor | None = None,  # [1] float32, an fp8 cache's only
    v_scale: torch.Tensor | None = None,  # [1] float32, an fp8 cache's only
    page_loads: bool = False,  # whole pages loaded, unused slots weighted 0 (attend_positions)
) -> None:
    num_reqs, heads, dim = query.shape
    num_parts = tile_scheduler_metadata.shape[0]
    assert partial_out.shape == (num_parts, num_reqs, heads, dim), partial_out.shape
    require_dtype(FLOAT_DTYPES, query=query)
    require_dtype((torch.float32,), partial_out=partial_out, partial_lse=partial_lse)
    k_scale, v_scale = kv_scale_args(query.dtype, k_cache, v_cache, k_scale, v_scale)
    kv_heads = kv_heads_of(heads, k_cache)
    dim_pad = triton.next_power_of_2(dim)
    pack = head_pack(heads, BLOCK_P * dim_pad)
    _split_kv_kernel[(num_parts, heads // pack)](
        query,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_table,
        seq_lens,
        tile_scheduler_metadata,
        partial_out,
        partial_lse,
        scale,
        block_table.stride(0),
        k_cache.shape[1],
        NUM_REQS=num_reqs,
        HEADS=heads,
        KV_HEADS=kv_heads,
        DIM=dim,
        DIM_PAD=dim_pad,
        MAX_MODEL_LEN=max_model_len,
        BLOCK_P=BLOCK_P,
        PAGE_LOADS=page_loads,
        HEAD_PACK=pack,
    )


def combine_splits(
    partial_out: torch.Tensor,  # [num_parts, num_reqs, heads, dim] float32
    partial_lse: torch.Tensor,  # [num_parts, num_reqs, heads] float32
    tile_scheduler_metadata: torch.Tensor,  # [num_parts, 4] int32: which parts cover whom
    out: torch.Tensor,  # [num_reqs, heads, dim] float32 | float16 | bfloat16
) -> None:
    """out = the log-sum-exp merge of the partials of the parts the plan gives each request."""
    num_parts, num_reqs, heads, dim = partial_out.shape
    require_dtype((torch.float32,), partial_out=partial_out, partial_lse=partial_lse)
    require_dtype(FLOAT_DTYPES, out=out)
    dim_pad = triton.next_power_of_2(dim)
    pack = head_pack(heads, triton.next_power_of_2(num_parts) * dim_pad)
    _combine_kernel[(num_reqs, heads // pack)](
        partial_out,
        partial_lse,
        tile_scheduler_metadata,
        out,
        NUM_PARTS=num_parts,
        PARTS_PAD=triton.next_power_of_2(num_parts),
        NUM_REQS=num_reqs,
        HEADS=heads,
        DIM=dim,
        DIM_PAD=dim_pad,
        HEAD_PACK=pack,
    )


# NOTE: loop bounds are constexpr (Triton 3.6's interpreter, see moe_lora_align.py).


@triton.jit
def _plan_kernel(
    seq_lens_ptr,
    meta_ptr,
    num_splits_ptr,
    num_reqs,
    NUM_PARTS: tl.constexpr,
    PARTS_PAD: tl.constexpr,  # NUM_PARTS padded to a power of two (tl.arange); the rest masked
    REQ_BLOCK: tl.constexpr,
):
    reqs = tl.arange(0, REQ_BLOCK)
    lens = tl.load(seq_lens_ptr + reqs, mask=reqs < num_reqs, other=0)
    ends = tl.cumsum(lens, axis=0)
    starts = ends - lens
    total = tl.sum(lens, axis=0)
    chunk = tl.cdiv(total, NUM_PARTS)
    parts = tl.arange(0, PARTS_PAD)
    real = parts < NUM_PARTS
    lo = parts * chunk
    hi = tl.minimum(lo + chunk, total)
    empty = lo >= hi
    # request owning work item w: the number of requests ending at or before w
    first = tl.sum((ends[None, :] <= lo[:, None]).to(tl.int32), axis=1)
    last = tl.sum((ends[None, :] <= (hi - 1)[:, None]).to(tl.int32), axis=1)
    onehot_first = reqs[None, :] == first[:, None]
    onehot_last = reqs[None, :] == last[:, None]
    first_pos = lo - tl.sum(tl.where(onehot_first, starts[None, :], 0), axis=1)
    last_end = hi - tl.sum(tl.where(onehot_last, starts[None, :], 0), axis=1)
    tl.store(meta_ptr + parts * 4 + 0, tl.where(empty, -1, first), mask=real)
    tl.store(meta_ptr + parts * 4 + 1, tl.where(empty, 0, first_pos), mask=real)
    tl.store(meta_ptr + parts * 4 + 2, tl.where(empty, -1, last), mask=real)
    tl.store(meta_ptr + parts * 4 + 3, tl.where(empty, 0, last_end), mask=real)
    covers = (reqs[None, :] >= first[:, None]) & (reqs[None, :] <= last[:, None]) & ~empty[:, None]
    tl.store(num_splits_ptr + reqs, tl.sum(covers.to(tl.int32), axis=0), mask=reqs < num_reqs)


@triton.jit
def _split_kv_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    seq_lens_ptr,
    meta_ptr,
    out_ptr,
    lse_ptr,
    scale,
    table_stride,
    block_size,
    NUM_REQS: tl.constexpr,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE_LOADS: tl.constexpr,
    HEAD_PACK: tl.constexpr,
):
    """One (part, HEAD_PACK heads): a partial softmax over the part's positions of each of its
    requests, first..last (FlashMLA walks the plan's request range the same way); the other
    requests' slots are left unwritten: the combine reads the plan to skip them."""
    part = tl.program_id(0)
    hs = tl.program_id(1) * HEAD_PACK + tl.arange(0, HEAD_PACK)
    kv_hs = (hs // (HEADS // KV_HEADS)).to(tl.int64)
    first, first_pos = tl.load(meta_ptr + part * 4), tl.load(meta_ptr + part * 4 + 1)
    last, last_end = tl.load(meta_ptr + part * 4 + 2), tl.load(meta_ptr + part * 4 + 3)
    dims = tl.arange(0, DIM_PAD)[None, :]
    in_head = dims < DIM
    for i in range(NUM_REQS):  # at most every request
        r = first.to(tl.int64) + i  # NOTE: a plan never computed sends r far out of bounds
        if (first >= 0) & (r <= last):
            slots = (part * NUM_REQS + r) * HEADS + hs
            lo = tl.where(r == first, first_pos, 0)
            hi = tl.where(r == last, last_end, tl.load(seq_lens_ptr + r))
            q = tl.load(q_ptr + (r * HEADS + hs)[:, None] * DIM + dims, mask=in_head, other=0.0)
            m, denom, acc = attend_positions(
                q.to(tl.float32),
                k_cache_ptr,
                v_cache_ptr,
                k_scale_ptr,
                v_scale_ptr,
                block_table_ptr + r * table_stride,
                lo,
                hi,
                kv_hs,
                scale,
                block_size,
                KV_HEADS,
                DIM,
                DIM_PAD,
                MAX_MODEL_LEN,
                BLOCK_P,
                PAGE_LOADS,
            )
            has_keys = denom > 0
            lse = tl.where(has_keys, m + tl.log(tl.where(has_keys, denom, 1.0)), float("-inf"))
            out = tl.where(has_keys[:, None], acc / tl.where(has_keys, denom, 1.0)[:, None], 0.0)
            tl.store(out_ptr + slots[:, None] * DIM + dims, out, mask=in_head)
            tl.store(lse_ptr + slots, lse)


@triton.jit
def _combine_kernel(
    out_ptr_partial,
    lse_ptr,
    meta_ptr,
    out_ptr,
    NUM_PARTS: tl.constexpr,
    PARTS_PAD: tl.constexpr,
    NUM_REQS: tl.constexpr,
    HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HEAD_PACK: tl.constexpr,
):
    """One (request, HEAD_PACK heads): tiles are [parts, heads(, dims)]."""
    r = tl.program_id(0)
    hs = tl.program_id(1) * HEAD_PACK + tl.arange(0, HEAD_PACK)
    dims = tl.arange(0, DIM_PAD)
    in_head = dims < DIM
    parts = tl.arange(0, PARTS_PAD)
    real = parts < NUM_PARTS
    first = tl.load(meta_ptr + parts * 4, mask=real, other=-1)
    last = tl.load(meta_ptr + parts * 4 + 2, mask=real, other=-1)
    covers = ((first >= 0) & (first <= r) & (r <= last))[:, None]  # the plan gave request r
    slots = (parts[:, None] * NUM_REQS + r) * HEADS + hs[None, :]
    lse = tl.load(lse_ptr + slots, mask=covers, other=float("-inf"))
    m = tl.max(lse, axis=0)
    weights = tl.exp(lse - m[None, :])  # NaN when no part covered this request (a stale plan)
    partial = tl.load(
        out_ptr_partial + slots[:, :, None] * DIM + dims[None, None, :],
        mask=covers[:, :, None] & in_head[None, None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, :, None] * partial, axis=0) / tl.sum(weights, axis=0)[:, None]
    out_at = out_ptr + (r * HEADS + hs)[:, None] * DIM + dims[None, :]
    tl.store(out_at, out.to(out_ptr.dtype.element_ty), mask=in_head[None, :])
