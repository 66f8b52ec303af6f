"""Block reuse in the KV cache (free lists, a hybrid runner's state blocks), the zeroing of new
blocks and the page-loading decode kernel: the mechanism of vLLM #35219, fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.record import Context
from harness.runner.input_batch import Request
from harness.runner.mamba import WINDOW
from harness.runner.model_runner import ModelRunner, updated
from kernels.paged_attention import zero_kv_blocks
from kernels.split_kv_attention import (
    combine_splits,
    plan_schedule,
    split_kv_attention,
    split_kv_attention_reference,
)
from repro.bugs.kv_block_stale_nan.scenarios import hybrid_config

pytestmark = pytest.mark.kv_block_stale_nan

BLOCK, HEADS, DIM = 4, 2, 16


def _decode(device, unused: float, page_loads: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One split-KV decode step over 3 parts (a part may end mid-page) at lengths 6 and 3 over
    pages of 4, whose slots past each length hold `unused`: (output, float64 reference)."""
    gen = torch.Generator().manual_seed(0)
    shape = (4, BLOCK, HEADS, DIM)
    k_cache, v_cache = (torch.randint(-2, 3, shape, generator=gen).float() for _ in range(2))
    for cache in (k_cache, v_cache):
        cache[0, 2:], cache[3, 3:] = unused, unused
    table, lens = torch.tensor([[2, 0], [3, 1]], dtype=torch.int32), torch.tensor([6, 3])
    q = torch.randint(-2, 3, (2, HEADS, DIM), generator=gen).float()
    meta = torch.empty(3, 4, dtype=torch.int32, device=device)
    seq_lens = lens.int().to(device)
    plan_schedule(seq_lens, meta, torch.empty(2, dtype=torch.int32, device=device))
    partial_out, partial_lse = torch.empty(3, 2, HEADS, DIM), torch.empty(3, 2, HEADS)
    dev = [t.to(device) for t in (q, k_cache, v_cache, table, partial_out, partial_lse)]
    q_d, k_d, v_d, table_d, out_d, lse_d = dev
    split_kv_attention(
        q_d, k_d, v_d, table_d, seq_lens, meta, out_d, lse_d, 0.25, 16, page_loads=page_loads
    )
    out = torch.empty_like(q_d)
    combine_splits(out_d, lse_d, meta, out)
    return out.cpu(), split_kv_attention_reference(q, k_cache, v_cache, table, lens, 0.25)


@pytest.mark.parametrize(
    ("unused", "page_loads"),
    [(float("nan"), False), (float("nan"), True), (0.0, True)],
    ids=["nan_masked_loads", "nan_page_loads", "zeroed_page_loads"],
)
def test_unused_slots_meet_the_weights_only_when_pages_are_loaded(
    device, unused, page_loads
) -> None:
    """Masked loads never read the slots past a length; page loads weight them by 0: exact
    over zeroed slots, NaN over NaN ones (0 x NaN), every head of both requests."""
    out, reference = _decode(device, unused, page_loads)
    if page_loads and unused != unused:  # NaN
        assert out.isnan().all(), out
    else:
        torch.testing.assert_close(out.double(), reference, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_kv_blocks_zeroes_exactly_the_named_pages(device, dtype) -> None:
    cache = torch.full((5, BLOCK, HEADS, 3), float("nan"), dtype=dtype, device=device)
    zero_kv_blocks(cache, torch.tensor([3, 1], device=device))
    zeroed = (cache == 0).flatten(1).all(1).tolist()
    nan = cache.isnan().flatten(1).all(1).tolist()
    assert zeroed == [False, True, False, True, False] and nan == [not z for z in zeroed]


def _runner(device, fixes=ALL_FIXES, **config) -> ModelRunner:
    return ModelRunner(updated(hybrid_config(Context(fixes, device)), **config))


def test_freed_blocks_are_reused_least_recently_freed_first_last_block_first(device) -> None:
    runner = _runner(device)
    kv = runner.kv_cache
    kv.ensure_blocks(0, 5)
    pages, state = list(kv.blocks[0][0]), kv.state_blocks[0]
    assert state not in pages and len(pages) == 2
    kv.free(0)
    assert kv.free_lists[0] == [state, *pages] and not kv.blocks and not kv.state_blocks
    kv.ensure_blocks(0, 5)  # a state block, then two pages, from the head (the list's end)
    assert (kv.state_blocks[0], kv.blocks[0][0]) == (pages[1], [pages[0], state])


def test_new_blocks_are_recorded_per_step_state_blocks_are_not(device) -> None:
    kv = _runner(device, num_kv_blocks=8).kv_cache
    kv.ensure_blocks(0, 5)
    first = kv.take_new_block_ids()
    assert first[0] == kv.blocks[0][0] and kv.state_blocks[0] not in first[0]
    kv.ensure_blocks(0, 8)
    assert kv.take_new_block_ids() == [[], []]
    kv.ensure_blocks(0, 9)
    assert kv.take_new_block_ids()[0] == kv.blocks[0][0][2:]


def test_the_state_group_writes_its_window_into_group_0s_value_page(device) -> None:
    runner = _runner(device)
    kv = runner.kv_cache
    kv.ensure_blocks(0, 5)
    runner._update_states([Request("r0", (1, 2, 3, 4, 5))])
    page = kv.state_pages[kv.state_blocks[0]].cpu()
    assert page[:WINDOW].tolist() == [5, 4, 3] and (page[WINDOW:] == -1).all()
    values = kv.v_caches[0][kv.state_blocks[0]].cpu()
    assert values.flatten()[WINDOW:].isnan().all(), "-1 words must read as NaN K/V"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "buggy"])
def test_a_recycled_state_block_is_zeroed_before_its_next_tenant_reads_it(
    device, fixed, dtype
) -> None:
    """A's state block becomes B's last page: zeroed with B's other new pages before B's step
    (fixed), or still A's -1 words, NaN K/V in the slots past B's fifth token (buggy)."""
    fixes = ALL_FIXES if fixed else ALL_FIXES - {Fix.ZERO_NEW_KV_BLOCKS}
    runner = _runner(device, fixes, dtype=dtype)
    kv = runner.kv_cache
    kv.ensure_blocks(0, 5)
    runner._update_states([Request("a", (1, 2, 3, 4, 5))])
    state = kv.state_blocks[0]
    kv.free(0)
    kv.ensure_blocks(0, 5)
    runner._zero_new_blocks()
    assert kv.blocks[0][0][-1] == state
    page = kv.v_caches[0][state].cpu()
    assert bool((page == 0).all()) == fixed and bool(page[1:].isnan().all()) != fixed
