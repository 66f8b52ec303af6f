"""Kernels at realistic sizes, not only the miniature's, against their references: LoRA
shrink/expand at hidden 4096 and ranks 8..64 (the fused MoE-LoRA's: test_fused_moe_lora), paged
and split-KV attention at head dim 128 and long sequences, the block-table gather over many
requests and blocks. A GPU runs every case (`.ci/gpu` runs the suite); the interpreter a
bounded subset."""

from __future__ import annotations

import pytest
import torch

from kernels.block_table import gather_block_tables, gather_block_tables_reference
from kernels.lora_ops import lora_expand, lora_expand_reference, lora_shrink, lora_shrink_reference
from kernels.paged_attention import paged_attention, paged_attention_reference
from kernels.split_kv_attention import (
    plan_schedule,
    split_kv_attention_reference,
)
from tests.test_lora_ops import make_meta
from tests.test_split_kv_attention import split_and_combine

GPU_ONLY = pytest.mark.gpu


def _ints(gen, *shape) -> torch.Tensor:
    """Small integers: float32 sums of thousands of them stay exact."""
    return torch.randint(-2, 3, shape, generator=gen).float()


@pytest.mark.lora_graph_capture
@pytest.mark.parametrize(
    ("hidden", "rank"),
    [(256, 8), pytest.param(4096, 8, marks=GPU_ONLY), pytest.param(4096, 64, marks=GPU_ONLY)],
)
def test_lora_shrink_expand_at_size(device, hidden, rank) -> None:
    gen, max_loras, num_slices = torch.Generator().manual_seed(hidden + rank), 4, 2
    slots = torch.randint(-1, max_loras, (96,), generator=gen).tolist()
    x, y = _ints(gen, len(slots), hidden), _ints(gen, len(slots), num_slices * hidden)
    lora_a = _ints(gen, num_slices, max_loras, rank, hidden)
    lora_b = _ints(gen, num_slices, max_loras, hidden, rank)
    meta = make_meta(slots, max_loras, device)
    buffer = torch.zeros(num_slices, len(slots), rank, device=device)
    lora_shrink(x.to(device), lora_a.to(device), buffer, meta, 1.0)
    shrunk = lora_shrink_reference(x, lora_a, slots, 1.0)
    lora_rows = torch.tensor([s != -1 for s in slots])
    assert torch.equal(buffer.cpu().double()[:, lora_rows], shrunk[:, lora_rows])
    out = y.clone().to(device)  # accumulated in place
    lora_expand(buffer, lora_b.to(device), out, meta)
    assert torch.equal(out.cpu().double(), lora_expand_reference(y, buffer.cpu(), lora_b, slots))


def _paged_cache(gen, lengths, heads, dim, block_size):
    need = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(need) + 3, generator=gen).int()
    table = torch.zeros(len(lengths), max(need), dtype=torch.int32)
    for r, n in enumerate(need):
        table[r, :n], perm = perm[:n], perm[n:]
    k_cache, v_cache = (
        torch.randn(sum(need) + 3, block_size, heads, dim, generator=gen) for _ in range(2)
    )
    return table, k_cache, v_cache


@pytest.mark.lazy_attn_state
@pytest.mark.parametrize(
    ("heads", "dim", "lengths", "num_parts"),
    [
        (2, 32, [40, 3, 97], 4),
        pytest.param(8, 128, [4096, 1, 2500, 777], 16, marks=GPU_ONLY),
        pytest.param(4, 128, [8192, 8192], 64, marks=GPU_ONLY),
    ],
)
def test_attention_at_size(device, heads, dim, lengths, num_parts) -> None:
    gen, block_size = torch.Generator().manual_seed(sum(lengths)), 16
    max_len = max(lengths)
    table, k_cache, v_cache = _paged_cache(gen, lengths, heads, dim, block_size)
    q = torch.randn(len(lengths), heads, dim, generator=gen)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    expected = split_kv_attention_reference(q, k_cache, v_cache, table, seq_lens, dim**-0.5)
    dev = lambda t: t.to(device)
    # paged: the last position of each request (a decode step)
    out = torch.empty(len(lengths), heads, dim, device=device)
    rows, positions = torch.arange(len(lengths), dtype=torch.int32), seq_lens.long() - 1
    paged_attention(
        dev(q),
        dev(k_cache),
        dev(v_cache),
        dev(table),
        dev(rows),
        dev(positions),
        out,
        dim**-0.5,
        max_len,
    )
    paged_ref = paged_attention_reference(q, k_cache, v_cache, table, rows, positions, dim**-0.5)
    torch.testing.assert_close(out.cpu().double(), paged_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(paged_ref, expected, rtol=1e-6, atol=1e-8)
    # split-KV: plan, split, combine
    meta = torch.empty(num_parts, 4, dtype=torch.int32, device=device)
    plan_schedule(dev(seq_lens), meta, torch.empty(len(lengths), dtype=torch.int32, device=device))
    combined = split_and_combine(device, q, k_cache, v_cache, table, seq_lens, meta, max_len)
    torch.testing.assert_close(combined, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.block_table_wake
@pytest.mark.parametrize(
    ("num_reqs", "max_blocks"), [(16, 40), pytest.param(1024, 2048, marks=GPU_ONLY)]
)
def test_block_table_gather_at_size(device, num_reqs, max_blocks) -> None:
    gen, groups = torch.Generator().manual_seed(num_reqs), 2
    tables = [
        torch.randint(0, 10**6, (num_reqs, max_blocks), generator=gen, dtype=torch.int32).to(device)
        for _ in range(groups)
    ]
    inputs = [
        torch.full((num_reqs, max_blocks), -3, dtype=torch.int32, device=device)
        for _ in range(groups)
    ]
    num_blocks = torch.randint(
        0, max_blocks + 1, (groups, num_reqs), generator=gen, dtype=torch.int32
    )
    idx = torch.randperm(num_reqs, generator=gen)[: num_reqs // 2].int()
    ptrs = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.int64, device=device)
    strides = torch.tensor([t.stride(0) for t in tables], dtype=torch.int64, device=device)
    gather_block_tables(
        idx.to(device), ptrs(tables), ptrs(inputs), strides, num_blocks.to(device), max_blocks
    )
    expected = gather_block_tables_reference([t.cpu() for t in tables], idx, num_blocks)
    for g in range(groups):
        got = inputs[g].cpu()[: len(idx)]
        for row in range(len(idx)):
            n = int(num_blocks[g, idx[row]])
            assert torch.equal(got[row, :n], expected[g][row, :n]), (g, row)
