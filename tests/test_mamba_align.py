"""Mamba align-mode prefix caching: the scheduler's chunk split and the state group's hashing
by block boundary, fixed and buggy (vLLM #51113).

The cases of upstream's tests/v1/core/test_mamba_align_chunk_split.py as merged with #51113
(its numbers: Mamba blocks of 1600 tokens, a 2002-token prompt, EAGLE on), rewritten here on the
project's split and state group: a prefill driven one step per budget, each entry's state
position tracked as the chunk that wrote it ended, then every hashed entry must hold the state
its hash claims, and every chunk but the prompt's last must end on a block boundary (the
invariant upstream's docstrings state). Upstream's later cases (prefill checkpoint blocks, the
use_eagle_block_drop switch, partial hits finer than a block) are not modelled; its partial-hit
axis of the resume case is replaced by the EAGLE back-off on and off."""

from __future__ import annotations

import pytest
import torch

from harness.fixes import ALL_FIXES, Fix
from harness.reference import mixer_reference
from harness.runner.mamba_align import AlignStates, MambaAlignEngine, aligned_split

pytestmark = pytest.mark.mamba_align_prefix_poison

PART = Fix.MAMBA_ALIGN_PAST_LAST_CACHE
BUGGY = ALL_FIXES - {PART}
VARIANTS = pytest.mark.parametrize("fixes", [ALL_FIXES, BUGGY], ids=["fixed", "buggy"])
BLOCK, PROMPT = 1600, 2002


def _prefill(fixes, prompt_len: int, budgets: list[int], block: int = BLOCK) -> int:
    """One request prefilled one step per budget (then with the whole rest: it finishes), a
    split of 0 deferring it, as the scheduler does; returns how many hashed entries it checked."""
    states = AlignStates(4 + prompt_len // block, 1, block, "cpu")
    tokens = [t % 7 for t in range(prompt_len)]
    states.admit("r", tokens)
    state_at: dict[int, int] = {}  # slot -> the token count of the state it holds
    pos, ends = 0, []
    for budget in [*budgets, *[prompt_len] * 4]:
        if pos == prompt_len:
            break
        n = aligned_split(pos, min(budget, prompt_len - pos), prompt_len, block, True, fixes)
        if n == 0:
            continue
        pos += n
        state_at[states.final("r", pos)] = pos
        states.cache_blocks("r", tokens, pos)
        ends.append(pos)
    assert pos == prompt_len, "the prefill did not finish"
    mid = [end for end in ends[:-1] if end % block]
    assert not mid, f"chunks of {ends} end mid-block at {mid}"
    checked = 0
    for p, slot in enumerate(states.entries["r"]):
        if slot in states.hashed:
            claimed = (p + 1) * block
            held = state_at[slot]
            assert held == claimed, f"entry {p} hashed as state@{claimed}, holds state@{held}"
            checked += 1
    return checked


def _expect(fixes, check) -> None:
    """`check` passes on the fixed split and fails on the buggy one."""
    if fixes == ALL_FIXES:
        check()
    else:
        with pytest.raises(AssertionError):
            check()


@VARIANTS
def test_a_fragmented_first_chunk_poisons_no_entry(fixes) -> None:
    """EAGLE backs the last cache position to 0 under two blocks: a 364-token first chunk
    (the rest of a shared budget) used to leave entry 0 at state@364, hashed as state@1600."""
    _expect(fixes, lambda: _prefill(fixes, PROMPT, [364, PROMPT]))


@VARIANTS
def test_a_fragmented_tail_chunk_poisons_no_entry(fixes) -> None:
    """One block in: the chunk ending at the last cache position (1600) is cached; the next
    used to stop at 2600 and the one after it hashed entry 1 as state@3200."""
    _expect(fixes, lambda: _prefill(fixes, 3602, [1600, 1000, 3602]) > 0 or pytest.fail())


@VARIANTS
@pytest.mark.parametrize("first", [800, 900, 1599, 1601, 2000])
def test_every_chunk_but_the_last_ends_on_a_boundary(fixes, first) -> None:
    _expect(fixes, lambda: _prefill(fixes, PROMPT, [first, PROMPT, PROMPT]))


@VARIANTS
@pytest.mark.parametrize(
    ("block", "prompt_len", "budgets"),
    [(1536, 30000, [27648, 1024, 30000]), (12288, 30000, [12288, 4000, 30000]),
     (12288, 41000, [24576, 8000, 41000])],
)  # fmt: skip
def test_larger_blocks_are_not_safer(fixes, block, prompt_len, budgets) -> None:
    """Upstream's larger Mamba blocks (tensor-parallel shards, whole states): the first budget
    walks to the last cache position, the second is a fragment past it."""
    _expect(fixes, lambda: _prefill(fixes, prompt_len, budgets, block) > 0 or pytest.fail())


@VARIANTS
@pytest.mark.parametrize("eagle", [True, False], ids=["eagle", "no_eagle"])
@pytest.mark.parametrize("resume_at", [331, 1599, 1601, 2531, 3011])
def test_a_resume_mid_block_realigns_first(fixes, eagle, resume_at) -> None:
    """A prefill resuming mid-block (upstream: a hit finer than a block, or a connector's
    tokens) must stop at its block's end before passing it; every chunk but the last ends on a
    boundary. The buggy split passes where the last cache position stops it on a boundary
    first: with EAGLE (1600) the resumes at 331 and 1599, without (3200) the later three."""
    prompt_len = 3602

    def check() -> None:
        pos, ends = resume_at, []
        while pos < prompt_len:
            n = aligned_split(pos, prompt_len - pos, prompt_len, BLOCK, eagle, fixes)
            assert n > 0, f"no progress at {pos}"
            if pos % BLOCK:
                block_end = (pos // BLOCK + 1) * BLOCK
                assert pos + n <= block_end, f"[{pos}, {pos + n}) passes {block_end}"
            pos += n
            ends.append(pos)
        assert all(end % BLOCK == 0 for end in ends[:-1]), ends

    if fixes == BUGGY and (resume_at in (331, 1599)) == eagle:
        check()
    else:
        _expect(fixes, check)


@pytest.mark.parametrize("eagle", [True, False])
def test_a_prefill_alone_is_split_the_same_both_ways(eagle) -> None:
    """A budget that covers the prompt: the buggy split is the fixed one (upstream: a single
    request is accidentally safe); only the EAGLE back-off's stop splits it."""
    for n in range(1, 40):
        splits = {aligned_split(0, n, n, 8, eagle, f) for f in (ALL_FIXES, BUGGY)}
        assert len(splits) == 1, (n, splits)


def test_entries_are_hashed_at_their_block_end_and_hit_whole_blocks() -> None:
    """Entry p is hashed as the tokens up to (p + 1) * block once passed; a request sharing
    those tokens resumes there (never at its last token), its earlier entries null."""
    states = AlignStates(8, 2, 4, "cpu")
    tokens = list(range(10))
    states.admit("a", tokens)
    assert states.final("a", 4) == 0 and states.final("a", 10) == 1
    states.cache_blocks("a", tokens, 10)
    assert states.hashed == {0}, "entry 1 (tokens 4-8) holds the state at 10: it is hashed"
    states.finish("a")
    assert states.admit("b", [*tokens[:4], 9, 9]) == 4 and states.entries["b"] == [0]
    assert states.admit("c", tokens[:4]) == 0, "the last token is always computed"
    assert states.admit("d", [1, *tokens[1:]]) == 0


@VARIANTS
def test_a_resume_from_a_poisoned_entry_restores_a_truncated_state(device, fixes) -> None:
    """The engine: a 10-token prefill first, a 12-token producer given the 6 tokens left of the
    budget, then a consumer sharing the producer's first block. Buggy: the consumer resumes
    from entry 0 hashed as the state at 8, holding the state at 6: its logits differ."""
    engine = MambaAlignEngine(device, fixes, block=8, budget=16, eagle=True)
    first, producer = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8, 4, 5]
    engine.prefill({"first": first, "producer": producer})
    consumer = [*producer[:8], 11, 12]
    hit, logits = engine.prefill({"consumer": consumer})["consumer"]
    expected = mixer_reference(engine.weights, consumer)
    same = torch.allclose(logits.double().cpu(), expected, rtol=1e-4, atol=1e-4)
    if fixes == ALL_FIXES:
        assert same and hit == 0, f"hit {hit}: the producer's first entry stays null"
    else:
        assert hit == 8 and not same, "the consumer resumed from the poisoned entry"
