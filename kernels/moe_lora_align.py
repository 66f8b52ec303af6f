"""MoE-LoRA align-block-size family: reference, launcher, and the Triton twin of csrc/.

For every active LoRA slot the align step groups the flattened (token, top-k) pairs owned by that
LoRA by expert, pads each expert's group to a multiple of `block_size`, and writes per LoRA id:
  sorted_token_ids[lora_id]    # [max_num_tokens_padded] pair indices, padding = numel
  expert_ids[lora_id]          # [max_num_m_blocks] expert of each block, -1 past the end
  num_tokens_post_pad[lora_id] # padded pair count
Slots come from `lora_ids` (upstream: `active_lora_ids`, [max_loras + 1], -1 sorts first).
Two paths, as upstream: one small-batch kernel (numel < 1024 and E <= 64), else an align kernel
with two programs per slot plus a count-and-sort kernel that places pairs with atomics.
The same three fix parts switch both backends (Triton here, CUDA C++ in csrc/moe_lora_align.cu).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import launch  # noqa: F401  # the interpreter's patches (CPU runs)

SMALL_BATCH_MAX_NUMEL = 1024  # small path: numel < this and E <= SMALL_BATCH_MAX_EXPERTS
SMALL_BATCH_MAX_EXPERTS = 64
SMALL_BATCH_CHUNK = 128  # pairs per one-hot tile: [128, 64] int32 is 32 KiB
SORT_CHUNK = 256


@dataclass(frozen=True, slots=True)
class AlignFixes:
    """The fix parts of vLLM #40131 as kernel switches (all on = fixed)."""

    grid_plus_one: bool = True  # moe_align_grid_plus_one
    oob_guard: bool = True  # moe_align_oob_guard
    sort_adapter_check: bool = True  # moe_align_sort_adapter_check


def align_sizes(numel: int, num_experts: int, block_size: int) -> tuple[int, int]:
    """(max_num_tokens_padded, max_num_m_blocks) for one LoRA row."""
    padded = triton.cdiv(numel + num_experts * (block_size - 1), block_size) * block_size
    return padded, padded // block_size


def is_small_batch(numel: int, num_experts: int) -> bool:
    return numel < SMALL_BATCH_MAX_NUMEL and num_experts <= SMALL_BATCH_MAX_EXPERTS


# ---------------------------------------------------------------------------------------------
# Reference (pure torch, fixed semantics)
# ---------------------------------------------------------------------------------------------


def processed_lora_ids(lora_ids: torch.Tensor, adapter_enabled: torch.Tensor, max_loras: int):
    """LoRA ids whose rows the fixed kernels write: active, in range, enabled."""
    enabled = adapter_enabled.tolist()
    return [lid for lid in lora_ids.tolist() if lid != -1 and lid < max_loras and enabled[lid] != 0]


def moe_lora_align_reference(
    topk_ids: torch.Tensor,  # [num_tokens, top_k]
    token_lora_mapping: torch.Tensor,  # [num_tokens]
    lora_ids: torch.Tensor,  # [max_loras + 1]
    adapter_enabled: torch.Tensor,  # [max_loras + 1]
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    *,
    num_experts: int,
    block_size: int,
    max_loras: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Expected (sorted_token_ids, expert_ids, num_tokens_post_pad) given the prefilled outputs.

    Rows of unprocessed ids keep their prefill; within an expert, pairs ascend. Pairs whose
    expert is outside [0, num_experts) are in no block. Vectorized per row: upstream's largest
    shape (81920 tokens, 512 experts, 32 LoRAs) takes well under a second.
    """
    sorted_ids, expert_ids, post_pad = (t.detach().cpu().clone() for t in prefill)
    experts = topk_ids.detach().cpu().reshape(-1).long()
    owners = token_lora_mapping.detach().cpu().long().repeat_interleave(topk_ids.shape[1])
    numel = experts.numel()
    for lid in processed_lora_ids(lora_ids.cpu(), adapter_enabled.cpu(), max_loras):
        pairs = torch.nonzero((owners == lid) & (experts >= 0) & (experts < num_experts))
        pairs = pairs.flatten()  # ascending
        mine, order = torch.sort(experts[pairs], stable=True)  # by expert, pairs still ascending
        pairs = pairs[order]
        counts = torch.bincount(mine, minlength=num_experts)
        padded = (counts + block_size - 1) // block_size * block_size
        first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in `pairs`
        start = torch.cumsum(padded, 0) - padded  # where its segment starts in the row
        total = int(padded.sum())
        row = torch.full((total,), numel, dtype=sorted_ids.dtype)
        row[start[mine] + torch.arange(len(pairs)) - first[mine]] = pairs.to(row.dtype)
        blocks = torch.repeat_interleave(torch.arange(num_experts), padded // block_size)
        sorted_ids[lid] = numel
        sorted_ids[lid, :total] = row
        expert_ids[lid] = -1
        expert_ids[lid, : len(blocks)] = blocks.to(expert_ids.dtype)
        post_pad[lid] = total
    return sorted_ids, expert_ids, post_pad


def canonical_sorted_ids(
    sorted_ids: torch.Tensor,  # [rows, max_num_tokens_padded]
    expert_ids: torch.Tensor,  # [rows, max_num_m_blocks]
    rows: list[int],
    block_size: int,
) -> torch.Tensor:
    """Sort each expert's segment of the given rows (the atomic path places pairs in any order)."""
    out = sorted_ids.detach().cpu().clone()
    experts = expert_ids.detach().cpu()
    for r in rows:
        blocks = experts[r].tolist()
        start = 0
        while start < len(blocks) and blocks[start] != -1:
            end = start
            while end < len(blocks) and blocks[end] == blocks[start]:
                end += 1
            lo, hi = start * block_size, end * block_size
            out[r, lo:hi] = out[r, lo:hi].sort().values
            start = end
    return out


# ---------------------------------------------------------------------------------------------
# Launcher: one dispatch point for both backends
# ---------------------------------------------------------------------------------------------


def moe_lora_align_block_size(
    topk_ids: torch.Tensor,  # [num_tokens, top_k] int32
    token_lora_mapping: torch.Tensor,  # [num_tokens] int32, -1 = base model
    lora_ids: torch.Tensor,  # [max_loras + 1] int32, upstream active_lora_ids
    adapter_enabled: torch.Tensor,  # [>= max_loras + 1] int32
    sorted_token_ids: torch.Tensor,  # [max_loras, max_num_tokens_padded] int32, written
    expert_ids: torch.Tensor,  # [max_loras, max_num_m_blocks] int32, written
    num_tokens_post_pad: torch.Tensor,  # [max_loras] int32, written
    *,
    num_experts: int,
    block_size: int,
    max_loras: int,
    fixes: AlignFixes = AlignFixes(),
    backend: str = "triton",
    token_mask: torch.Tensor | None = None,  # [max_loras, numel] int32 workspace (large path)
    cumsum: torch.Tensor | None = None,  # [max_loras, num_experts + 1] int32 workspace, zeroed
) -> None:
    """Align every slot of `lora_ids`; workspaces default as upstream (empty mask, zero cumsum)."""
    num_tokens, _ = topk_ids.shape
    numel = topk_ids.numel()
    padded, m_blocks = align_sizes(numel, num_experts, block_size)
    for name, t in (
        ("topk_ids", topk_ids),
        ("token_lora_mapping", token_lora_mapping),
        ("lora_ids", lora_ids),
        ("adapter_enabled", adapter_enabled),
        ("sorted_token_ids", sorted_token_ids),
        ("expert_ids", expert_ids),
        ("num_tokens_post_pad", num_tokens_post_pad),
    ):
        assert t.dtype == torch.int32 and t.is_contiguous(), f"{name}: int32 contiguous expected"
        assert t.device == topk_ids.device, f"{name} on {t.device}, topk_ids on {topk_ids.device}"
    assert token_lora_mapping.shape == (num_tokens,), token_lora_mapping.shape
    assert lora_ids.shape == (max_loras + 1,), lora_ids.shape
    assert sorted_token_ids.shape == (max_loras, padded), (sorted_token_ids.shape, padded)
    assert expert_ids.shape == (max_loras, m_blocks), (expert_ids.shape, m_blocks)
    assert num_tokens_post_pad.shape == (max_loras,), num_tokens_post_pad.shape
    if token_mask is None:
        token_mask = torch.empty(max_loras, numel, dtype=torch.int32, device=topk_ids.device)
    if cumsum is None:
        cumsum = torch.zeros(max_loras, num_experts + 1, dtype=torch.int32, device=topk_ids.device)
    args = (
        topk_ids,
        token_lora_mapping,
        lora_ids,
        adapter_enabled,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_pad,
        token_mask,
        cumsum,
    )
    if backend == "cuda":
        from kernels import csrc

        shapes = (
            (num_tokens, topk_ids.shape[1]),
            (num_tokens,),
            (max_loras + 1,),
            None,  # adapter_enabled: at least max_loras + 1 (below)
            (max_loras, padded),
            (max_loras, m_blocks),
            (max_loras,),
            (max_loras, numel),
            (max_loras, num_experts + 1),
        )
        if topk_ids.device.type != "cuda":
            raise ValueError(f"backend cuda: topk_ids on {topk_ids.device}, not a GPU")
        pointers = _device_pointers(args, shapes, topk_ids.device)
        if adapter_enabled.numel() < max_loras + 1:
            raise ValueError(f"adapter_enabled: {adapter_enabled.numel()} < {max_loras + 1}")
        with torch.cuda.device(topk_ids.device):
            csrc.load("moe_lora_align").moe_lora_align_block_size(
                *pointers,
                numel,
                topk_ids.shape[1],
                num_experts,
                block_size,
                max_loras,
                padded,
                m_blocks,
                torch.cuda.current_stream(topk_ids.device).cuda_stream,
                fixes.grid_plus_one,
                fixes.oob_guard,
                fixes.sort_adapter_check,
            )
        return
    assert backend == "triton", f"unknown backend {backend!r}"
    _launch_triton(*args, num_experts, block_size, max_loras, fixes)


def _device_pointers(tensors, shapes, device: torch.device) -> list[int]:
    """The device pointers the csrc binding takes, each tensor checked first as the binding
    cannot: int32, contiguous, on `device`, of its shape (None: any). Raises, never asserts
    (the checks stand under python -O: the kernel would write past a short buffer)."""
    pointers = []
    for i, (t, shape) in enumerate(zip(tensors, shapes, strict=True)):
        if t.device != device or t.dtype != torch.int32 or not t.is_contiguous():
            raise ValueError(
                f"argument {i}: {t.dtype} on {t.device} (contiguous {t.is_contiguous()}); "
                f"a contiguous int32 tensor on {device} expected"
            )
        if shape is not None and tuple(t.shape) != shape:
            raise ValueError(f"argument {i}: shape {tuple(t.shape)}, {shape} expected")
        pointers.append(t.data_ptr())
    return pointers


def _launch_triton(
    topk_ids,
    token_lora_mapping,
    lora_ids,
    adapter_enabled,
    sorted_token_ids,
    expert_ids,
    num_tokens_post_pad,
    token_mask,
    cumsum,
    num_experts,
    block_size,
    max_loras,
    fixes,
) -> None:
    # fix: moe_align_grid_plus_one -- lora_ids has max_loras + 1 entries and -1 sorts first.
    num_slots = max_loras + 1 if fixes.grid_plus_one else max_loras
    numel = topk_ids.numel()
    top_k = topk_ids.shape[1]
    padded, m_blocks = align_sizes(numel, num_experts, block_size)
    expert_block = triton.next_power_of_2(num_experts)
    common = dict(BLOCK_SIZE=block_size, EXPERT_BLOCK=expert_block)
    guard = fixes.oob_guard
    if is_small_batch(numel, num_experts):
        _small_batch_kernel[(num_slots,)](
            topk_ids,
            token_lora_mapping,
            lora_ids,
            adapter_enabled,
            sorted_token_ids,
            expert_ids,
            num_tokens_post_pad,
            numel,
            top_k,
            max_loras,
            padded,
            m_blocks,
            CHUNK=min(triton.next_power_of_2(numel), SMALL_BATCH_CHUNK),
            FIXED_OOB_GUARD=guard,
            **common,
        )
        return
    _align_kernel[(2, num_slots)](
        topk_ids,
        token_lora_mapping,
        lora_ids,
        adapter_enabled,
        sorted_token_ids,
        expert_ids,
        num_tokens_post_pad,
        token_mask,
        cumsum,
        numel,
        top_k,
        num_experts,
        max_loras,
        padded,
        m_blocks,
        CHUNK=SORT_CHUNK,
        FIXED_OOB_GUARD=guard,
        **common,
    )
    _count_and_sort_kernel[(triton.cdiv(numel, SORT_CHUNK), num_slots)](
        topk_ids,
        lora_ids,
        adapter_enabled,
        sorted_token_ids,
        token_mask,
        cumsum,
        numel,
        num_experts,
        max_loras,
        padded,
        CHUNK=SORT_CHUNK,
        FIXED_OOB_GUARD=fixes.oob_guard,
        FIXED_SORT_ADAPTER_CHECK=fixes.sort_adapter_check,
    )


# ---------------------------------------------------------------------------------------------
# Triton kernels
# NOTE: loop bounds are constexpr: Triton 3.6's interpreter cannot take a runtime scalar as a
# range bound under numpy >= 2.4 (int() of a 1-element array), so sizes that bound loops are
# compile-time constants on every backend.
# ---------------------------------------------------------------------------------------------


@triton.jit
def _skip_slot(
    lora_id,
    adapter_enabled_ptr,
    max_loras,
    FIXED_OOB_GUARD: tl.constexpr,
    CHECK_ADAPTER: tl.constexpr,
):
    """True when this program's slot must write nothing."""
    skip = lora_id == -1
    if FIXED_OOB_GUARD:  # fix: moe_align_oob_guard -- a forged id must not index missing rows.
        skip = skip | (lora_id >= max_loras)
    if CHECK_ADAPTER:
        skip = skip | (tl.load(adapter_enabled_ptr + lora_id, mask=~skip, other=0) == 0)
    return skip


@triton.jit
def _padded_layout(counts, BLOCK_SIZE: tl.constexpr):
    """Per-expert (starts, ends) after padding each count to BLOCK_SIZE, and the padded total."""
    padded = tl.cdiv(counts, BLOCK_SIZE) * BLOCK_SIZE
    ends = tl.cumsum(padded, axis=0)
    return ends - padded, ends, tl.sum(padded, axis=0)


@triton.jit
def _expert_of_blocks(
    expert_ids_ptr, ends, total, M_BLOCKS: tl.constexpr, BLOCK_SIZE: tl.constexpr
):
    """Write the expert of every block of one row; -1 past the padded total."""
    for b0 in range(0, M_BLOCKS, 64):
        blocks = b0 + tl.arange(0, 64)
        start = blocks * BLOCK_SIZE
        below = (ends[None, :] <= start[:, None]).to(tl.int32)  # [64, EXPERT_BLOCK]
        expert = tl.where(start < total, tl.sum(below, axis=1), -1)
        tl.store(expert_ids_ptr + blocks, expert, mask=blocks < M_BLOCKS)


@triton.jit
def _fill_row(row_ptr, value, LENGTH: tl.constexpr, CHUNK: tl.constexpr):
    for c0 in range(0, LENGTH, CHUNK):
        offs = c0 + tl.arange(0, CHUNK)
        tl.store(row_ptr + offs, tl.full([CHUNK], value, tl.int32), mask=offs < LENGTH)


@triton.jit
def _small_batch_kernel(
    topk_ids_ptr,
    token_lora_mapping_ptr,
    lora_ids_ptr,
    adapter_enabled_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_pad_ptr,
    NUMEL: tl.constexpr,
    top_k,
    max_loras,
    MAX_NUM_TOKENS_PADDED: tl.constexpr,
    MAX_NUM_M_BLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FIXED_OOB_GUARD: tl.constexpr,
):
    """One program per slot, over the batch in chunks of CHUNK pairs (a [CHUNK, EXPERT_BLOCK]
    one-hot tile: [1024, 64] int32 would need 256 KiB of shared memory, more than an H100 has):
    a first pass counts, a second writes each pair after the ones before it."""
    lora_id = tl.load(lora_ids_ptr + tl.program_id(0))
    if _skip_slot(lora_id, adapter_enabled_ptr, max_loras, FIXED_OOB_GUARD, True):
        return
    lora = lora_id.to(tl.int64)
    experts = tl.arange(0, EXPERT_BLOCK)
    counts = tl.zeros([EXPERT_BLOCK], tl.int32)
    for c0 in range(0, NUMEL, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        in_range = pairs < NUMEL
        owner = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=in_range, other=-1)
        expert = tl.load(topk_ids_ptr + pairs, mask=in_range & (owner == lora_id), other=-1)
        counts += tl.sum((expert[:, None] == experts[None, :]).to(tl.int32), axis=0)
    starts, ends, total = _padded_layout(counts, BLOCK_SIZE)
    tl.store(num_tokens_post_pad_ptr + lora, total)
    _expert_of_blocks(
        expert_ids_ptr + lora * MAX_NUM_M_BLOCKS, ends, total, MAX_NUM_M_BLOCKS, BLOCK_SIZE
    )
    row_ptr = sorted_token_ids_ptr + lora * MAX_NUM_TOKENS_PADDED
    _fill_row(row_ptr, NUMEL, MAX_NUM_TOKENS_PADDED, 256)
    tl.debug_barrier()  # NOTE: padding must land before the pairs that overwrite it.
    seen = tl.zeros([EXPERT_BLOCK], tl.int32)  # pairs of each expert written so far
    for c0 in range(0, NUMEL, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        in_range = pairs < NUMEL
        owner = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=in_range, other=-1)
        mine = in_range & (owner == lora_id)
        expert = tl.load(topk_ids_ptr + pairs, mask=mine, other=-1)
        onehot = (expert[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.cumsum(onehot, axis=0) - 1 + seen[None, :]  # [CHUNK, EXPERT_BLOCK]
        dest = tl.sum(tl.where(onehot != 0, starts[None, :] + rank, 0), axis=1)
        tl.store(row_ptr + dest, pairs, mask=mine)
        seen += tl.sum(onehot, axis=0)


@triton.jit
def _align_kernel(
    topk_ids_ptr,
    token_lora_mapping_ptr,
    lora_ids_ptr,
    adapter_enabled_ptr,
    sorted_token_ids_ptr,
    expert_ids_ptr,
    num_tokens_post_pad_ptr,
    token_mask_ptr,
    cumsum_ptr,
    NUMEL: tl.constexpr,
    top_k,
    num_experts,
    max_loras,
    MAX_NUM_TOKENS_PADDED: tl.constexpr,
    MAX_NUM_M_BLOCKS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    EXPERT_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    FIXED_OOB_GUARD: tl.constexpr,
):
    """Two programs per slot: 0 writes the token mask, layout and expert ids; 1 pads the row."""
    lora_id = tl.load(lora_ids_ptr + tl.program_id(1))
    if _skip_slot(lora_id, adapter_enabled_ptr, max_loras, FIXED_OOB_GUARD, True):
        return
    lora = lora_id.to(tl.int64)
    if tl.program_id(0) == 1:
        _fill_row(
            sorted_token_ids_ptr + lora * MAX_NUM_TOKENS_PADDED, NUMEL, MAX_NUM_TOKENS_PADDED, CHUNK
        )
        return
    counts = tl.zeros([EXPERT_BLOCK], tl.int32)
    for c0 in range(0, NUMEL, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        in_range = pairs < NUMEL
        owner = tl.load(token_lora_mapping_ptr + pairs // top_k, mask=in_range, other=-1)
        mine = in_range & (owner == lora_id)
        tl.store(token_mask_ptr + lora * NUMEL + pairs, mine.to(tl.int32), mask=in_range)
        expert = tl.load(topk_ids_ptr + pairs, mask=mine, other=-1)
        onehot = expert[:, None] == tl.arange(0, EXPERT_BLOCK)[None, :]
        counts += tl.sum(onehot.to(tl.int32), axis=0)
    starts, ends, total = _padded_layout(counts, BLOCK_SIZE)
    experts = tl.arange(0, EXPERT_BLOCK)
    cumsum_row = cumsum_ptr + lora * (num_experts + 1)
    tl.store(cumsum_row + experts, starts, mask=experts < num_experts)
    tl.store(cumsum_row + num_experts, total)
    tl.store(num_tokens_post_pad_ptr + lora, total)
    _expert_of_blocks(
        expert_ids_ptr + lora * MAX_NUM_M_BLOCKS, ends, total, MAX_NUM_M_BLOCKS, BLOCK_SIZE
    )


@triton.jit
def _count_and_sort_kernel(
    topk_ids_ptr,
    lora_ids_ptr,
    adapter_enabled_ptr,
    sorted_token_ids_ptr,
    token_mask_ptr,
    cumsum_ptr,
    numel,
    num_experts,
    max_loras,
    max_num_tokens_padded,
    CHUNK: tl.constexpr,
    FIXED_OOB_GUARD: tl.constexpr,
    FIXED_SORT_ADAPTER_CHECK: tl.constexpr,
):
    """Place each masked pair at its expert's next free position (atomic on the cumsum row)."""
    lora_id = tl.load(lora_ids_ptr + tl.program_id(1))
    # fix: moe_align_sort_adapter_check -- a disabled slot's token-mask row was never written.
    if _skip_slot(
        lora_id, adapter_enabled_ptr, max_loras, FIXED_OOB_GUARD, FIXED_SORT_ADAPTER_CHECK
    ):
        return
    lora = lora_id.to(tl.int64)
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    in_range = pairs < numel
    take = in_range & (tl.load(token_mask_ptr + lora * numel + pairs, mask=in_range, other=0) != 0)
    expert = tl.load(topk_ids_ptr + pairs, mask=take, other=0)
    dest = tl.atomic_add(cumsum_ptr + lora * (num_experts + 1) + expert, 1, mask=take)
    tl.store(sorted_token_ids_ptr + lora * max_num_tokens_padded + dest, pairs, mask=take)
