"""The scheduler one step ahead (placeholders, preemption, resume, the token budget's skip) and
the worker's placeholder fill: the mechanism of vLLM #40768, fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.record import Context
from harness.runner.async_inputs import PLACEHOLDER, LastStep, ScheduledRequest, TokenRows
from harness.runner.async_scheduler import AsyncScheduler
from harness.runner.kv_cache import KVCache
from harness.runner.sleep_mode import make_pools
from repro.bugs.async_placeholder_leak.scenarios import resumed_after_preemption

pytestmark = pytest.mark.async_placeholder_leak

BUGGY = ALL_FIXES - {Fix.ASYNC_PLACEHOLDER_HOST_FILL}


def _resumed_inputs(fixes, device) -> list[int]:
    """R prefills (0, 1, 2), decodes one step (its input the placeholder of the token step 1
    sampled), misses a step, then prefills its four host tokens again."""
    rows = TokenRows(fixes, device)
    rows.prepare([ScheduledRequest("R", 0, (3, 1, 2))], None)
    last = LastStep(
        torch.tensor([[7]], device=device), torch.zeros(1, dtype=torch.long, device=device)
    )
    requests, fill = rows.prepare([ScheduledRequest("R", 3, (PLACEHOLDER,))], last)
    assert requests[0].token_ids == (PLACEHOLDER,) and fill is not None
    assert fill.src.tolist() == [0] and fill.dst.tolist() == [0], "step 1's row 0, column 0"
    rows.prepare([], None)  # a step without R
    requests, fill = rows.prepare([ScheduledRequest("R", 0, (3, 1, 2, 7, 9))], None)
    assert fill is None, "a request with no previous-step row gets no device fill"
    return list(requests[0].token_ids)


def test_a_resumed_request_takes_the_host_tokens(device) -> None:
    assert _resumed_inputs(ALL_FIXES, device) == [3, 1, 2, 7, 9]


def test_buggy_a_resumed_request_keeps_its_placeholders(device) -> None:
    """The state the embedding then gathers with (the gather itself is the scenario's)."""
    assert _resumed_inputs(BUGGY, device) == [3, 1, 2, PLACEHOLDER, PLACEHOLDER]


def _scheduler(device) -> AsyncScheduler:
    kv = KVCache((4, 4), 3, 1, 2, 2, 8, 8, make_pools(device))
    scheduler = AsyncScheduler(kv, ALL_FIXES)
    scheduler.add_request("A", (5, 9, 13), 4)
    scheduler.add_request("B", (2, 7, 11), 4)
    return scheduler


def test_the_scheduler_runs_one_step_ahead_and_preempts_from_the_back(device) -> None:
    """Step 2 is scheduled before step 1's tokens reach the host (placeholders, two tokens in
    flight each); step 3's fifth tokens need two blocks, one is free: B is preempted, its
    blocks freed, and resumes once its outputs are processed and blocks are free."""
    s = _scheduler(device)
    first = s.schedule()
    second = s.schedule()
    assert [q.token_ids for q in second.scheduled] == [(PLACEHOLDER,), (PLACEHOLDER,)]
    assert [(q.num_computed_tokens, q.num_in_flight_tokens) for q in s.running] == [(4, 4)] * 2
    s.update_from_output(first, [[20], [21]], [0, 0])
    third = s.schedule()
    assert [q.req_id for q in third.requests] == ["A"] and [q.req_id for q in s.waiting] == ["B"]
    assert s.waiting[0].num_computed_tokens == 0 and 1 not in s.kv.blocks
    s.update_from_output(second, [[30], [31]], [0, 0])
    assert s.waiting[0].output == [21, 31], "a preempted request keeps its in-flight output"
    s.update_from_output(third, [[40]], [0])
    fourth = s.schedule()
    assert [q.req_id for q in fourth.requests] == ["A"], "B's five tokens need two free blocks"
    assert s.update_from_output(fourth, [[50]], [0]) == ["A"]
    resumed = s.schedule()
    assert resumed.scheduled == [ScheduledRequest("B", 0, (2, 7, 11, 21, 31))]


def test_the_token_budget_skips_a_running_request_for_a_step(device) -> None:
    """Two drafts a decode, a budget of four tokens: step 2 decodes A (three tokens) and skips
    B, whose decode launched on its step in flight would take three too; step 3, B's step 1
    processed, schedules B's one sampled token at position 2 (the host's, no placeholder)."""
    kv = KVCache((4, 4), 4, 1, 2, 2, 8, 8, make_pools(device))
    s = AsyncScheduler(kv, ALL_FIXES, num_spec_tokens=2, max_num_scheduled_tokens=4)
    s.add_request("A", (5, 9), 4)
    s.add_request("B", (2, 7), 2)
    first = s.schedule()
    assert [(q.req_id, q.start) for q in first.scheduled] == [("A", 0), ("B", 0)]
    second = s.schedule()
    assert second.scheduled == [ScheduledRequest("A", 2, (PLACEHOLDER,) * 3)]
    s.update_from_output(first, [[20], [21]], [0, 0])
    third = s.schedule()
    assert third.scheduled[1] == ScheduledRequest("B", 2, (21,)), "B resumes at its count"
    assert [q.req_id for q in s.running] == ["A", "B"], "B kept its row while skipped"


@pytest.mark.parametrize("fixes", [ALL_FIXES], ids=["fixed"])
def test_the_engine_matches_the_reference_after_a_resume(device, fixes) -> None:
    """The scenario on the fixed runner (the buggy one asserts on the device: the scenario's)."""
    summary = resumed_after_preemption(Context(fixes, device))
    assert "B resumed after one preemption" in summary and "B skipped once" in summary
