"""The input batch's row swaps (decodes before prefills) and the allowed-token-ids mask: the
mechanism of vLLM #48419, fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.outcome import WrongResult
from harness.record import Context
from harness.runner.input_batch import Request, SamplingStates, decode_first_swaps
from harness.runner.kv_cache import KVCache
from harness.runner.sleep_mode import make_pools
from repro.bugs.input_batch_swap_alias.scenarios import restricted_prefill_behind_decodes

pytestmark = pytest.mark.input_batch_swap_alias

BUGGY = ALL_FIXES - {Fix.INPUT_BATCH_SWAP_COPY}
VOCAB = 7


def _states(fixes) -> SamplingStates:
    states = SamplingStates(3, VOCAB, fixes)
    requests = [Request("a", (1,), allowed_token_ids=(2, 5)), Request("b", (1,))]
    assert states.add_requests([*requests, Request("c", (1,), allowed_token_ids=(6,))])
    return states


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_a_swap_trades_the_rows_or_copies_the_second_into_both(fixes) -> None:
    """Rows 0 (tokens 2 and 5 allowed) and 2 (token 6) swapped: they trade places (fixed), or
    both hold row 2's mask (buggy); row 1 is untouched either way."""
    states = _states(fixes)
    before = states.mask_cpu.clone()
    states.swap_states(0, 2)
    assert states.mask_cpu[1].tolist() == before[1].tolist()
    assert states.mask_cpu[2].tolist() == before[0 if fixes == ALL_FIXES else 2].tolist()
    assert states.mask_cpu[0].tolist() == before[2].tolist()


def test_the_mask_sets_disallowed_tokens_to_minus_infinity(device) -> None:
    """Row 0 keeps tokens 2 and 5, row 1 (no restriction) keeps everything."""
    logits = torch.arange(2 * VOCAB, dtype=torch.float32, device=device).view(2, VOCAB)
    masked = _states(ALL_FIXES).apply(logits).cpu()
    assert masked[0].isfinite().nonzero().flatten().tolist() == [2, 5]
    assert masked[1].tolist() == logits[1].tolist()


@pytest.mark.parametrize(
    ("is_decode", "swaps"),
    [
        ([False, False, True, True], [(0, 3), (1, 2)]),
        ([True, False, True], [(1, 2)]),
        ([False, True, False, True, False], [(0, 3)]),
        ([True, True, False], []),
        ([False, False], []),
        ([], []),
    ],
)
def test_decode_first_swaps_pair_the_first_prefill_with_the_last_decode(is_decode, swaps):
    assert decode_first_swaps(is_decode) == swaps
    order = list(is_decode)
    for i, j in swaps:
        order[i], order[j] = order[j], order[i]
    assert order == sorted(order, reverse=True), f"decodes not first: {order}"


def test_swapped_kv_rows_move_blocks_and_tokens(device) -> None:
    """Row 1's blocks move to the empty row 0 and back; a row without blocks stays without."""
    kv = KVCache((4, 16), 8, 1, 2, 4, 8, 8, make_pools(device))
    kv.ensure_blocks(1, 5)
    held = kv.blocks[1]
    kv.swap_rows(0, 1)
    assert kv.blocks == {0: held}
    kv.swap_rows(1, 0)
    assert kv.blocks == {1: held}


@pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
def test_a_reordered_step_samples_each_request_under_its_own_mask(device, fixes) -> None:
    """The scenario's step on the runner: rows P, Q, D1, D2 reordered to D2, D1, Q, P; the
    buggy swap leaves P under D2's mask."""
    ctx = Context(fixes, device)
    if fixes == ALL_FIXES:
        assert "D2, D1, Q, P" in restricted_prefill_behind_decodes(ctx)
        return
    with pytest.raises(WrongResult, match=r"disallowed tokens of rows \(D2, D1, Q, P\)"):
        restricted_prefill_behind_decodes(ctx)
