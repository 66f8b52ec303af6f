"""Paged KV cache writes, block zeroing and paged causal attention, with float64 references.

KV cache of one group: [num_blocks, block_size, num_heads, head_dim]; token t's K/V go to slot
slot_mapping[t] = block_number * block_size + offset. A query at position p of batch row b
attends to positions 0..p of that row, found through the row's block table.

Any head size is served, as upstream's Triton kernels serve it: a tl.arange extent must be a
power of two, so the kernels range over DIM_PAD = next_power_of_2(head_dim) (the cache write over
the next power of two of num_heads * head_dim) and mask the columns past the real extent.

Dtypes are upstream's: query, key, value and output in float32, float16 or bfloat16, computed in
float32. The cache holds the input dtype ("auto") or float8 e4m3 ("fp8") with per-tensor scales
k_scale and v_scale (float32 tensors of one element, as upstream's layers hold them): the cache
write stores x / scale rounded to e4m3 (vLLM's triton_reshape_and_cache_flash), attention reads
e4m3 * scale in float32 (its triton_unified_attention). The kernels load the scales, so a CUDA
graph replay sees a later update of them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype

BLOCK_P = 32
BLOCK_Q = 16  # query tokens of one row per tile
MIN_DOT = 16  # tl.dot's smallest extent
CACHE_TILE = 4096  # elements of a cache write's tile, at most
HEAD_TILE = 4096  # elements of an attention program's K tile over its heads, at most
FP8_KV_CACHE = torch.float8_e4m3fn  # upstream's current_platform.fp8_dtype() on CUDA
FP8_MIN_ARCH = 89  # Triton's fp8e4nv (e4m3) exists from sm_89 on


def reshape_and_cache_reference(
    key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    """Writes key / k_scale and value / v_scale (float64, rounded once to the cache's dtype)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:  # padding
            continue
        k_cache[slot // block_size, slot % block_size] = key[t].double() / k_scale
        v_cache[slot // block_size, slot % block_size] = value[t].double() / v_scale


def paged_attention_reference(
    query,
    k_cache,
    v_cache,
    block_table,
    token_rows,
    positions,
    scale,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] in float64, over the cache's entries times their
    scales."""
    block_size = k_cache.shape[1]
    out = torch.zeros(query.shape, dtype=torch.float64)
    for t, (row, pos) in enumerate(zip(token_rows.tolist(), positions.tolist(), strict=True)):
        slots = [
            int(block_table[row, p // block_size]) * block_size + p % block_size
            for p in range(pos + 1)
        ]
        group = query.shape[1] // k_cache.shape[2]  # query heads per KV head
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].double().cpu() * k_scale
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].double().cpu() * v_scale
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,phd->hp", query[t].double().cpu(), keys) * scale
        out[t] = torch.einsum("hp,phd->hd", scores.softmax(-1), values)
    return out


def require_fp8_support(device: torch.device) -> None:
    """An fp8 (e4m3) cache on a GPU before sm_89 is refused here, with the reason: Triton has no
    fp8e4nv there (it would fail compiling, with a message about its own type names)."""
    if device.type != "cuda":
        return  # the interpreter emulates e4m3 (tests/dtypes.py: its rounding differs)
    major, minor = torch.cuda.get_device_capability(device)
    if major * 10 + minor < FP8_MIN_ARCH:
        raise ValueError(
            f"an fp8 (e4m3) KV cache needs sm_{FP8_MIN_ARCH} or later (Triton's fp8e4nv); "
            f"this GPU is sm_{major}{minor}"
        )


def kv_heads_of(heads: int, k_cache: torch.Tensor) -> int:
    """The cache's KV heads; each serves heads // kv_heads query heads (grouped-query attention,
    one KV head: multi-query), as upstream's attention does."""
    kv_heads = k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"num_heads = {heads} is not a multiple of num_kv_heads = {kv_heads}")
    return kv_heads


def head_pack(heads: int, head_tile: int) -> int:
    """Query heads one program takes: the most (a power of two dividing `heads`) whose K tiles
    of `head_tile` elements each stay within HEAD_TILE. The interpreter's cost is per program
    and per operation, hardly per element: small heads are packed; upstream's sizes (head_dim
    128 and up) take one head a program, as upstream's kernels do."""
    pack = 1
    while heads % (2 * pack) == 0 and 2 * pack * head_tile <= HEAD_TILE:
        pack *= 2
    return pack


def kv_scale_args(
    dtype: torch.dtype,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a kernel gets, after checking the cache's dtype against the model's
    `dtype`: an fp8 cache's scales; another cache's own tensors (no scale is read from them)."""
    require_dtype((dtype, FP8_KV_CACHE), k_cache=k_cache)
    require_dtype((k_cache.dtype,), v_cache=v_cache)
    if k_cache.dtype != FP8_KV_CACHE:
        assert k_scale is None and v_scale is None, "scales apply to an fp8 KV cache only"
        return k_cache, v_cache
    require_fp8_support(k_cache.device)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        assert s is not None, f"an fp8 KV cache needs {name}"
        assert s.dtype == torch.float32 and s.numel() == 1, f"{name}: one float32 element"
    return k_scale, v_scale


def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32 | float16 | bfloat16
    value: torch.Tensor,  # [num_tokens, num_heads, head_dim] key's dtype
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_heads, head_dim] key's dtype | fp8
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [>= num_tokens] int64, -1 for padding tokens
    num_warps: int = 4,  # a launch config: the bytes written do not depend on it
    *,
    k_scale: torch.Tensor | None = None,  # [1] float32, an fp8 cache's only
    v_scale: torch.Tensor | None = None,  # [1] float32, an fp8 cache's only
) -> None:
    num_tokens, heads, dim = key.shape
    assert k_cache.shape[2:] == (heads, dim) and k_cache.is_contiguous() and key.is_contiguous()
    require_dtype(FLOAT_DTYPES, key=key)
    require_dtype((key.dtype,), value=value)
    k_scale, v_scale = kv_scale_args(key.dtype, k_cache, v_cache, k_scale, v_scale)
    width = heads * dim
    width_pad = triton.next_power_of_2(width)
    # NOTE: BLOCK_T tokens a program, a tile of at most CACHE_TILE elements: few programs for
    # the interpreter (each costs it alike), upstream's widths (32 heads x 128) one token each
    block_t = max(1, min(BLOCK_Q, CACHE_TILE // width_pad))
    _reshape_and_cache_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        k_scale,
        v_scale,
        num_tokens,
        WIDTH=width,
        WIDTH_PAD=width_pad,
        BLOCK_T=block_t,
        num_warps=num_warps,
    )


def zero_kv_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim], any dtype
    block_ids: torch.Tensor,  # [n] int64, the blocks to zero
) -> None:
    """Zero whole blocks (pages) of one K or V cache (upstream: KVBlockZeroer's kernel)."""
    assert cache.is_contiguous() and block_ids.dtype == torch.int64, block_ids.dtype
    page = cache[0].numel()
    _zero_kv_blocks_kernel[(block_ids.shape[0],)](
        cache, block_ids, PAGE=page, PAGE_PAD=triton.next_power_of_2(page)
    )


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim] float32 | float16 | bfloat16
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] query's dtype | fp8
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [>= num_rows, max_num_blocks] int32, the batch's rows
    token_rows: torch.Tensor,  # [num_tokens] int32, batch row of each token
    positions: torch.Tensor,  # [num_tokens] int64
    out: torch.Tensor,  # [num_tokens, num_heads, head_dim] query's dtype
    scale: float,
    max_model_len: int,
    *,
    k_scale: torch.Tensor | None = None,  # [1] float32, an fp8 cache's only
    v_scale: torch.Tensor | None = None,  # [1] float32, an fp8 cache's only
    block_size: int | None = None,  # tokens per block-table entry (default: k_cache's pages)
    window: int = 0,  # a sliding window: position p attends [max(0, p + 1 - window), p]; 0: none
) -> None:
    num_tokens, heads, dim = query.shape
    assert query.is_contiguous() and out.is_contiguous() and block_table.is_contiguous()
    require_dtype(FLOAT_DTYPES, query=query)
    require_dtype((query.dtype,), out=out)
    k_scale, v_scale = kv_scale_args(query.dtype, k_cache, v_cache, k_scale, v_scale)
    kv_heads = kv_heads_of(heads, k_cache)
    dim_pad = max(MIN_DOT, triton.next_power_of_2(dim))
    # NOTE: a K and a V tile of BLOCK_P x DIM_PAD are tl.dot operands, staged in shared memory:
    # MLA's 576 (1024 padded) takes 16 positions a tile to fit an A100's
    block_p = max(MIN_DOT, min(BLOCK_P, 8192 // dim_pad))
    pack = head_pack(heads, block_p * dim_pad)
    # NOTE: one program per (batch row, head pack), as upstream's unified attention's grid is
    # (query blocks x KV heads): rows come from the block table, a row's tokens from token_rows
    _paged_attention_kernel[(block_table.shape[0], heads // pack)](
        query,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        block_table,
        token_rows,
        positions,
        out,
        scale,
        block_table.stride(0),
        k_cache.shape[1] if block_size is None else block_size,
        num_tokens,
        window,
        HEADS=heads,
        KV_HEADS=kv_heads,
        DIM=dim,
        DIM_PAD=dim_pad,
        MAX_MODEL_LEN=max_model_len,
        BLOCK_P=block_p,
        HEAD_PACK=pack,
        BLOCK_Q=BLOCK_Q,
        # NOTE: the token loop's bound is constexpr (Triton 3.6's interpreter needs one): the
        # tokens rounded up to a power of two, a compile per power
        MAX_TOKENS=max(BLOCK_Q, triton.next_power_of_2(num_tokens)),
    )


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    k_scale_ptr,
    v_scale_ptr,
    num_tokens,
    WIDTH: tl.constexpr,
    WIDTH_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    ts = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slot = tl.load(slot_mapping_ptr + ts, mask=ts < num_tokens, other=-1)
    cols = tl.arange(0, WIDTH_PAD)
    # NOTE: slot -1 is a padding token (as are the tile's rows past num_tokens); columns from
    # WIDTH on pad the block to a power of two
    keep = cols[None, :] < tl.where(slot >= 0, WIDTH, 0)[:, None]
    slot = tl.maximum(slot, 0).to(tl.int64)
    rows = ts.to(tl.int64)[:, None] * WIDTH + cols[None, :]
    key = tl.load(key_ptr + rows, mask=keep)
    value = tl.load(value_ptr + rows, mask=keep)
    if k_cache_ptr.dtype.element_ty.is_fp8():  # quantize; otherwise the cache holds the input
        key = key.to(tl.float32) / tl.load(k_scale_ptr)
        value = value.to(tl.float32) / tl.load(v_scale_ptr)
    entries = slot[:, None] * WIDTH + cols[None, :]
    tl.store(k_cache_ptr + entries, key.to(k_cache_ptr.dtype.element_ty), mask=keep)
    tl.store(v_cache_ptr + entries, value.to(v_cache_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _zero_kv_blocks_kernel(cache_ptr, block_ids_ptr, PAGE: tl.constexpr, PAGE_PAD: tl.constexpr):
    block = tl.load(block_ids_ptr + tl.program_id(0))
    cols = tl.arange(0, PAGE_PAD)
    zero = tl.zeros([PAGE_PAD], cache_ptr.dtype.element_ty)
    tl.store(cache_ptr + block * PAGE + cols, zero, mask=cols < PAGE)


@triton.jit
def _kv_to_float32(x, scale_ptr):
    """A K or V tile in float32: an fp8 cache's entries times its per-tensor scale."""
    y = x.to(tl.float32)
    if x.dtype.is_fp8():
        y = y * tl.load(scale_ptr)
    return y


@triton.jit
def attend_positions(
    q,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    table_row_ptr,
    lo,
    hi,
    kv_hs,
    scale,
    block_size,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    PAGE_LOADS: tl.constexpr,
):
    """Online softmax of q (a pack of heads, [HEAD_PACK, DIM_PAD] float32, zero past DIM) over
    positions [lo, hi) of one block-table row, each head reading its KV head of KV_HEADS
    (kv_hs, [HEAD_PACK] int64), in float32.

    PAGE_LOADS: K and V are loaded a whole page (block) at a time, as FA3's and TRTLLM's paged
    kernels load them; positions outside [lo, hi) are masked by their weight, 0, so whatever
    bytes sit there are multiplied by it (0 x NaN is NaN). Otherwise only [lo, hi) is loaded.

    Returns per head (running max, denominator, unnormalized output [DIM_PAD], zero past DIM);
    denominator 0: no live position.
    """
    dims = tl.arange(0, DIM_PAD)[None, None, :]
    in_head = dims < DIM
    m = tl.max(tl.full(q.shape, float("-inf"), tl.float32), axis=1)
    denom = tl.zeros_like(m)
    acc = tl.zeros_like(q)
    if PAGE_LOADS:
        lo_load, hi_load = lo // block_size * block_size, tl.cdiv(hi, block_size) * block_size
    else:
        lo_load, hi_load = lo, hi
    # NOTE: the bound is constexpr (moe_lora_align.py); tiles outside the loads are skipped
    for p0 in range(0, MAX_MODEL_LEN, BLOCK_P):
        if (p0 < hi_load) & (p0 + BLOCK_P > lo_load):
            ps = p0 + tl.arange(0, BLOCK_P)
            live = ((ps >= lo) & (ps < hi))[None, :]
            loaded = (ps >= lo_load) & (ps < hi_load)
            block = tl.load(table_row_ptr + ps // block_size, mask=loaded, other=0).to(tl.int64)
            entry = (block * block_size + ps % block_size)[None, :] * KV_HEADS + kv_hs[:, None]
            kv = entry[:, :, None] * DIM + dims
            kv_mask = loaded[None, :, None] & in_head
            k = _kv_to_float32(tl.load(k_cache_ptr + kv, mask=kv_mask, other=0.0), k_scale_ptr)
            scores = tl.where(live, tl.sum(k * q[:, None, :], axis=2) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing live yet
            correction = tl.exp(m - safe)
            weights = tl.exp(scores - safe[:, None])
            v = _kv_to_float32(tl.load(v_cache_ptr + kv, mask=kv_mask, other=0.0), v_scale_ptr)
            acc = acc * correction[:, None] + tl.sum(weights[:, :, None] * v, axis=1)
            denom = denom * correction + tl.sum(weights, axis=1)
            m = m_new
    return m, denom, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_table_ptr,
    token_rows_ptr,
    positions_ptr,
    out_ptr,
    scale,
    table_stride,
    block_size,
    num_tokens,
    window,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    MAX_MODEL_LEN: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    MAX_TOKENS: tl.constexpr,
    HEAD_PACK: tl.constexpr,
):
    """One (batch row, HEAD_PACK query heads): every token of the row, BLOCK_Q tokens at a
    time, attends its row's positions 0..pos (the last `window` of them when window > 0) on
    each head's KV head (h // (HEADS // KV_HEADS)), by online softmax in float32. A tile loads
    the positions from its tokens' first to their last; each token weighs only its own (the
    others' weights are 0: positions inside another token's window of the tile, written
    before). Tiles are [heads, tokens or positions, dims]: a tl.dot per head."""
    row = tl.program_id(0)
    hs = tl.program_id(1) * HEAD_PACK + tl.arange(0, HEAD_PACK)
    kv_hs = (hs // (HEADS // KV_HEADS)).to(tl.int64)[:, None]
    table_row_ptr = block_table_ptr + row.to(tl.int64) * table_stride
    dims = tl.arange(0, DIM_PAD)[None, None, :]
    in_head = dims < DIM
    for t0 in range(0, MAX_TOKENS, BLOCK_Q):
        ts = t0 + tl.arange(0, BLOCK_Q)
        mine = tl.load(token_rows_ptr + ts, mask=ts < num_tokens, other=-1) == row
        if (t0 < num_tokens) & (tl.max(mine.to(tl.int32), axis=0) > 0):
            pos = tl.load(positions_ptr + ts, mask=mine, other=-1)
            lo = tl.where(window > 0, tl.maximum(pos + 1 - window, 0), 0)
            lo_tile = tl.min(tl.where(mine, lo, MAX_MODEL_LEN), axis=0)
            hi = tl.max(pos, axis=0) + 1
            heads = (ts.to(tl.int64)[None, :] * HEADS + hs[:, None])[:, :, None] * DIM + dims
            in_tile = mine[None, :, None] & in_head
            q = tl.load(q_ptr + heads, mask=in_tile, other=0.0).to(tl.float32)
            m = tl.full([HEAD_PACK, BLOCK_Q], float("-inf"), tl.float32)
            denom = tl.zeros([HEAD_PACK, BLOCK_Q], tl.float32)
            acc = tl.zeros([HEAD_PACK, BLOCK_Q, DIM_PAD], tl.float32)
            # NOTE: the bound is constexpr (moe_lora_align.py); tiles past the last are skipped
            for p0 in range(0, MAX_MODEL_LEN, BLOCK_P):
                if (p0 < hi) & (p0 + BLOCK_P > lo_tile):
                    ps = p0 + tl.arange(0, BLOCK_P)
                    loaded = (ps >= lo_tile) & (ps < hi)
                    block = tl.load(table_row_ptr + ps // block_size, mask=loaded, other=0)
                    slot = block.to(tl.int64) * block_size + ps % block_size
                    entry = slot[None, :] * KV_HEADS + kv_hs
                    kv = entry[:, :, None] * DIM + dims
                    kv_mask = loaded[None, :, None] & in_head
                    k = _kv_to_float32(
                        tl.load(k_cache_ptr + kv, mask=kv_mask, other=0.0), k_scale_ptr
                    )
                    scores = tl.dot(q, tl.trans(k, 0, 2, 1), input_precision="ieee") * scale
                    live = (ps[None, :] >= lo[:, None]) & (ps[None, :] <= pos[:, None])
                    scores = tl.where(live[None, :, :], scores, float("-inf"))
                    m_new = tl.maximum(m, tl.max(scores, axis=2))
                    safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing live yet
                    correction = tl.exp(m - safe)
                    weights = tl.exp(scores - safe[:, :, None])
                    v = _kv_to_float32(
                        tl.load(v_cache_ptr + kv, mask=kv_mask, other=0.0), v_scale_ptr
                    )
                    acc = acc * correction[:, :, None] + tl.dot(weights, v, input_precision="ieee")
                    denom = denom * correction + tl.sum(weights, axis=2)
                    m = m_new
            denom = tl.where(mine[None, :], denom, 1.0)  # another row's token: not stored
            out = (acc / denom[:, :, None]).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + heads, out, mask=in_tile)
