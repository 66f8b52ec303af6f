"""Async scheduling's sampling (harness/runner/async_output.py) on a delayed copy stream: the
mechanisms of vLLM #24527/#25279 (a reused pinned tensor rewritten before its upload ran) and
#29623 (sampled tokens' memory reused before their download ran), fixed and buggy. The
scenarios on the whole runner run in tests/test_regressions.py (fixed and buggy, in a child)."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.runner.async_output import AsyncSampler, OutputArena, PinnedSamplingStates
from harness.runner.input_batch import Request
from harness.runner.streams import Streams

VOCAB = 7
PINNED_BUGGY = ALL_FIXES - {Fix.ASYNC_PINNED_REUSE_WAIT}
LIFETIME_BUGGY = ALL_FIXES - {Fix.ASYNC_OUTPUT_KEEP_REF}
pinned = pytest.mark.async_pinned_race
lifetime = pytest.mark.async_output_lifetime


@pinned
@pytest.mark.parametrize("fixes", [ALL_FIXES, PINNED_BUGGY], ids=["fixed", "buggy"])
def test_an_upload_reads_its_own_steps_rows_or_the_next_steps(device, fixes) -> None:
    """Step 0 restricts row 0 to tokens 2 and 5 and applies the mask; step 1's update clears
    the row before step 0's (delayed) upload ran: it waits first (fixed) or wins (buggy)."""
    streams = Streams(device, delay=True)
    states = PinnedSamplingStates(2, VOCAB, fixes, streams)
    logits = torch.arange(2 * VOCAB, dtype=torch.float32, device=device).view(2, VOCAB)
    assert states.add_requests([Request("a", (1,), allowed_token_ids=(2, 5)), Request("b", (1,))])
    masked = states.apply(logits)
    assert not states.add_requests([Request("c", (1,)), Request("d", (1,))])
    streams.synchronize()
    finite = masked[0].isfinite().nonzero().flatten().tolist()
    assert finite == ([2, 5] if fixes == ALL_FIXES else list(range(VOCAB)))
    assert masked[1].tolist() == logits[1].tolist()


@lifetime
def test_the_arena_hands_the_slot_freed_last_to_the_next_take(device) -> None:
    arena = OutputArena(3, 4, device)
    first, second = arena.take(), arena.take()
    assert (first.data_ptr(), second.data_ptr()) == (
        arena.rows[0].data_ptr(),
        arena.rows[1].data_ptr(),
    )
    del first
    assert arena.take().data_ptr() == arena.rows[0].data_ptr()
    assert second.data_ptr() == arena.rows[1].data_ptr()


@lifetime
@pytest.mark.parametrize("fixes", [ALL_FIXES, LIFETIME_BUGGY], ids=["fixed", "buggy"])
def test_a_download_reads_its_own_steps_tokens_or_the_next_steps(device, fixes) -> None:
    """Two steps sampled back to back on a delayed copy stream: step 0's download reads its
    own tokens (fixed: its memory is kept) or step 1's (buggy: step 1 took the memory)."""
    sampler = AsyncSampler(2, Streams(device, delay=True), fixes)
    logits = torch.eye(VOCAB, device=device)
    first = sampler.sample(logits[[1, 4]], ("a", "b"))
    second = sampler.sample(logits[[6, 3]], ("c", "d"))
    assert first.get_output() == ([1, 4] if fixes == ALL_FIXES else [6, 3])
    assert second.get_output() == [6, 3]
