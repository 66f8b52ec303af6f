"""Split-KV decode attention: planner vs its reference, split + combine vs dense attention (at
the miniature's head size and upstream's; in float32 and upstream's float16 and bfloat16, each
with its cache in the model's dtype or in fp8: tests/dtypes.py), and what a plan made for other
lengths does."""

from __future__ import annotations

import pytest
import torch

from kernels.split_kv_attention import (
    combine_splits,
    plan_reference,
    plan_schedule,
    split_kv_attention,
    split_kv_attention_reference,
)
from tests.dtypes import (
    ATTENTION_TOLERANCE,
    K_SCALE,
    KV_DTYPES,
    V_SCALE,
    cases,
    kv_cache,
    kv_scales,
    reference_scales,
    small_values,
)

pytestmark = pytest.mark.lazy_attn_state  # the lazily planned kernels of vLLM #42444

HEADS, DIM, BLOCK_SIZE, NUM_PARTS, MAX_LEN = 2, 16, 4, 4, 48


def _cache(lengths, seed=4, heads=HEADS, dim=DIM, dtype=torch.float32, kv_cache_dtype="auto"):
    """(query, k_cache, v_cache, block table) of small values (tests/dtypes.py)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    table = torch.zeros(len(lengths), MAX_LEN // BLOCK_SIZE, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).int()
    for r, n in enumerate(lengths):
        need = -(-n // BLOCK_SIZE)
        table[r, :need], perm = perm[:need], perm[need:]
    k_cache, v_cache = (
        kv_cache(small_values(gen, num_blocks, BLOCK_SIZE, heads, dim), dtype, kv_cache_dtype, s)
        for s in (K_SCALE, V_SCALE)
    )
    q = small_values(gen, len(lengths), heads, dim).to(dtype)
    return q, k_cache, v_cache, table


def split_and_combine(
    device, q, k_cache, v_cache, table, seq_lens, meta, max_len=MAX_LEN, kv_cache_dtype="auto"
):
    """Split (into NaN-sentinel partials) and combine with plan `meta`: [reqs, heads, dim]."""
    dev = lambda t: t.to(device)
    parts, (reqs, heads, dim) = meta.shape[0], q.shape
    # NaN sentinels: the combine must read only the slots the plan's parts wrote
    partial_out = torch.full((parts, reqs, heads, dim), float("nan"), device=device)
    partial_lse = torch.full((parts, reqs, heads), float("nan"), device=device)
    # a NaN row after the last request's: a store past a head's dim would reach it
    guarded = torch.full((reqs + 1, heads, dim), float("nan"), dtype=q.dtype, device=device)
    out = guarded[:reqs]
    split_kv_attention(
        dev(q),
        dev(k_cache),
        dev(v_cache),
        dev(table),
        dev(seq_lens),
        meta,
        partial_out,
        partial_lse,
        dim**-0.5,
        max_len,
        **kv_scales(kv_cache_dtype, device),
    )
    combine_splits(partial_out, partial_lse, meta, out)
    assert guarded[reqs].isnan().all(), "the combine wrote past the last head's dim"
    return out.cpu().double()


@pytest.mark.parametrize("lengths", [[5, 17, 1, 40], [48], [3, 3, 3, 3, 3, 3, 3]])
def test_plan_matches_reference(device, lengths) -> None:
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    meta = torch.empty(NUM_PARTS, 4, dtype=torch.int32, device=device)
    splits = torch.empty(len(lengths), dtype=torch.int32, device=device)
    plan_schedule(seq_lens, meta, splits)
    rows, expected_splits = plan_reference(lengths, NUM_PARTS)
    assert [tuple(r) for r in meta.tolist()] == rows
    assert splits.tolist() == expected_splits


SHAPES = [
    ([5, 17, 1, 40], HEADS, DIM),
    ([48], HEADS, DIM),
    ([3, 3, 3, 3, 3, 3, 3], HEADS, DIM),
    # upstream's head sizes, and a small one: blocks padded to a power of two and masked
    ([5, 17, 1, 40], 3, 24),
    ([5, 17, 1, 40], 2, 80),
    ([48], 1, 96),
    ([5, 17, 1, 40], 2, 112),
    ([3, 3, 3, 3, 3, 3, 3], 2, 192),
    ([5, 17, 1, 40], 2, 256),
]


@pytest.mark.parametrize(
    ("lengths", "heads", "dim", "dtype", "kv_cache_dtype"), cases(SHAPES, KV_DTYPES, cpu=[0, 4])
)
def test_split_and_combine_match_dense_attention(
    device, lengths, heads, dim, dtype, kv_cache_dtype
) -> None:
    q, k_cache, v_cache, table = _cache(lengths, 4, heads, dim, dtype, kv_cache_dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    meta = torch.empty(NUM_PARTS, 4, dtype=torch.int32, device=device)
    plan_schedule(seq_lens, meta, torch.empty(len(lengths), dtype=torch.int32, device=device))
    got = split_and_combine(
        device, q, k_cache, v_cache, table, seq_lens.cpu(), meta, kv_cache_dtype=kv_cache_dtype
    )
    expected = split_kv_attention_reference(
        q, k_cache, v_cache, table, seq_lens.cpu(), dim**-0.5, **reference_scales(kv_cache_dtype)
    )
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[dtype])


def test_a_plan_for_other_lengths_gives_a_wrong_result(device) -> None:
    lengths = [5, 17, 1, 40]
    q, k_cache, v_cache, table = _cache(lengths)
    stale = torch.empty(NUM_PARTS, 4, dtype=torch.int32, device=device)
    plan_schedule(
        torch.ones(4, dtype=torch.int32, device=device),
        stale,
        torch.empty(4, dtype=torch.int32, device=device),
    )  # warm-up lengths
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    got = split_and_combine(device, q, k_cache, v_cache, table, seq_lens, stale)
    expected = split_kv_attention_reference(q, k_cache, v_cache, table, seq_lens, DIM**-0.5)
    assert not torch.allclose(got, expected, rtol=1e-3, atol=1e-3)
