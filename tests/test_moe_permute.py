"""The expert-sorted MoE (kernels/moe_permute.py: sort, GEMM, finalize) against its float64
reference, and the sort's contract: distinct experts per token, every id an expert.

A pair the contract does not cover gets no row: its entry of `unpermuted_rows` keeps what it
held, which the finalize gathers through unless it skips the pair. These tests never let it
gather the poison (that faults; the scenarios show it in a child): they show the entry left
unwritten, and with an in-bounds poison what the finalize does with it.
"""

from __future__ import annotations

import pytest
import torch

from kernels.moe_permute import moe_finalize, moe_permute_experts, moe_permute_reference

POISON = 2**31 - 1


def _distinct_ids(gen, tokens: int, experts: int, top_k: int) -> torch.Tensor:
    rows = [torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]
    return torch.stack(rows).to(torch.int32)


def _run(device, h, w, ids, weights, *, poison=POISON, skip_invalid=True, dtype=torch.float32):
    """(unpermuted_rows, finalized output): the output only where `poison` is a row in bounds
    (-7 elsewhere: the finalize would gather past the buffer)."""
    tokens, top_k = ids.shape
    ids, weights = ids.to(device), weights.to(device)
    rows = torch.full((tokens * top_k,), poison, dtype=torch.int32, device=device)
    permuted = torch.zeros(tokens * top_k, w.shape[1], dtype=dtype, device=device)
    h, w = h.to(device, dtype), w.to(device, dtype)
    moe_permute_experts(h, w, ids, permuted, rows)
    out = torch.full((tokens, w.shape[1]), -7.0, dtype=dtype, device=device)
    if 0 <= poison < tokens * top_k:
        moe_finalize(permuted, rows, ids, weights, out, w.shape[0], skip_invalid=skip_invalid)
    return rows.cpu(), out.cpu()


def _inputs(tokens: int, experts: int, hidden: int, n: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randint(-2, 3, (tokens, hidden), generator=gen).float()
    w = torch.randint(-2, 3, (experts, n, hidden), generator=gen).float()
    weights = torch.randint(1, 4, (tokens, top_k), generator=gen).float() / 4
    return h, w, _distinct_ids(gen, tokens, experts, top_k), weights


@pytest.mark.parametrize(
    ("tokens", "experts", "hidden", "n", "top_k"),
    [
        (5, 8, 16, 16, 2),
        (1, 3, 32, 32, 3),
        (67, 8, 40, 24, 2),
        (130, 5, 33, 70, 4),
        # fewer than 8 experts over several tokens (wrong rows on an H200 with 4 expert columns)
        (9, 4, 32, 32, 2),
        (9, 2, 16, 16, 2),
    ],
)
def test_sorted_experts_match_the_reference(device, tokens, experts, hidden, n, top_k) -> None:
    """Distinct ids: every pair gets a row (the rows are a permutation), and the finalized
    output is the dense reference's, exactly (small integers and quarters in float32)."""
    h, w, ids, weights = _inputs(tokens, experts, hidden, n, top_k)
    rows, _ = _run(device, h, w, ids, weights, poison=-1)
    assert sorted(rows.tolist()) == list(range(tokens * top_k)), rows
    expert_of_row = ids.flatten()[torch.argsort(rows)]
    assert (expert_of_row.diff() >= 0).all(), "rows not in expert order"
    _, out = _run(device, h, w, ids, weights, poison=0)
    torch.testing.assert_close(out.double(), moe_permute_reference(h, w, ids, weights))


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_16_bit_activations_accumulate_in_float32(device, dtype) -> None:
    """On the CPU; a GPU refuses 16-bit activations (open: its outputs were wrong on an H100,
    89% of them off by up to 40, 2026-11-25)."""
    h, w, ids, weights = _inputs(9, 8, 32, 32, 2, seed=1)
    if device == "cuda":
        with pytest.raises(ValueError, match="refused"):
            _run(device, h, w, ids, weights, poison=0, dtype=dtype)
        return
    _, out = _run(device, h, w, ids, weights, poison=0, dtype=dtype)
    want = moe_permute_reference(h, w, ids, weights)
    torch.testing.assert_close(out.double(), want, rtol=1e-2, atol=1e-2)


@pytest.mark.moe_pad_nan_topk
def test_a_duplicate_expert_gets_one_row(device) -> None:
    """vLLM #39391's consumer: a token naming expert 0 twice (a NaN row's top-k) gets a row for
    its first slot; its second slot's entry is never written."""
    h, w, ids, weights = _inputs(3, 8, 16, 16, 2)
    ids[1] = torch.tensor([0, 0])
    rows, _ = _run(device, h, w, ids, weights)
    assert rows[3] == POISON and (rows[[0, 1, 2, 4, 5]] != POISON).all(), rows
    ids[1] = torch.tensor([0, 1])  # the clamped row's picks: every pair placed
    rows, _ = _run(device, h, w, ids, weights)
    assert (rows != POISON).all(), rows


@pytest.mark.moe_pad_sentinel
def test_a_padding_pair_gets_no_row(device) -> None:
    """The -1 of a padding row names no expert: the sort places it nowhere."""
    h, w, ids, weights = _inputs(4, 8, 16, 16, 2)
    ids[2:], weights[2:] = -1, 0.0
    rows, _ = _run(device, h, w, ids, weights)
    assert (rows[4:] == POISON).all() and (rows[:4] != POISON).all(), rows


@pytest.mark.moe_pad_sentinel
def test_the_guard_skips_padding_pairs_the_unguarded_finalize_gathers_them(device) -> None:
    """With the entry's poison in bounds (row 0) and a weight of 1 on the padding pairs: the
    guarded finalize gives the padding rows 0 and the real rows the reference; the unguarded
    one gathers row 0 through the unwritten entries."""
    h, w, ids, weights = _inputs(4, 8, 16, 16, 2)
    ids[2:], weights[2:] = -1, 1.0
    want = moe_permute_reference(h, w, ids, weights)
    _, guarded = _run(device, h, w, ids, weights, poison=0)
    torch.testing.assert_close(guarded.double(), want)
    _, unguarded = _run(device, h, w, ids, weights, poison=0, skip_invalid=False)
    torch.testing.assert_close(unguarded[:2].double(), want[:2])
    assert (unguarded[2:] != 0).any(), "the unguarded finalize skipped the -1 pairs"
