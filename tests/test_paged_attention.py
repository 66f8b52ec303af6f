"""Paged KV cache writes and paged causal attention against float64 references, at the
miniature's head size and upstream's (its paged attention's 64, 80, 96, 112, 120, 128, 192 and
256; test_cache.py runs 64, 80 and 256), whose blocks are padded to a power of two and masked."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    paged_attention,
    paged_attention_reference,
    reshape_and_cache,
    reshape_and_cache_reference,
)


@pytest.mark.parametrize(
    ("heads", "dim", "block_size"),
    [
        (2, 16, 4),
        (2, 16, 16),
        (3, 24, 16),  # a small head size: 72 cache columns of 128
        (2, 80, 16),
        (3, 96, 4),
        (2, 112, 16),
        (1, 120, 16),
        (2, 192, 16),
        (2, 256, 16),
    ],
)
def test_cache_then_attend_matches_reference(device, heads, dim, block_size) -> None:
    num_blocks, gen = 24, torch.Generator().manual_seed(2)
    lengths = [5, 1, 19]  # tokens of three rows written this step, positions 0..len-1
    tokens = sum(lengths)
    token_rows = torch.tensor(
        [r for r, n in enumerate(lengths) for _ in range(n)], dtype=torch.int32
    )
    positions = torch.tensor([p for n in lengths for p in range(n)])
    perm = torch.randperm(num_blocks, generator=gen).int()
    table = torch.zeros(3, 8, dtype=torch.int32)
    for r, n in enumerate(lengths):
        need = -(-n // block_size)
        table[r, :need], perm = perm[:need], perm[need:]
    slots = torch.tensor(
        [
            int(table[r, p // block_size]) * block_size + p % block_size
            for r, p in zip(token_rows.tolist(), positions.tolist(), strict=True)
        ]
    )
    q, k, v = (torch.randn(tokens, heads, dim, generator=gen) for _ in range(3))
    k_cache = torch.full((num_blocks, block_size, heads, dim), float("nan"))
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(k, v, k_ref, v_ref, slots)
    dev = lambda t: t.to(device)
    k_dev, v_dev = dev(k_cache), dev(v_cache)
    reshape_and_cache(dev(k), dev(v), k_dev, v_dev, dev(slots))
    assert torch.equal(k_dev.cpu().nan_to_num(7.0), k_ref.nan_to_num(7.0))
    assert torch.equal(v_dev.cpu().nan_to_num(7.0), v_ref.nan_to_num(7.0))
    # a NaN row after the last token's: a store past a head's dim would reach it
    guarded = torch.full((tokens + 1, heads, dim), float("nan"), device=device)
    out = guarded[:tokens]
    paged_attention(
        dev(q),
        k_dev,
        v_dev,
        dev(table),
        dev(token_rows),
        dev(positions),
        out,
        dim**-0.5,
        max_model_len=32,
    )
    expected = paged_attention_reference(q, k_ref, v_ref, table, token_rows, positions, dim**-0.5)
    torch.testing.assert_close(out.cpu().double(), expected, rtol=1e-4, atol=1e-5)
    assert guarded[tokens].isnan().all(), "paged attention wrote past the last head's dim"


def test_padding_slots_write_nothing(device) -> None:
    k_cache = torch.zeros(2, 4, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 16, device=device)
    reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([5, -1, -1], device=device))
    written = (k_cache.reshape(8, -1) != 0).any(-1).nonzero().flatten().tolist()
    assert written == [5], f"slots written: {written}"
