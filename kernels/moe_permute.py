"""MoE over expert-sorted rows, in the shape of FlashInfer's CUTLASS MoE (TensorRT-LLM's
kernels), with a float64 reference.

Three steps, as upstream's: sort the (token, slot) pairs of a top-k routing by expert; run each
expert's GEMM over its rows; finalize: gather each pair's row back through `unpermuted_rows`
(pair -> row), scale it by the pair's routing weight, sum per token.

NOTE: the sort keeps upstream's contract: a token's top-k experts are distinct, and every id
names an expert. An expert's rows are the tokens that chose it, each once (its first slot that
names the expert), so a token that names one expert twice gets a row for its first slot only,
and an id that names no expert (the -1 of a padding row, vLLM #46428) gets none: either pair's
entry of `unpermuted_rows` is never written, and the finalize gathers through whatever it holds
(vLLM #39391: FlashInfer's finalizeMoeRoutingKernel dereferenced such entries). A finalize that
honours the padding contract skips ids outside [0, num_experts) before that lookup (FlashInfer's
finalize, #37715; the consumers that had not learned it: vLLM #57036, #57946).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype

BLOCK_T = 64  # tokens per block (the sort) and per program (the finalize)
BLOCK_N = 32
BLOCK_K = 32


def moe_permute_reference(
    h: torch.Tensor,  # [num_tokens, K]
    experts: torch.Tensor,  # [num_experts, N, K]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    topk_weights: torch.Tensor,  # [num_tokens, top_k]
) -> torch.Tensor:
    """[num_tokens, N] float64: sum over a token's valid pairs of weight * h @ experts[id].T
    (ids outside [0, num_experts) contribute nothing)."""
    h64, w64 = h.detach().double().cpu(), experts.detach().double().cpu()
    out = torch.zeros(h.shape[0], experts.shape[1], dtype=torch.float64)
    for t, (ids, weights) in enumerate(zip(topk_ids.tolist(), topk_weights.tolist(), strict=True)):
        for e, w in zip(ids, weights, strict=True):
            if 0 <= e < experts.shape[0]:
                out[t] += w * (h64[t] @ w64[e].T)
    return out


def moe_permute_experts(
    h: torch.Tensor,  # [num_tokens, K] FLOAT_DTYPES
    experts: torch.Tensor,  # [num_experts, N, K] h's dtype
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    permuted: torch.Tensor,  # [num_tokens * top_k, N] h's dtype: each pair's row, written
    unpermuted_rows: torch.Tensor,  # [num_tokens * top_k] int32: pair -> row, written
) -> None:
    """Steps one and two: each expert's rows in expert order, and their GEMM."""
    if h.is_cuda and h.dtype != torch.float32:
        raise ValueError(
            f"moe_permute_experts in {h.dtype} on a GPU: refused, its outputs were wrong on an "
            "H100 (tests/test_moe_permute.py, 2026-11-25, open); float32 only there"
        )
    num_tokens, k = h.shape
    num_experts, n, _ = experts.shape
    top_k = topk_ids.shape[1]
    require_dtype(FLOAT_DTYPES, h=h)
    require_dtype((h.dtype,), experts=experts, permuted=permuted)
    require_dtype((torch.int32,), topk_ids=topk_ids, unpermuted_rows=unpermuted_rows)
    assert experts.shape[2] == k and topk_ids.shape[0] == num_tokens, (experts.shape, h.shape)
    assert permuted.shape == (num_tokens * top_k, n), permuted.shape
    assert unpermuted_rows.shape == (num_tokens * top_k,), unpermuted_rows.shape
    for name, t in (("h", h), ("experts", experts), ("topk_ids", topk_ids), ("out", permuted)):
        assert t.is_contiguous(), f"{name}: contiguous"
    _moe_permute_kernel[(1,)](
        h,
        experts,
        topk_ids,
        permuted,
        unpermuted_rows,
        num_tokens,
        num_experts,
        n,
        k,
        TOP_K=top_k,
        BLOCK_T=BLOCK_T,
        # NOTE: at least 8: with 4 expert columns (a [64, 4] tile) the sort's rows of a
        # 9-token batch came out wrong on an H200 (Triton 3.6; the interpreter right): pairs
        # with no row, the GEMM's stores landing elsewhere. 8 and 16 were right (2026-11-28).
        # The 16-bit refusal above may be the same defect: one bfloat16 sample (9 tokens, 8
        # experts) was off by 47 with a tile of 8 and exact with 16 (not yet a test)
        BLOCK_E=max(8, triton.next_power_of_2(num_experts)),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def moe_finalize(
    permuted: torch.Tensor,  # [num_tokens * top_k, N]
    unpermuted_rows: torch.Tensor,  # [num_tokens * top_k] int32
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    topk_weights: torch.Tensor,  # [num_tokens, top_k] float32
    out: torch.Tensor,  # [num_tokens, N] FLOAT_DTYPES, written
    num_experts: int,
    *,
    skip_invalid: bool = True,
) -> None:
    """Step three: out[t] = sum over t's pairs of weight * permuted[unpermuted_rows[pair]]."""
    num_tokens, top_k = topk_ids.shape
    n = out.shape[1]
    require_dtype(FLOAT_DTYPES, permuted=permuted, out=out)
    require_dtype((torch.int32,), topk_ids=topk_ids, unpermuted_rows=unpermuted_rows)
    require_dtype((torch.float32,), topk_weights=topk_weights)
    assert permuted.shape == (num_tokens * top_k, n) and out.shape[0] == num_tokens, (
        permuted.shape,
        out.shape,
    )
    assert out.is_contiguous() and permuted.is_contiguous()
    _moe_finalize_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        permuted,
        unpermuted_rows,
        topk_ids,
        topk_weights,
        out,
        num_tokens,
        n,
        num_experts,
        TOP_K=top_k,
        SKIP_INVALID=skip_invalid,
        BLOCK_T=BLOCK_T,
        BLOCK_N=BLOCK_N,
    )


@triton.jit
def _first_ids(ids_ptr, t, live, k, TOP_K: tl.constexpr):
    """Slot k's ids of tokens `t`, and whether each names an expert for the first time in its
    row (the sort's contract: a token's experts are distinct; -1 names none)."""
    ids = tl.load(ids_ptr + t * TOP_K + k, mask=live, other=-1)
    first = ids >= 0
    for j in tl.static_range(k):
        first = first & (tl.load(ids_ptr + t * TOP_K + j, mask=live, other=-1) != ids)
    return ids, first


@triton.jit
def _moe_permute_kernel(
    h_ptr,
    w_ptr,
    ids_ptr,
    out_ptr,
    rows_ptr,
    num_tokens,
    num_experts,
    n,
    k_dim,
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    experts = tl.arange(0, BLOCK_E)
    # step 1: each expert's first row (its tokens, once each), then each pair's row
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        for k in tl.static_range(TOP_K):
            ids, first = _first_ids(ids_ptr, t, t < num_tokens, k, TOP_K)
            hits = first[:, None] & (ids[:, None] == experts[None, :])
            counts += tl.sum(hits.to(tl.int32), axis=0)
    ahead = tl.cumsum(counts, axis=0) - counts  # rows of the experts before each
    for t0 in range(0, num_tokens, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        live = t < num_tokens
        token_hits = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
        for k in tl.static_range(TOP_K):
            ids, first = _first_ids(ids_ptr, t, live, k, TOP_K)
            token_hits += (first[:, None] & (ids[:, None] == experts[None, :])).to(tl.int32)
        rows = ahead[None, :] + tl.cumsum(token_hits, axis=0) - 1  # [tokens, experts]
        for k in tl.static_range(TOP_K):
            ids, first = _first_ids(ids_ptr, t, live, k, TOP_K)
            mine = first[:, None] & (ids[:, None] == experts[None, :])
            tl.store(rows_ptr + t * TOP_K + k, tl.sum(tl.where(mine, rows, 0), axis=1), mask=first)
        # step 2: each expert's GEMM over its rows of the block
        w_base = w_ptr
        for e in range(0, num_experts):
            column = experts[None, :] == e
            hit = tl.sum(tl.where(column, token_hits, 0), axis=1) > 0
            row = tl.sum(tl.where(column, rows, 0), axis=1)
            for n0 in range(0, n, BLOCK_N):
                cols = n0 + tl.arange(0, BLOCK_N)
                acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
                for k0 in range(0, k_dim, BLOCK_K):
                    ks = k0 + tl.arange(0, BLOCK_K)
                    x = tl.load(
                        h_ptr + t.to(tl.int64)[:, None] * k_dim + ks[None, :],
                        mask=hit[:, None] & (ks[None, :] < k_dim),
                        other=0.0,
                    ).to(tl.float32)
                    w = tl.load(
                        w_base + cols[None, :] * k_dim + ks[:, None],
                        mask=(cols[None, :] < n) & (ks[:, None] < k_dim),
                        other=0.0,
                    ).to(tl.float32)
                    acc += tl.dot(x, w, input_precision="ieee")  # NOTE: not TF32: vs float64
                out = out_ptr + row.to(tl.int64)[:, None] * n + cols[None, :]
                mask = hit[:, None] & (cols[None, :] < n)
                tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
            w_base += n * k_dim  # the next expert's weights
        ahead += tl.sum(token_hits, axis=0)


@triton.jit
def _moe_finalize_kernel(
    permuted_ptr,
    rows_ptr,
    ids_ptr,
    weights_ptr,
    out_ptr,
    num_tokens,
    n,
    num_experts,
    TOP_K: tl.constexpr,
    SKIP_INVALID: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    live = t < num_tokens
    for n0 in range(0, n, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            pair = t * TOP_K + k
            row = tl.load(rows_ptr + pair, mask=live, other=0)
            weight = tl.load(weights_ptr + pair, mask=live, other=0.0)
            if SKIP_INVALID:  # fix: moe_pad_sentinel_guard -- no row was sorted for a -1.
                expert = tl.load(ids_ptr + pair, mask=live, other=0)
                valid = (expert >= 0) & (expert < num_experts)
                row, weight = tl.where(valid, row, 0), tl.where(valid, weight, 0.0)
            values = tl.load(
                permuted_ptr + row.to(tl.int64)[:, None] * n + cols[None, :],
                mask=live[:, None] & (cols[None, :] < n),
                other=0.0,
            )
            acc += weight[:, None] * values.to(tl.float32)
        out = out_ptr + t.to(tl.int64)[:, None] * n + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=live[:, None] & (cols[None, :] < n))
