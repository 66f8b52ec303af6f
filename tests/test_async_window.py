"""Sliding-window block freeing under a scheduler one step ahead, speculative rejections and the
device's position shift: the mechanism of vLLM #47728, fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.outcome import WrongResult
from harness.record import Context
from harness.runner.async_inputs import PLACEHOLDER, LastStep, ScheduledRequest, TokenRows
from harness.runner.async_scheduler import AsyncScheduler
from harness.runner.input_batch import InputBuffers
from harness.runner.kv_cache import NULL_BLOCK, KVCache
from harness.runner.sleep_mode import make_pools
from kernels.paged_attention import paged_attention
from repro.bugs.async_window_free.scenarios import rejected_drafts_after_window_free

pytestmark = pytest.mark.async_window_free

BUGGY = ALL_FIXES - {Fix.ASYNC_WINDOW_FREE_PROCESSED}


@pytest.mark.parametrize("window", [0, 1, 3, 5])
def test_paged_attention_attends_the_window(device, window) -> None:
    """Queries at positions 0-6 of one row (blocks of 2, seeded cache) vs a dense softmax over
    positions [max(0, p + 1 - window), p] (all of 0..p when window is 0)."""
    gen = torch.Generator().manual_seed(3)
    heads, dim, n = 2, 4, 7
    k_cache, v_cache = (torch.randn(6, 2, heads, dim, generator=gen) for _ in range(2))
    query = torch.randn(n, heads, dim, generator=gen)
    table = torch.tensor([[4, 1, 5, 0]], dtype=torch.int32)
    out = torch.empty(n, heads, dim, device=device)
    rows, positions = torch.zeros(n, dtype=torch.int32), torch.arange(n)
    inputs = (t.to(device) for t in (query, k_cache, v_cache, table, rows, positions))
    paged_attention(*inputs, out, 0.5, 8, window=window)
    slots = [int(table[0, p // 2]) * 2 + p % 2 for p in range(n)]
    keys, values = (c.reshape(-1, heads, dim)[slots].double() for c in (k_cache, v_cache))
    for p in range(n):
        lo = max(0, p + 1 - window) if window else 0
        scores = torch.einsum("hd,phd->hp", query[p].double(), keys[lo : p + 1]) * 0.5
        want = torch.einsum("hp,phd->hd", scores.softmax(-1), values[lo : p + 1])
        assert torch.allclose(out[p].cpu().double(), want, atol=1e-5), f"position {p}"


def _kv(device) -> KVCache:
    return KVCache((2, 2), 8, 1, 2, 1, 8, 12, make_pools(device), sliding_window=2)


def test_blocks_out_of_the_window_become_the_null_block(device) -> None:
    """Position 5's window is [4, 5]: blocks 0 and 1 go back to the free lists, their entries
    the null block (NaN, never handed out); a finished request frees the rest only."""
    kv = _kv(device)
    assert all(NULL_BLOCK not in ids for ids in kv.free_lists)
    assert kv.k_caches[0][NULL_BLOCK].isnan().all() and kv.v_caches[1][NULL_BLOCK].isnan().all()
    kv.ensure_blocks(0, 6)
    held = [list(ids) for ids in kv.blocks[0]]
    kv.remove_skipped_blocks(0, 5)
    assert kv.blocks[0] == [[NULL_BLOCK, NULL_BLOCK, ids[2]] for ids in held]
    assert [ids[:2] for ids in kv.free_lists] == [h[:2][::-1] for h in held]
    kv.free(0)
    assert all(NULL_BLOCK not in ids for ids in kv.free_lists)


def _third_step_blocks(fixes, device) -> list[int]:
    """The scenario's schedule on the host: prefill (0-2), a decode with two drafts (3-5), then
    the next decode scheduled while it is in flight (its count 6, three tokens in flight)."""
    scheduler = AsyncScheduler(_kv(device), fixes, num_spec_tokens=2)
    scheduler.add_request("R", (5, 9, 13), 3)
    first = scheduler.schedule()
    scheduler.schedule()
    scheduler.update_from_output(first, [[7]], [0])
    third = scheduler.schedule()
    assert third.scheduled == [ScheduledRequest("R", 6, (PLACEHOLDER,) * 3)]
    req = scheduler.running[0]
    assert (req.num_computed_tokens, req.num_in_flight_tokens) == (9, 6)
    return scheduler.kv.blocks[0][0]


def test_the_window_is_freed_on_the_processed_count(device) -> None:
    """6 - 3 in flight = 3: block 0 only; positions 2 and 3 stay readable after a rejection."""
    assert _third_step_blocks(ALL_FIXES, device)[:2].count(NULL_BLOCK) == 1


def test_buggy_the_window_is_freed_on_the_optimistic_count(device) -> None:
    """6: blocks 0 and 1, position 3 included, which a rejection of both drafts reads."""
    assert _third_step_blocks(BUGGY, device)[:2] == [NULL_BLOCK, NULL_BLOCK]


def test_rejected_drafts_shift_the_next_step_on_the_device(device) -> None:
    """Step N+1 was prepared at positions 6-8; step N rejected 2 drafts: its placeholders take
    step N's next inputs, its positions and sequence length move back by 2."""
    rows = TokenRows(ALL_FIXES, device)
    rows.prepare([ScheduledRequest("R", 0, (5, 9, 13, 1, 2, 3))], None)
    last = LastStep(torch.tensor([[11, 11, 11]], device=device), torch.tensor([2], device=device))
    requests, fill = rows.prepare([ScheduledRequest("R", 6, (PLACEHOLDER,) * 3)], last)
    buffers = InputBuffers(8, 2, device)
    batch = buffers.prepare(requests, 3, 1)
    fill.fill(batch)
    assert batch.input_ids.tolist() == [11, 11, 11]
    assert batch.positions.tolist() == [4, 5, 6] and batch.seq_lens.tolist() == [7]


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_the_step_after_a_rejection_reads_live_blocks(device, fixes) -> None:
    """The scenario on the runner: the buggy variant's step 3 reads the null block (NaN)."""
    ctx = Context(fixes, device)
    if fixes == ALL_FIXES:
        assert "[0, 3, 4]" in rejected_drafts_after_window_free(ctx)
        return
    with pytest.raises(WrongResult, match=r"step 2 \(R\) logits at positions \[4, 5\].*nan vs"):
        rejected_drafts_after_window_free(ctx)
