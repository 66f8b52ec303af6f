"""A drafter that writes KV past the sequence in the target's step, and the lookahead slots the
scheduler allocates for it: the mechanism of vLLM #42971 and #43733, fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.outcome import WrongResult
from harness.record import Context
from harness.runner.block_table import row_width
from harness.runner.cudagraph import CUDAGraphMode
from harness.runner.input_batch import Request
from harness.runner.kv_cache import KVCache
from harness.runner.lookahead import lookahead_slots
from harness.runner.model_runner import ModelRunner, runner_config
from harness.runner.sleep_mode import make_pools
from repro.bugs.draft_lookahead_alloc.scenarios import lookahead_past_allocation

pytestmark = pytest.mark.draft_lookahead_alloc

BONUS, PREFILL = Fix.DRAFT_LOOKAHEAD_BONUS_SLOT, Fix.DRAFT_LOOKAHEAD_ON_PREFILL
VARIANTS = [ALL_FIXES, ALL_FIXES - {BONUS}, ALL_FIXES - {PREFILL}]
IDS = ["fixed", "no-bonus", "no-prefill"]


@pytest.mark.parametrize(
    ("fixes", "first", "later"),
    [(VARIANTS[0], 3, 3), (VARIANTS[1], 2, 2), (VARIANTS[2], 0, 3)],
    ids=IDS,
)
def test_the_scheduler_counts_k_plus_one_on_every_step(fixes, first, later) -> None:
    assert lookahead_slots(2, True, fixes) == first
    assert lookahead_slots(2, False, fixes) == later


def _kv(device: str) -> KVCache:
    return KVCache((4,), 16, 2, 3, 2, 16, 12, make_pools(device))


def test_the_lookahead_is_allocated_within_max_model_len(device) -> None:
    kv = _kv(device)
    kv.lookahead = {0: 2}
    kv.ensure_blocks(0, 3, (1, 2, 3))
    assert len(kv.blocks[0][0]) == 2  # slots 0-4
    kv.lookahead = {0: 3}
    kv.ensure_blocks(0, 11, tuple(range(8)))
    assert len(kv.blocks[0][0]) == 3  # 14 slots capped at max_model_len 12
    kv.ensure_blocks(1, 4, (1, 2, 3, 4))
    assert len(kv.blocks[1][0]) == 1  # no lookahead for row 1


def test_a_row_is_new_until_its_first_step_and_again_once_freed(device) -> None:
    kv = _kv(device)
    assert kv.first_step(1)
    kv.ensure_blocks(1, 2, (5, 6))
    assert not kv.first_step(1) and kv.first_step(0)
    kv.swap_rows(0, 1)
    assert not kv.first_step(0) and kv.first_step(1)
    kv.free(0)
    assert kv.first_step(0)


def test_a_row_past_its_allocation_names_its_last_tenants_blocks(device) -> None:
    """The hazard's ground: a row is written up to the allocation, not cleared at free."""
    kv = _kv(device)
    kv.ensure_blocks(1, 12, tuple(range(12)))
    old = list(kv.blocks[1][0])
    kv.free(1)
    kv.ensure_blocks(1, 3, (7, 8, 9))
    row = kv.block_tables.block_tables[0][1, :3].tolist()
    assert row[1:] == old[1:3] and row[0] == kv.blocks[1][0][0]


def _drafting_runner(device: str, fixes, **config) -> ModelRunner:
    """An eager runner without LoRA whose parallel drafter drafts one token, blocks of 4,
    max_model_len 16."""
    return ModelRunner(
        runner_config(
            device,
            fixes,
            enable_lora=False,
            cudagraph_mode=CUDAGraphMode.NONE,
            block_sizes=(4, 4),
            max_num_tokens=16,
            max_model_len=16,
            num_speculative_tokens=1,
            parallel_drafting=True,
            **config,
        )
    )


def test_rows_reach_past_max_model_len_and_the_drafter_stops_short_of_it(device) -> None:
    """Rows round max_model_len's blocks up to 128 tokens (upstream's since vLLM #39324): the
    columns past them are no request's, 0. A batch drafts only where every sequence's query
    block (k + 1 positions past it) ends within max_model_len."""
    assert [row_width(n, 4) for n in (12, 128, 129)] == [32, 32, 64]
    assert row_width(9416, 32) == 296 and row_width(100, 256) == 1  # #39324's 295 blocks
    assert _kv(device).block_tables.block_tables[0].shape == (2, 32)
    runner = _drafting_runner(device, ALL_FIXES, num_kv_blocks=16, max_num_reqs=1)
    assert runner.execute_model([Request("A", tuple(range(1, 15)))]).drafts is not None
    runner.kv_cache.free(0)
    assert runner.execute_model([Request("L", tuple(range(1, 16)))]).drafts is None  # 15 + 2


@pytest.mark.parametrize("fixes", VARIANTS, ids=IDS)
def test_a_new_requests_query_block_stays_in_its_blocks(device, fixes) -> None:
    """X (row 1, 12 tokens) finishes; B (row 1, 3 tokens) drafts one token: its query block is
    positions 3 and 4. Fixed: both in B's blocks; without either part position 4 goes through
    row 1's stale entry 1 into X's second block."""
    runner = _drafting_runner(device, fixes, num_kv_blocks=32, max_num_reqs=2)
    kv, drafter = runner.kv_cache, runner.drafter
    runner.execute_model([Request("W", (3,)), Request("X", tuple(range(1, 13)))])
    x1 = kv.blocks[1][0][1]
    before = drafter.v_cache[x1].clone()
    kv.free(1)
    runner.execute_model([Request("W", (4,), 0, 1), Request("B", (21, 22, 23))])
    owned = kv.blocks[1][0]
    assert len(owned) == (2 if fixes == ALL_FIXES else 1)
    same = torch.equal(drafter.v_cache[x1], before)
    assert same == (fixes == ALL_FIXES), "X's block was overwritten" if not same else "untouched"


@pytest.mark.parametrize("fixes", [ALL_FIXES, ALL_FIXES - {BONUS, PREFILL}], ids=["fixed", "buggy"])
def test_another_requests_drafts_stay_its_own(device, fixes) -> None:
    """The scenario in this process (each part alone: tests/test_regressions.py)."""
    ctx = Context(fixes, device)
    if fixes == ALL_FIXES:
        assert "as the reference" in lookahead_past_allocation(ctx)
        return
    with pytest.raises(WrongResult, match="request D's draft logits vs reference"):
        lookahead_past_allocation(ctx)
