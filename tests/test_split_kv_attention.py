"""Split-KV decode attention: planner vs its reference, split + combine vs dense attention (at
the miniature's head size and upstream's; in float32 and upstream's float16 and bfloat16, each
with its cache in the model's dtype or in fp8: tests/dtypes.py; with fewer KV heads than query
heads: grouped-query and multi-query attention; at part counts that are not powers of two, as
FlashMLA's are), and what a plan made for other lengths does."""

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


def _cache(
    lengths, seed=4, heads=HEADS, dim=DIM, dtype=torch.float32, kv_cache_dtype="auto", kv_heads=None
):
    """(query [reqs, heads, dim], k_cache, v_cache [blocks, BLOCK_SIZE, kv_heads (default: heads),
    dim], block table) of small values (tests/dtypes.py)."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = 40
    table = torch.zeros(len(lengths), MAX_LEN // BLOCK_SIZE, dtype=torch.int32)
    perm = torch.randperm(num_blocks, generator=gen).int()
    for r, n in enumerate(lengths):
        need = -(-n // BLOCK_SIZE)
        table[r, :need], perm = perm[:need], perm[need:]
    shape = (num_blocks, BLOCK_SIZE, kv_heads or heads, dim)
    k_cache, v_cache = (
        kv_cache(small_values(gen, *shape), dtype, kv_cache_dtype, s) for s in (K_SCALE, V_SCALE)
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


def _plan(device, lengths, parts=NUM_PARTS) -> torch.Tensor:
    """tile_scheduler_metadata [parts, 4] for `lengths`, on the device."""
    meta = torch.empty(parts, 4, dtype=torch.int32, device=device)
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    plan_schedule(seq_lens, meta, torch.empty(len(lengths), dtype=torch.int32, device=device))
    return meta


def _check(
    device,
    lengths,
    meta,
    heads=HEADS,
    dim=DIM,
    dtype=torch.float32,
    kv_cache_dtype="auto",
    kv_heads=None,
) -> None:
    """Split and combine under plan `meta` match the dense reference on _cache's inputs."""
    q, k_cache, v_cache, table = _cache(lengths, 4, heads, dim, dtype, kv_cache_dtype, kv_heads)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    got = split_and_combine(
        device, q, k_cache, v_cache, table, seq_lens, meta, kv_cache_dtype=kv_cache_dtype
    )
    expected = split_kv_attention_reference(
        q, k_cache, v_cache, table, seq_lens, dim**-0.5, **reference_scales(kv_cache_dtype)
    )
    torch.testing.assert_close(got, expected, **ATTENTION_TOLERANCE[dtype])


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
    _check(device, lengths, _plan(device, lengths), heads, dim, dtype, kv_cache_dtype)


# (lengths, heads, kv_heads, dim): grouped-query attention, two query heads on each KV head;
# multi-query, three on one
GROUPED = [([5, 17, 1, 40], 4, 2, DIM), ([3, 3, 3, 3, 3, 3, 3], 3, 1, DIM)]


@pytest.mark.parametrize(
    ("lengths", "heads", "kv_heads", "dim", "dtype", "kv_cache_dtype"),
    cases(GROUPED, KV_DTYPES, cpu=[]),
)
def test_grouped_kv_heads_match_dense_attention(
    device, lengths, heads, kv_heads, dim, dtype, kv_cache_dtype
) -> None:
    """Query head h reads KV head h // (heads // kv_heads), as the reference does."""
    _check(device, lengths, _plan(device, lengths), heads, dim, dtype, kv_cache_dtype, kv_heads)


def test_heads_must_be_a_multiple_of_kv_heads(device) -> None:
    q, k_cache, v_cache, table = _cache([5], heads=6, kv_heads=4)
    seq_lens = torch.tensor([5], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_heads = 6 is not a multiple of num_kv_heads = 4"):
        split_and_combine(device, q, k_cache, v_cache, table, seq_lens, _plan(device, [5]))


@pytest.mark.parametrize("parts", [3, 6])
def test_part_counts_not_powers_of_two(device, parts) -> None:
    """FlashMLA's part counts are the SMs over the heads' tiles (132, 66, 33 on an H100): the
    kernels pad them to a power of two and mask the rest. The plan matches its reference and
    leaves the row after its last part alone; split and combine match dense attention."""
    lengths = [5, 17, 1, 40]
    guarded = torch.full((parts + 1, 4), -7, dtype=torch.int32, device=device)
    meta, splits = guarded[:parts], torch.empty(len(lengths), dtype=torch.int32, device=device)
    plan_schedule(torch.tensor(lengths, dtype=torch.int32, device=device), meta, splits)
    rows, expected_splits = plan_reference(lengths, parts)
    assert [tuple(r) for r in meta.tolist()] == rows
    assert splits.tolist() == expected_splits
    assert guarded[parts].tolist() == [-7] * 4, "the plan wrote past its last part"
    _check(device, lengths, meta)


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
