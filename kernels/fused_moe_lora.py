"""Fused MoE-LoRA shrink: the consumer of the align outputs (vLLM's fused_moe_lora, shrink half).

For every (token, top-k) pair owned by an enabled LoRA, out[pair] = x[token] @ lora_a[lora,
expert].T. The kernel trusts the align outputs as upstream does: each program takes a slot of
`lora_ids` (grid covers max_loras + 1), reads that LoRA's padded count, the expert of its block,
and the pair indices of its block, then loads the expert's weights. Rows of base-model pairs
(and of pairs whose slot it skips) keep what `out` held.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 128


def fused_moe_lora_shrink_reference(
    x: torch.Tensor,  # [num_tokens, K]
    lora_a: torch.Tensor,  # [max_loras, num_experts, rank, K]
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    token_lora_mapping: torch.Tensor,  # [num_tokens]
    adapter_enabled: torch.Tensor,  # [max_loras + 1]
    prefill: torch.Tensor,  # [num_tokens * top_k, rank]
) -> torch.Tensor:
    """Dense per-pair shrink in float64, on the CPU."""
    out = prefill.detach().cpu().double().clone()
    x64, w64 = x.detach().cpu().double(), lora_a.detach().cpu().double()
    top_k = topk_ids.shape[1]
    experts = topk_ids.cpu().reshape(-1).tolist()
    owners = token_lora_mapping.cpu().tolist()
    enabled = adapter_enabled.cpu().tolist()
    for pair, expert in enumerate(experts):
        lid = owners[pair // top_k]
        if lid != -1 and enabled[lid] != 0:
            out[pair] = x64[pair // top_k] @ w64[lid, expert].T
    return out


def fused_moe_lora_shrink(
    x: torch.Tensor,  # [num_tokens, K] float32
    lora_a: torch.Tensor,  # [max_loras, num_experts, rank, K] float32
    sorted_token_ids: torch.Tensor,  # [max_loras, max_num_tokens_padded] int32
    expert_ids: torch.Tensor,  # [max_loras, max_num_m_blocks] int32
    num_tokens_post_pad: torch.Tensor,  # [max_loras] int32
    lora_ids: torch.Tensor,  # [max_loras + 1] int32
    adapter_enabled: torch.Tensor,  # [max_loras + 1] int32
    out: torch.Tensor,  # [num_tokens * top_k, rank] float32, LoRA pairs overwritten
    *,
    top_k: int,
    block_size: int,
) -> None:
    num_tokens, hidden = x.shape
    max_loras, _, rank, _ = lora_a.shape
    for name, t in (("x", x), ("lora_a", lora_a), ("out", out)):
        assert t.dtype == torch.float32 and t.is_contiguous(), f"{name}: float32 contiguous"
    assert lora_a.shape[3] == hidden, (lora_a.shape, hidden)
    assert out.shape == (num_tokens * top_k, rank), (out.shape, num_tokens, top_k, rank)
    assert sorted_token_ids.shape[0] == expert_ids.shape[0] == max_loras
    assert lora_ids.shape == (max_loras + 1,), lora_ids.shape
    assert block_size >= 16 and rank >= 16, "tl.dot needs blocks of at least 16"
    m_blocks = expert_ids.shape[1]
    block_n = min(triton.next_power_of_2(rank), 64)
    grid = (m_blocks, triton.cdiv(rank, block_n), max_loras + 1)
    _fused_moe_lora_shrink_kernel[grid](
        x,
        lora_a,
        out,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_pad,
        lora_ids,
        adapter_enabled,
        num_tokens * top_k,
        top_k,
        hidden,
        rank,
        sorted_token_ids.shape[1],
        m_blocks,
        lora_a.stride(0),
        lora_a.stride(1),
        lora_a.stride(2),
        BLOCK_M=block_size,
        BLOCK_N=block_n,
        BLOCK_K=BLOCK_K,
    )


@triton.jit
def _fused_moe_lora_shrink_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_pad_ptr,
    lora_ids_ptr,
    adapter_enabled_ptr,
    numel,
    top_k,
    HIDDEN: tl.constexpr,
    rank,
    max_num_tokens_padded,
    max_num_m_blocks,
    stride_wl,
    stride_we,
    stride_wr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    lora_id = tl.load(lora_ids_ptr + tl.program_id(2))
    if lora_id == -1:
        return
    if tl.load(adapter_enabled_ptr + lora_id) == 0:
        return
    lora = lora_id.to(tl.int64)
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_pad_ptr + lora):
        return
    expert = tl.load(expert_ids_ptr + lora * max_num_m_blocks + pid_m).to(tl.int64)
    if expert == -1:
        return
    pairs = tl.load(
        sorted_token_ids_ptr
        + lora * max_num_tokens_padded
        + pid_m * BLOCK_M
        + tl.arange(0, BLOCK_M)
    )
    valid = pairs < numel
    tokens = (pairs // top_k).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + lora * stride_wl + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            x_ptr + tokens[:, None] * HIDDEN + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < HIDDEN),
            other=0.0,
        )
        b = tl.load(
            w_base + cols[None, :] * stride_wr + ks[:, None],
            mask=(cols[None, :] < rank) & (ks[:, None] < HIDDEN),
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision="ieee")  # NOTE: not TF32: compared in float64
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * rank + cols[None, :]
    tl.store(out_ptrs, acc, mask=valid[:, None] & (cols[None, :] < rank))
