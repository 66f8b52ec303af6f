"""Punica-style LoRA shrink and expand: references, host wrappers, Triton kernels.

Per slice s of a layer (one for a plain projection, more for a fused one such as gate|up):
shrink: buffer[s, t] = scale * x[t] @ lora_a[s, lora(t)].T          (hidden -> rank)
expand: y[t, cols of s] += buffer[s, t] @ lora_b[s, lora(t)].T      (rank -> slice width)
Tokens are visited per LoRA through the kernel metadata of upstream's LoRAKernelMeta:
token_indices_sorted_by_lora_ids, num_tokens_per_lora, lora_token_start_loc, active_lora_ids.
The grid is tiles x slices x LoRA programs; a program exits on lora_id == -1 or past its
token count. Two launch modes, as upstream's: by default one LoRA program per slot of
active_lora_ids (max_loras + 1), whatever the batch, so a captured grid fits any batch;
specialised (`specialize=True`), num_active_loras_cpu programs, so a graph captured for that
count serves batches of at most that many active ids. The host wrappers return before
launching when no_lora_flag_cpu is set (specialised: also when num_active_loras_cpu is 0): a
host decision, so CUDA-graph capture freezes it. Every launch goes through `launch(fn, *args)`
so a graph emulation can record it.

Dtypes are upstream's: x, the weights and y in float32, float16 or bfloat16, the shrink's buffer
in any of them (upstream's is float32); tiles are loaded in their dtype and multiplied in
float32 (upstream's expand casts a float32 buffer down to the weights' dtype instead), and each
store rounds once to its tensor's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.launch import FLOAT_DTYPES, require_dtype

Launch = Callable[..., None]
BLOCK_M, BLOCK_K = 16, 32
# NOTE: the N tile spans the rank (shrink) or a slice's width (expand); upstream's default
# configs take wide N tiles for expand. Wider tiles mean fewer programs: each program costs the
# interpreter (CPU runs) about as much whatever its tile, and the GPU computes the same sums.
SHRINK_BLOCK_N, EXPAND_BLOCK_N = 32, 64


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
    """[num_slices, num_tokens, rank] in float64; rows of tokens without a LoRA are zero."""
    num_slices, _, rank, _ = lora_a.shape
    out = torch.zeros(num_slices, x.shape[0], rank, dtype=torch.float64)
    for s in range(num_slices):
        for t, slot in enumerate(slots):
            if slot != -1:
                out[s, t] = scale * (x[t].double().cpu() @ lora_a[s, slot].double().cpu().T)
    return out


def lora_expand_reference(y, buffer, lora_b, slots) -> torch.Tensor:
    """y + per-token expand of every slice into its columns, in float64."""
    out = y.double().cpu().clone()
    width = lora_b.shape[2]
    for s in range(lora_b.shape[0]):
        for t, slot in enumerate(slots):
            if slot != -1:
                delta = buffer[s, t].double().cpu() @ lora_b[s, slot].double().cpu().T
                out[t, s * width : (s + 1) * width] += delta
    return out


def lora_programs(meta: KernelMeta, max_loras: int, specialize: bool) -> int:
    """LoRA programs (grid z) of a launch; 0: the host wrapper returns without launching."""
    if bool(meta.no_lora_flag_cpu[0]):  # NOTE: host decisions; frozen into a captured graph
        return 0
    return int(meta.num_active_loras_cpu[0]) if specialize else max_loras + 1


def lora_shrink(
    x: torch.Tensor,  # [num_tokens, hidden] FLOAT_DTYPES
    lora_a: torch.Tensor,  # [num_slices, max_loras, rank, hidden] x's dtype
    buffer: torch.Tensor,  # [num_slices, >= num_tokens, rank] FLOAT_DTYPES, LoRA rows written
    meta: KernelMeta,
    scale: float,
    launch: Launch = launch_now,
    specialize: bool = False,
) -> None:
    num_tokens, hidden = x.shape
    num_slices, max_loras, rank, _ = lora_a.shape
    programs = lora_programs(meta, max_loras, specialize)
    if programs == 0:
        return
    assert lora_a.shape[3] == hidden, (lora_a.shape, hidden)
    assert buffer.shape[0] == num_slices and buffer.shape[2] == rank, (buffer.shape, rank)
    require_dtype(FLOAT_DTYPES, x=x, buffer=buffer)
    require_dtype((x.dtype,), lora_a=lora_a)
    m_tiles = triton.cdiv(num_tokens, BLOCK_M)
    grid = (m_tiles * triton.cdiv(rank, SHRINK_BLOCK_N), num_slices, programs)
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
        m_tiles,
        max_loras,
        buffer.stride(0),
        rank,
        hidden,
        BLOCK_M=BLOCK_M,
        BLOCK_N=SHRINK_BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def lora_expand(
    buffer: torch.Tensor,  # [num_slices, >= num_tokens, rank] FLOAT_DTYPES
    lora_b: torch.Tensor,  # [num_slices, max_loras, slice_width, rank] FLOAT_DTYPES
    y: torch.Tensor,  # [num_tokens, num_slices * slice_width] lora_b's dtype, accumulated in place
    meta: KernelMeta,
    launch: Launch = launch_now,
    specialize: bool = False,
) -> None:
    num_tokens, out_dim = y.shape
    num_slices, max_loras, width, rank = lora_b.shape
    programs = lora_programs(meta, max_loras, specialize)
    if programs == 0:
        return
    assert num_slices * width == out_dim and y.is_contiguous(), (lora_b.shape, y.shape)
    assert buffer.shape[0] == num_slices and buffer.shape[2] == rank, (buffer.shape, rank)
    require_dtype(FLOAT_DTYPES, buffer=buffer, lora_b=lora_b)
    require_dtype((lora_b.dtype,), y=y)
    m_tiles = triton.cdiv(num_tokens, BLOCK_M)
    grid = (m_tiles * triton.cdiv(width, EXPAND_BLOCK_N), num_slices, programs)
    launch(
        on_grid(_lora_expand_kernel, grid),
        buffer,
        lora_b,
        y,
        meta.token_indices_sorted_by_lora_ids,
        meta.num_tokens_per_lora,
        meta.lora_token_start_loc,
        meta.active_lora_ids,
        m_tiles,
        max_loras,
        buffer.stride(0),
        out_dim,
        width,
        rank,
        BLOCK_M=BLOCK_M,
        BLOCK_N=EXPAND_BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


# NOTE: sizes that bound loops are constexpr (Triton 3.6's interpreter, see moe_lora_align.py);
# the others are runtime values, so that a new output width compiles nothing new.


@triton.jit
def _lora_rows(
    sorted_ptr,
    num_tokens_per_lora_ptr,
    start_loc_ptr,
    active_lora_ids_ptr,
    m_tiles,
    BLOCK_M: tl.constexpr,
):
    """(lora_id, token rows of this program's tile, row mask, tile column); lora_id -1: no work."""
    slot = tl.program_id(2)
    lora_id = tl.load(active_lora_ids_ptr + slot)
    count = tl.load(num_tokens_per_lora_ptr + slot)
    first = (tl.program_id(0) % m_tiles) * BLOCK_M
    offs = first + tl.arange(0, BLOCK_M)
    valid = offs < tl.where(lora_id == -1, 0, count)
    start = tl.load(start_loc_ptr + slot)
    rows = tl.load(sorted_ptr + start + offs, mask=valid, other=0).to(tl.int64)
    return tl.where(first < count, lora_id, -1), rows, valid, tl.program_id(0) // m_tiles


@triton.jit
def _rows_times_lora(
    in_ptr,
    w_ptr,
    rows,
    valid,
    pid_n,
    N,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """(in[rows] @ W.T in float32, cols) for this program's [BLOCK_M, BLOCK_N] tile; W is
    [N, K]."""
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            in_ptr + rows[:, None] * K + ks[None, :],
            mask=valid[:, None] & (ks[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        b = tl.load(
            w_ptr + cols[None, :] * K + ks[:, None],
            mask=(cols[None, :] < N) & (ks[:, None] < K),
            other=0.0,
        ).to(tl.float32)
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
    m_tiles,
    max_loras,
    out_slice_stride,
    RANK: tl.constexpr,
    HIDDEN: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    lora_id, rows, valid, pid_n = _lora_rows(
        sorted_ptr, num_tokens_per_lora_ptr, start_loc_ptr, active_lora_ids_ptr, m_tiles, BLOCK_M
    )
    if lora_id == -1:
        return
    s = tl.program_id(1).to(tl.int64)
    w = w_ptr + (s * max_loras + lora_id) * RANK * HIDDEN
    acc, cols = _rows_times_lora(
        x_ptr, w, rows, valid, pid_n, RANK, HIDDEN, BLOCK_M, BLOCK_N, BLOCK_K
    )
    out = out_ptr + s * out_slice_stride + rows[:, None] * RANK + cols[None, :]
    value = (acc * scale).to(out_ptr.dtype.element_ty)
    tl.store(out, value, mask=valid[:, None] & (cols[None, :] < RANK))


@triton.jit
def _lora_expand_kernel(
    buf_ptr,
    w_ptr,
    y_ptr,
    sorted_ptr,
    num_tokens_per_lora_ptr,
    start_loc_ptr,
    active_lora_ids_ptr,
    m_tiles,
    max_loras,
    buf_slice_stride,
    out_dim,
    width,
    RANK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    lora_id, rows, valid, pid_n = _lora_rows(
        sorted_ptr, num_tokens_per_lora_ptr, start_loc_ptr, active_lora_ids_ptr, m_tiles, BLOCK_M
    )
    if lora_id == -1:
        return
    s = tl.program_id(1).to(tl.int64)
    w = w_ptr + (s * max_loras + lora_id) * width * RANK
    acc, cols = _rows_times_lora(
        buf_ptr + s * buf_slice_stride,
        w,
        rows,
        valid,
        pid_n,
        width,
        RANK,
        BLOCK_M,
        BLOCK_N,
        BLOCK_K,
    )
    out = y_ptr + rows[:, None] * out_dim + s * width + cols[None, :]
    mask = valid[:, None] & (cols[None, :] < width)
    value = tl.load(out, mask=mask, other=0.0).to(tl.float32) + acc
    tl.store(out, value.to(y_ptr.dtype.element_ty), mask=mask)
