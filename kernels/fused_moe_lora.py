"""Fused MoE-LoRA shrink and expand: the consumers of the align outputs (vLLM's fused_moe_lora).

For every (token, top-k) pair owned by an enabled LoRA:
  shrink  out[pair] = x[token] @ lora_a[lora, expert].T                  (rank wide)
  expand  out[pair] = scale * shrunk[pair] @ lora_b[lora, expert].T      (hidden wide)
One kernel serves both, as upstream's does. It trusts the align outputs: each program takes a
slot of `lora_ids` (the z axis of the grid), reads that LoRA's padded count, the expert of its
block and the pair indices of its block, then loads the expert's weights. Rows of base-model
pairs (and of pairs whose slot it skips) keep what `out` held.

`lora_ids` has max_loras + 1 entries and -1 (the base model) sorts first, so the z axis must
cover max_loras + 1 slots (vLLM #32277); a program whose id is not below max_loras returns
before it indexes anything (the explicit bound the kernel carries).

Dtypes are upstream's (its tests run float16 and bfloat16): each of the input, the weights and
the output in float32, float16 or bfloat16; tiles are loaded in their dtype and multiplied in
float32, and each store rounds once to the output's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype, require_power_of_two

BLOCK_K = 128


@dataclass(frozen=True, slots=True)
class ConsumerFixes:
    """The fix parts of vLLM #32277 as launch and kernel switches (all on = fixed)."""

    grid_plus_one: bool = True  # moe_lora_grid_plus_one
    id_guard: bool = True  # moe_lora_id_guard


def _pairs_reference(topk_ids, token_lora_mapping, adapter_enabled):
    """(pair, token, expert, lora) of every pair an enabled LoRA owns."""
    top_k = topk_ids.shape[1]
    owners, enabled = token_lora_mapping.cpu().tolist(), adapter_enabled.cpu().tolist()
    for pair, expert in enumerate(topk_ids.cpu().reshape(-1).tolist()):
        lora = owners[pair // top_k]
        if lora != -1 and enabled[lora] != 0:
            yield pair, pair // top_k, expert, lora


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
    owned = _pairs_reference(topk_ids, token_lora_mapping, adapter_enabled)
    for pair, token, expert, lora in owned:
        out[pair] = x64[token] @ w64[lora, expert].T
    return out


def fused_moe_lora_expand_reference(
    shrunk: torch.Tensor,  # [num_tokens * top_k, rank]
    lora_b: torch.Tensor,  # [max_loras, num_experts, hidden, rank]
    topk_ids: torch.Tensor,
    token_lora_mapping: torch.Tensor,
    adapter_enabled: torch.Tensor,
    prefill: torch.Tensor,  # [num_tokens * top_k, hidden]
    scale: float,
) -> torch.Tensor:
    """Dense per-pair expand in float64, on the CPU."""
    out = prefill.detach().cpu().double().clone()
    s64, w64 = shrunk.detach().cpu().double(), lora_b.detach().cpu().double()
    for pair, _, expert, lora in _pairs_reference(topk_ids, token_lora_mapping, adapter_enabled):
        out[pair] = scale * (s64[pair] @ w64[lora, expert].T)
    return out


def _grid_slots(max_loras: int, fixes: ConsumerFixes) -> int:
    # fix: moe_lora_grid_plus_one -- lora_ids has max_loras + 1 entries and -1 sorts first.
    return max_loras + 1 if fixes.grid_plus_one else max_loras


def fused_moe_lora_shrink(
    x: torch.Tensor,  # [num_tokens, K] FLOAT_DTYPES
    lora_a: torch.Tensor,  # [max_loras, num_experts, rank, K] FLOAT_DTYPES
    sorted_token_ids: torch.Tensor,  # [max_loras, max_num_tokens_padded] int32
    expert_ids: torch.Tensor,  # [max_loras, max_num_m_blocks] int32
    num_tokens_post_pad: torch.Tensor,  # [max_loras] int32
    lora_ids: torch.Tensor,  # [max_loras + 1] int32
    adapter_enabled: torch.Tensor,  # [max_loras + 1] int32
    out: torch.Tensor,  # [num_tokens * top_k, rank] FLOAT_DTYPES, LoRA pairs overwritten
    *,
    top_k: int,
    block_size: int,
    fixes: ConsumerFixes = ConsumerFixes(),
) -> None:
    num_tokens, hidden = x.shape
    max_loras, _, rank, _ = lora_a.shape
    assert lora_a.shape[3] == hidden, (lora_a.shape, hidden)
    assert out.shape == (num_tokens * top_k, rank), (out.shape, num_tokens, top_k, rank)
    slots = _grid_slots(max_loras, fixes)
    align = (sorted_token_ids, expert_ids, num_tokens_post_pad, lora_ids, adapter_enabled)
    _launch(x, lora_a, out, align, slots, top_k, 1.0, block_size, fixes)


def fused_moe_lora_expand(
    shrunk: torch.Tensor,  # [num_tokens * top_k, rank] FLOAT_DTYPES
    lora_b: torch.Tensor,  # [max_loras, num_experts, hidden, rank] FLOAT_DTYPES
    sorted_token_ids: torch.Tensor,
    expert_ids: torch.Tensor,
    num_tokens_post_pad: torch.Tensor,
    lora_ids: torch.Tensor,
    adapter_enabled: torch.Tensor,
    out: torch.Tensor,  # [num_tokens * top_k, hidden] FLOAT_DTYPES, LoRA pairs overwritten
    *,
    scale: float,
    block_size: int,
    fixes: ConsumerFixes = ConsumerFixes(),
) -> None:
    max_loras, _, hidden, rank = lora_b.shape
    assert shrunk.shape[1] == rank and out.shape == (shrunk.shape[0], hidden), (
        shrunk.shape,
        out.shape,
        lora_b.shape,
    )
    slots = _grid_slots(max_loras, fixes)
    align = (sorted_token_ids, expert_ids, num_tokens_post_pad, lora_ids, adapter_enabled)
    _launch(shrunk, lora_b, out, align, slots, 1, scale, block_size, fixes)


def _launch(a, w, out, align, slots, row_div, scale, block_size, fixes: ConsumerFixes) -> None:
    """out[pair] = scale * a[pair // row_div] @ w[lora, expert].T for every pair of a block
    of a slot; w [max_loras, num_experts, N, K]."""
    sorted_token_ids, expert_ids, num_tokens_post_pad, lora_ids, adapter_enabled = align
    max_loras, _, n, k = w.shape
    require_dtype(FLOAT_DTYPES, a=a, w=w, out=out)
    for name, t in (("a", a), ("w", w), ("out", out)):
        assert t.is_contiguous(), f"{name}: contiguous"
    assert a.shape[1] == k, (a.shape, w.shape)
    assert sorted_token_ids.shape[0] == expert_ids.shape[0] == max_loras
    assert lora_ids.shape == (max_loras + 1,), lora_ids.shape
    if block_size < 16:  # NOTE: the align outputs' block is the dot's M, as upstream's
        raise ValueError(f"block_size = {block_size}: tl.dot needs M >= 16; cannot serve")
    require_power_of_two(block_size=block_size)
    m_blocks = expert_ids.shape[1]
    # NOTE: tl.dot needs N and K blocks >= 16: a rank below 16 (N of the shrink, K of the
    # expand) gets a block of 16 whose columns past it are masked (loaded as 0, never stored)
    block_n = max(16, min(triton.next_power_of_2(n), 64))
    _fused_moe_lora_kernel[(m_blocks, triton.cdiv(n, block_n), slots)](
        a,
        w,
        out,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_pad,
        lora_ids,
        adapter_enabled,
        out.shape[0],
        max_loras,
        row_div,
        scale,
        n,
        sorted_token_ids.shape[1],
        m_blocks,
        w.stride(0),
        w.stride(1),
        w.stride(2),
        K=k,
        ID_GUARD=fixes.id_guard,
        BLOCK_M=block_size,
        BLOCK_N=block_n,
        BLOCK_K=max(16, min(BLOCK_K, triton.next_power_of_2(k))),
    )


@triton.jit
def _fused_moe_lora_kernel(
    a_ptr,
    w_ptr,
    out_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_pad_ptr,
    lora_ids_ptr,
    adapter_enabled_ptr,
    numel,
    max_loras,
    row_div,
    scale,
    n,
    max_num_tokens_padded,
    max_num_m_blocks,
    stride_wl,
    stride_we,
    stride_wn,
    K: tl.constexpr,
    ID_GUARD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    lora_id = tl.load(lora_ids_ptr + tl.program_id(2))
    if lora_id == -1:
        return
    # NOTE: nested: a constexpr switch, then a runtime test (Triton's `and` wants both alike)
    if ID_GUARD:  # noqa: SIM102  # fix: moe_lora_id_guard -- a stray id indexes missing rows.
        if lora_id >= max_loras:
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
    rows = (pairs // row_div).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    w_base = w_ptr + lora * stride_wl + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + rows[:, None] * K + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        b = tl.load(
            w_base + cols[None, :] * stride_wn + ks[:, None],
            mask=(cols[None, :] < n) & (ks[:, None] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.dot(a, b, input_precision="ieee")  # NOTE: not TF32: compared in float64
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * n + cols[None, :]
    value = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out_ptrs, value, mask=valid[:, None] & (cols[None, :] < n))
