"""Expert-parallel dispatch and expert-combine through peer memory (harness.runner.peer_memory).

Each rank owns `experts_per_rank` experts and a receive area per peer role: `recv_idx` (int32,
one entry per row) and `recv_x` (float32, `hidden` per row), both laid out per source rank:
rows [src * rows_per_rank, (src + 1) * rows_per_rank) are the source's, one row per token slot.
`rows_per_rank` is the geometry a rank passes at each launch (upstream: the one-sided MoE
all-to-all's `[ep_size, runtime_max_tokens_per_rank, hidden]` receive view over a fixed
workspace, SGLang #27945, #30450): every rank must pass the same number, or a sender writes
one place and a receiver reads another.

- `ep_dispatch`: program t of a sender writes slot t into every peer's rows: the token's local
  expert in the owner's `recv_idx` (and its hidden row in `recv_x`), -1 (skip) in the others'
  and for a padding slot (t at or past the live token count, a device scalar a graph replay
  reads). Every slot of the sender's rows is written, so a receiver of the same geometry never
  reads a row nobody wrote.
- `ep_expert_combine`: program (src, t) of a receiver reads its own row src * rows_per_rank + t;
  a row not -1 names a local expert whose weight it loads (an unchecked load at that index),
  and its product goes back into the source's `out` row t. A row nobody wrote holds the
  buffer's poison (int32 max): a wild weight address, the illegal address the geometry
  mismatch is on a GPU and a SIGSEGV in the interpreter.

Peer buffers are reached through address tables (int64, PeerMemory.table); the values a peer
wrote are loaded volatile. Cross-rank order is the caller's: a barrier between the two launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import require_power_of_two

SKIP = -1  # a row with no token for this rank's experts (a padding slot, or another owner's)
POISON_IDX = 2**31 - 1  # a receive row nobody wrote: int32 max, a wild expert index
_SKIP = tl.constexpr(SKIP)  # (a kernel reads globals only as constexprs)


@triton.jit(do_not_specialize=["rows_per_rank", "src_rank"])
def _ep_dispatch_kernel(
    x_ptr,  # [rows_per_rank, HIDDEN] float32: this rank's tokens (padding slots after the live)
    expert_ptr,  # [rows_per_rank] int32: each token's global expert
    num_tokens_ptr,  # [1] int32: the live tokens (a device scalar)
    idx_table_ptr,  # [EP] int64: every rank's recv_idx, as mapped here
    x_table_ptr,  # [EP] int64: every rank's recv_x
    rows_per_rank,
    src_rank,
    EP: tl.constexpr,
    EXPERTS_PER_RANK: tl.constexpr,
    HIDDEN: tl.constexpr,
):
    t = tl.program_id(0)
    slot = t < rows_per_rank  # (a warm-up launch has no slots)
    live = slot & (t < tl.load(num_tokens_ptr))
    expert = tl.load(expert_ptr + t, mask=slot, other=0)
    offs = tl.arange(0, HIDDEN)
    # (block masks: the interpreter refuses a scalar mask on a block of pointers)
    x = tl.load(x_ptr + t * HIDDEN + offs, mask=offs < tl.where(slot, HIDDEN, 0), other=0.0)
    row = src_rank * rows_per_rank + t
    for dst in tl.static_range(EP):
        mine = live & (expert // EXPERTS_PER_RANK == dst)
        local = tl.where(mine, expert % EXPERTS_PER_RANK, _SKIP)
        idx = tl.load(idx_table_ptr + dst).to(tl.pointer_type(tl.int32))
        rx = tl.load(x_table_ptr + dst).to(tl.pointer_type(tl.float32))
        tl.store(rx + row.to(tl.int64) * HIDDEN + offs, x, mask=offs < tl.where(mine, HIDDEN, 0))
        tl.store(idx + row, local, mask=slot)


@triton.jit(do_not_specialize=["rows_per_rank", "rank"])
def _ep_expert_combine_kernel(
    w_ptr,  # [EXPERTS_PER_RANK, HIDDEN, HIDDEN] float32: this rank's experts
    idx_table_ptr,  # [EP] int64
    x_table_ptr,  # [EP] int64
    out_table_ptr,  # [EP] int64: every rank's out rows [rows, HIDDEN] float32
    rows_per_rank,
    rank,
    HIDDEN: tl.constexpr,
):
    src = tl.program_id(0)
    t = tl.program_id(1)
    row = src * rows_per_rank + t
    idx = tl.load(idx_table_ptr + rank).to(tl.pointer_type(tl.int32))
    rx = tl.load(x_table_ptr + rank).to(tl.pointer_type(tl.float32))
    slot = t < rows_per_rank  # (a warm-up launch has no slots)
    local = tl.load(idx + row, mask=slot, other=_SKIP, volatile=True)
    take = slot & (local != _SKIP)
    k = tl.arange(0, HIDDEN)
    n = tl.arange(0, HIDDEN)
    x_row = rx + row.to(tl.int64) * HIDDEN + k
    width = tl.where(take, HIDDEN, 0)  # (block masks: the interpreter refuses a scalar mask)
    x = tl.load(x_row, mask=k < width, other=0.0, volatile=True)
    # an unchecked load at the row's expert: a poisoned row (nobody wrote it) is a wild address
    base = local.to(tl.int64) * HIDDEN * HIDDEN
    w_mask = (k[:, None] < width) & (n[None, :] < HIDDEN)
    w = tl.load(w_ptr + base + k[:, None] * HIDDEN + n[None, :], mask=w_mask, other=0.0)
    y = tl.sum(x[:, None] * w, axis=0)
    out = tl.load(out_table_ptr + src).to(tl.pointer_type(tl.float32))
    tl.store(out + t * HIDDEN + n, y, mask=n < width)


def ep_dispatch(
    x: torch.Tensor,
    experts: torch.Tensor,
    num_tokens: torch.Tensor,
    idx_table: torch.Tensor,
    x_table: torch.Tensor,
    rows_per_rank: int,
    src_rank: int,
    experts_per_rank: int,
) -> None:
    """Write this rank's `rows_per_rank` token slots into every rank's receive rows (the
    sender's geometry: rows src_rank * rows_per_rank on). rows_per_rank 0: nothing (a warm-up
    that compiles)."""
    hidden = x.shape[-1]
    require_power_of_two(hidden=hidden)
    ep = idx_table.numel()
    _ep_dispatch_kernel[(max(rows_per_rank, 1),)](
        x,
        experts,
        num_tokens,
        idx_table,
        x_table,
        rows_per_rank,
        src_rank,
        EP=ep,
        EXPERTS_PER_RANK=experts_per_rank,
        HIDDEN=hidden,
    )


def ep_expert_combine(
    weights: torch.Tensor,
    idx_table: torch.Tensor,
    x_table: torch.Tensor,
    out_table: torch.Tensor,
    rows_per_rank: int,
    rank: int,
) -> None:
    """Run this rank's experts on its receive rows (the receiver's geometry) and write each
    product into its source's out row. rows_per_rank 0: nothing (a warm-up that compiles)."""
    hidden = weights.shape[-1]
    require_power_of_two(hidden=hidden)
    ep = idx_table.numel()
    _ep_expert_combine_kernel[(ep, max(rows_per_rank, 1))](
        weights, idx_table, x_table, out_table, rows_per_rank, rank, HIDDEN=hidden
    )
