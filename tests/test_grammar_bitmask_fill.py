"""Structured outputs: the packed bitmask and its Triton apply kernel, the toy grammar, and the
worker's scatter of the scheduler's rows into a batch-sized mask: the mechanism of vLLM #22896
and #22963 (vllm-gaudi #1199, #1200), fixed and buggy."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.outcome import WrongResult
from harness.record import Context
from harness.runner.structured_output import StructuredOutputsWorker, ToyGrammar, grammar_bitmask
from kernels.grammar_bitmask import (
    apply_token_bitmask,
    apply_token_bitmask_reference,
    pack_allowed,
    unpack_allowed,
)
from repro.bugs.grammar_bitmask_fill.scenarios import guided_and_free_rows

pytestmark = pytest.mark.grammar_bitmask_fill

FILL, COUNT = Fix.GRAMMAR_NEUTRAL_FILL, Fix.GRAMMAR_GUIDED_ROW_COUNT
VOCAB = 70  # three words, the last one partly past the vocabulary


def test_packing_round_trips_every_bit_sign_bit_included() -> None:
    allowed = [[0, 31, 32, 63, 64, 69], [], list(range(VOCAB))]
    packed = pack_allowed(allowed, VOCAB)
    assert packed.dtype == torch.int32 and tuple(packed.shape) == (3, 3)
    assert packed[0, 0].item() == -(2**31) + 1  # bits 0 and 31
    back = unpack_allowed(packed, VOCAB)
    for row, tokens in enumerate(allowed):
        assert back[row].nonzero().flatten().tolist() == tokens


def test_the_kernel_masks_forbidden_tokens_and_never_writes_allowed_ones(device) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, VOCAB, generator=gen).to(device)
    bitmask = pack_allowed([[1, 2, 33], [], list(range(VOCAB)), [69]], VOCAB)
    bitmask[2] = -1  # the neutral row
    want = apply_token_bitmask_reference(logits, bitmask)
    before = logits.clone()
    apply_token_bitmask(logits, bitmask.to(device))
    assert torch.equal(logits.cpu().double(), want)
    assert torch.equal(logits[2], before[2]), "a neutral row changed"
    assert logits[1].isneginf().all(), "an all-zero row must forbid every token"
    assert torch.softmax(logits[1].cpu(), -1).isnan().all()


def test_the_grammar_walks_its_automaton() -> None:
    grammar = ToyGrammar(4, 1)
    assert grammar.allowed(1, 12) == [1, 5, 9]
    assert grammar.advance(1, 5) == 3
    with pytest.raises(ValueError, match="not allowed"):
        grammar.advance(1, 2)


def _scatter(fixes, req_ids, guided):
    worker = StructuredOutputsWorker(4, VOCAB, "cpu", fixes)
    out = grammar_bitmask(guided, VOCAB)
    return unpack_allowed(worker.scatter(out, req_ids), VOCAB), worker


GUIDED = [("d", ToyGrammar(4, 1), 1), ("b", ToyGrammar(3), 0)]  # the scheduler's order


@pytest.mark.parametrize(
    "fixes",
    [ALL_FIXES, ALL_FIXES - {FILL}, ALL_FIXES - {COUNT}],
    ids=["fixed", "no-fill", "no-count"],
)
def test_the_scatter_puts_each_guided_row_at_its_batch_row(fixes) -> None:
    """Rows a (free), b (guided), c (free), d (guided); the scheduler sends d, then b."""
    mask, _ = _scatter(fixes, ("a", "b", "c", "d"), GUIDED)
    grammar_rows = {1: ToyGrammar(3).allowed(0, VOCAB), 3: ToyGrammar(4, 1).allowed(1, VOCAB)}
    free_ok = [bool(mask[r].all()) for r in (0, 2)]
    if fixes == ALL_FIXES:
        assert free_ok == [True, True]
    elif fixes == ALL_FIXES - {FILL}:  # the free rows as allocated: zeros
        assert free_ok == [False, False] and not mask[0].any() and not mask[2].any()
    else:  # two rows past the scheduler's: stale (zero) rows copied to batch row 0
        assert free_ok == [False, True] and not mask[0].any()
    for row, tokens in grammar_rows.items():
        assert mask[row].nonzero().flatten().tolist() == tokens


def test_without_the_count_a_later_step_scatters_an_earlier_steps_rows() -> None:
    """Step 1: three guided rows; step 2: one guided row of three: the scatter past it copies
    step 1's second and third rows to their step-1 batch rows."""
    worker = StructuredOutputsWorker(4, VOCAB, "cpu", ALL_FIXES - {COUNT})
    step1 = [("x", ToyGrammar(2), 0), ("y", ToyGrammar(2), 1), ("z", ToyGrammar(5), 3)]
    worker.scatter(grammar_bitmask(step1, VOCAB), ("x", "y", "z"))
    mask = unpack_allowed(worker.scatter(grammar_bitmask(step1[:1], VOCAB), ("x", "f", "g")), VOCAB)
    assert mask[1].nonzero().flatten().tolist() == ToyGrammar(2).allowed(1, VOCAB)
    assert mask[2].nonzero().flatten().tolist() == ToyGrammar(5).allowed(3, VOCAB)


def test_every_row_guided_needs_neither_part() -> None:
    both = [("b", ToyGrammar(3), 0), ("a", ToyGrammar(4, 1), 1)]
    masks = [_scatter(f, ("a", "b"), both)[0] for f in (ALL_FIXES, ALL_FIXES - {FILL, COUNT})]
    assert torch.equal(*masks)


@pytest.mark.parametrize("fixes", [ALL_FIXES, ALL_FIXES - {FILL, COUNT}], ids=["fixed", "buggy"])
def test_the_runner_masks_only_the_guided_rows(device, fixes) -> None:
    """The scenario in this process (each part alone: tests/test_regressions.py)."""
    ctx = Context(fixes, device)
    if fixes == ALL_FIXES:
        assert "as the reference" in guided_and_free_rows(ctx)
        return
    with pytest.raises(WrongResult, match=r"forbid every token .*softmax NaN: True"):
        guided_and_free_rows(ctx)
