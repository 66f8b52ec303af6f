"""Punica-style LoRA shrink and expand: references, host wrappers, Triton kernels.

shrink: buffer[t] = scale * x[t] @ lora_a[lora(t)].T     (hidden -> rank)
expand: y[t]     += buffer[t] @ lora_b[lora(t)].T         (rank -> out)
Tokens are visited per LoRA through the kernel metadata of upstream's LoRAKernelMeta:
token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, active_lora_ids.
The grid has one program column per active-LoRA slot (max_loras + 1, capture-safe); a program
exits on lora_id == -1 or past its token count. The host wrappers return before launching when
no_lora_flag_cpu is set (or no LoRA is active): a host decision, so CUDA-graph capture freezes
it. Every launch goes through `launch(fn, *args)` so a graph emulation can record it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

Launch = Callable[..., None]
BLOCK_M, BLOCK_N, BLOCK_K = 16, 16, 32


def launch_now(fn: Callable[..., object], *args: object, **kwargs: object) -> None:
    """The eager `launch`: run device work at once."""
    fn(*args, **kwargs)


def on_grid(kernel, grid: tuple[int, ...]) -> Callable[..., None]:
    """kernel[grid] as a plain function that carries the kernel's name (for graph listings)."""

    def run(*args: object, **kwargs: object) -> None:
        kernel[grid](*args, **kwargs)

    run.__name__ = kernel.__name__
    return run


@dataclass(frozen=True, slots=True)
class KernelMeta:
    """The device and host tensors one shrink/expand call reads (upstream LoRAKernelMeta)."""

    token_lora_mapping: torch.Tensor  # [max_num_tokens] int32, LoRA slot per token, -1 = none
    token_indices_sorted_by_lora_ids: torch.Tensor  # [max_num_tokens] int32
    active_lora_ids: torch.Tensor  # [max_loras + 1] int32, -1 first when present
    num_tokens_per_lora: torch.Tensor  # [max_loras + 1] int32
    lora_token_start_loc: torch.Tensor  # [max_loras + 2] int32
    no_lora_flag_cpu: torch.Tensor  # [1] bool, host
    num_active_loras_cpu: torch.Tensor  # [1] int32, host


def lora_shrink_reference(x, lora_a, slots, scale) -> torch.Tensor:
    """[num_tokens, rank] in float64; rows of tokens without a LoRA are zero."""
    out = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64)
    for t, slot in enumerate(slots):
        if slot != -1:
            out[t] = scale * (x[t].double().cpu() @ lora_a[slot].double().cpu().T)
    return out


def lora_expand_reference(y, buffer, lora_b, slots) -> torch.Tensor:
    """y + per-token expand, in float64."""
    out = y.double().cpu().clone()
    for t, slot in enumerate(slots):
        if slot != -1:
            out[t] += buffer[t].double().cpu() @ lora_b[slot].double().cpu().T
    return out


def _skips_launch(meta: KernelMeta) -> bool:
    return bool(meta.no_lora_flag_cpu[0]) or int(meta.num_active_loras_cpu[0]) == 0


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, hidden] float32
    lora_a: torch.Tensor,  # [max_loras, rank, hidden] float32
    buffer: torch.Tensor,  # [>= num_tokens, rank] float32, LoRA rows written
    meta: KernelMeta,
    scale: float,
    launch: Launch = launch_now,
) -> None:
    if _skips_launch(meta):  # NOTE: host decision; frozen into a captured graph
        return
    num_tokens, hidden = x.shape
    max_loras, rank, _ = lora_a.shape
    assert lora_a.shape[2] == hidden and buffer.shape[1] == rank, (lora_a.shape, buffer.shape)
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(rank, BLOCK_N), max_loras + 1)
    launch(
        on_grid(_lora_shrink_kernel, grid),
        x,
        lora_a,
        buffer,
        meta.token_indices_sorted_by_lora_ids,
        meta.num_tokens_per_lora,
        meta.lora_token_start_loc,
        meta.active_lora_ids,
        scale,
        rank,
        hidden,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def lora_expand(
    buffer: torch.Tensor,  # [>= num_tokens, rank] float32
    lora_b: torch.Tensor,  # [max_loras, out_dim, rank] float32
    y: torch.Tensor,  # [num_tokens, out_dim] float32, LoRA rows accumulated in place
    meta: KernelMeta,
    launch: Launch = launch_now,
) -> None:
    if _skips_launch(meta):  # NOTE: host decision; frozen into a captured graph
        return
    num_tokens, out_dim = y.shape
    max_loras, _, rank = lora_b.shape
    assert lora_b.shape[1] == out_dim and buffer.shape[1] == rank, (lora_b.shape, buffer.shape)
    grid = (triton.cdiv(num_tokens, BLOCK_M), triton.cdiv(out_dim, BLOCK_N), max_loras + 1)
    launch(
        on_grid(_lora_expand_kernel, grid),
        buffer,
        lora_b,
        y,
        meta.token_indices_sorted_by_lora_ids,
        meta.num_tokens_per_lora,
        meta.lora_token_start_loc,
        meta.active_lora_ids,
        out_dim,
        rank,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


# NOTE: sizes that bound loops are constexpr (Triton 3.6's interpreter, see moe_lora_align.py).


@triton.jit
def _lora_rows(
    sorted_ptr, num_tokens_per_lora_ptr, start_loc_ptr, active_lora_ids_ptr, BLOCK_M: tl.constexpr
):
    """(lora_id, token rows of this program's block, row mask); lora_id -1 = nothing to do."""
    slot = tl.program_id(2)
    lora_id = tl.load(active_lora_ids_ptr + slot)
    count = tl.load(num_tokens_per_lora_ptr + slot)
    first = tl.program_id(0) * BLOCK_M
    offs = first + tl.arange(0, BLOCK_M)
    valid = offs < tl.where(lora_id == -1, 0, count)
    start = tl.load(start_loc_ptr + slot)
    rows = tl.load(sorted_ptr + start + offs, mask=valid, other=0).to(tl.int64)
    return tl.where(first < count, lora_id, -1), rows, valid


@triton.jit
def _rows_times_lora(
    in_ptr,
    w_ptr,
    rows,
    valid,
    lora_id,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(in[rows] @ W[lora_id].T) for this program's [BLOCK_M, BLOCK_N] tile; W is [N, K]."""
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    w = w_ptr + lora_id.to(tl.int64) * N * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            in_ptr + rows[:, None] * K + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            w + cols[None, :] * K + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a, b, input_precision="ieee")
    return acc, cols


@triton.jit
def _lora_shrink_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    sorted_ptr,
    num_tokens_per_lora_ptr,
    start_loc_ptr,
    active_lora_ids_ptr,
    scale,
    RANK: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    lora_id, rows, valid = _lora_rows(
        sorted_ptr, num_tokens_per_lora_ptr, start_loc_ptr, active_lora_ids_ptr, BLOCK_M
    )
    if lora_id == -1:
        return
    acc, cols = _rows_times_lora(
        x_ptr, w_ptr, rows, valid, lora_id, RANK, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K
    )
    mask = valid[:, None] & (cols[None, :] < RANK)
    tl.store(out_ptr + rows[:, None] * RANK + cols[None, :], acc * scale, mask=mask)


@triton.jit
def _lora_expand_kernel(
    buf_ptr,
    w_ptr,
    y_ptr,
    sorted_ptr,
    num_tokens_per_lora_ptr,
    start_loc_ptr,
    active_lora_ids_ptr,
    OUT_DIM: tl.constexpr,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    lora_id, rows, valid = _lora_rows(
        sorted_ptr, num_tokens_per_lora_ptr, start_loc_ptr, active_lora_ids_ptr, BLOCK_M
    )
    if lora_id == -1:
        return
    acc, cols = _rows_times_lora(
        buf_ptr, w_ptr, rows, valid, lora_id, OUT_DIM, RANK, BLOCK_M, BLOCK_N, BLOCK_K
    )
    out = y_ptr + rows[:, None] * OUT_DIM + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < OUT_DIM)
    tl.store(out, tl.load(out, mask=mask, other=0.0) + acc, mask=mask)
