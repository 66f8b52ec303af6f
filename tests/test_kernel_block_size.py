"""Kernel blocks under KV-manager blocks: the block-table expansion, the cache's kernel view,
and the block size attention is told: the mechanism of vLLM #27753, fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.outcome import WrongResult
from harness.record import Context
from harness.runner.input_batch import InputBuffers, Request
from harness.runner.kv_cache import KVCache
from harness.runner.model_runner import ModelRunner
from harness.runner.sleep_mode import make_pools
from kernels.paged_attention import paged_attention, paged_attention_reference
from repro.bugs.kernel_block_size.scenarios import prefill_then_decode, split_config

pytestmark = pytest.mark.kernel_block_size

BUGGY = ALL_FIXES - {Fix.KERNEL_BLOCK_SIZE_TO_BUILDERS}
HEADS, DIM = 2, 3


def _kv(device: str) -> KVCache:
    """Group 0: manager blocks of 8 split into kernel blocks of 4 (odd: 7 blocks); group 1 of
    16, not split."""
    pools = make_pools(device)
    return KVCache((8, 16), 7, HEADS, DIM, 3, 16, 16, pools, kernel_block_sizes=(4, 16))


def test_manager_blocks_expand_into_kernel_blocks_and_slots_stay_the_managers(device) -> None:
    """Row 1 holds manager blocks 5 and 2 of group 0: its table row holds kernel blocks
    10, 11, 4, 5; every token's slot is the one the manager computes, in both groups."""
    kv = _kv(device)
    kv.blocks[1] = [[5, 2], [3]]
    kv.block_tables.set_row(1, kv.blocks[1])
    table = kv.block_tables.block_tables[0][1, :4].tolist()
    assert table == [10, 11, 4, 5], table
    buffers = InputBuffers(16, 3, device)
    batch = buffers.prepare([Request("a", (1,)), Request("b", tuple(range(11)))], 12, 2)
    kv.blocks[0] = [[1, 6], [0]]
    kv.block_tables.set_row(0, kv.blocks[0])
    slots = kv.metadata(batch).slot_mappings.cpu()
    rows = [(0, 0)] + [(1, p) for p in range(11)]
    for g in (0, 1):
        want = [kv.slot(g, row, p) for row, p in rows]
        assert slots[g].tolist() == want, f"group {g}: {slots[g].tolist()} vs {want}"


def test_the_kernel_view_pages_the_same_memory(device) -> None:
    """Group 0's 7 blocks of 8 seen as 14 of 4; group 1 as it is; no copy either way."""
    kv = _kv(device)
    views = kv.kernel_views(kv.k_caches)
    assert [tuple(v.shape[:2]) for v in views] == [(14, 4), (7, 16)]
    assert [v.data_ptr() for v in views] == [c.data_ptr() for c in kv.k_caches]


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_the_builder_is_told_the_kernel_or_the_managers_block_size(device, fixes) -> None:
    runner = ModelRunner(split_config(Context(fixes, device)))
    assert runner.kv_cache.builder_block_sizes == ((4, 16) if fixes == ALL_FIXES else (8, 16))


def test_attention_over_kernel_blocks_needs_the_kernel_block_size(device) -> None:
    """A kernel-block table (manager block 2 as kernel blocks 4 and 5) over the kernel view:
    told 4, attention reads the reference's slots 16-21; told 8, slots 32-37."""
    gen = torch.Generator().manual_seed(3)
    cache = lambda: torch.randint(-3, 4, (20, 4, HEADS, DIM), generator=gen).float().to(device)
    k_cache, v_cache = cache(), cache()
    query = torch.randint(-2, 3, (6, HEADS, DIM), generator=gen).float().to(device)
    table = torch.tensor([[4, 5, 0, 0]], dtype=torch.int32, device=device)
    rows = torch.zeros(6, dtype=torch.int32, device=device)
    positions = torch.arange(6, device=device)
    want = paged_attention_reference(query, k_cache, v_cache, table, rows, positions, 0.5)
    for size in (4, 8):
        out = torch.empty_like(query)
        args = (query, k_cache, v_cache, table, rows, positions, out, 0.5, 16)
        paged_attention(*args, block_size=size)
        same = torch.allclose(out.cpu().double(), want, atol=1e-5)
        assert same == (size == 4), f"told {size}: {'same as' if same else 'differs from'} ref"


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_a_split_group_prefills_and_decodes_as_the_reference(device, fixes) -> None:
    """The scenario on the runner: right with the kernel block size, every logit wrong with
    the manager's."""
    ctx = Context(fixes, device)
    if fixes == ALL_FIXES:
        assert "both steps as the reference" in prefill_then_decode(ctx)
        return
    with pytest.raises(WrongResult, match="prefill logits vs reference"):
        prefill_then_decode(ctx)
