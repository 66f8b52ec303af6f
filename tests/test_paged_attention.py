"""Paged KV cache writes and paged causal attention against float64 references, at the
miniature's head size and upstream's (its paged attention's 64, 80, 96, 112, 120, 128, 192 and
256; test_cache.py runs 64, 80 and 256), whose blocks are padded to a power of two and masked;
in float32 and upstream's float16 and bfloat16, each with its cache in the model's dtype or in
fp8 (tests/dtypes.py); and with fewer KV heads than query heads (grouped-query attention, and
multi-query with one KV head)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (
    FP8_KV_CACHE,
    paged_attention,
    paged_attention_reference,
    require_fp8_support,
    reshape_and_cache,
    reshape_and_cache_reference,
)
from tests.dtypes import (
    ATTENTION_TOLERANCE,
    K_SCALE,
    KV_DTYPES,
    V_SCALE,
    cases,
    kv_scales,
    reference_scales,
    small_values,
)

SHAPES = [
    (2, 16, 4),
    (2, 16, 16),
    (3, 24, 16),  # a small head size: 72 cache columns of 128
    (2, 80, 16),
    (3, 96, 4),
    (2, 112, 16),
    (1, 120, 16),
    (2, 192, 16),
    (2, 256, 16),
]


# (heads, kv_heads, dim, block_size): grouped-query attention, two query heads on each KV head;
# multi-query, three on one
GROUPED = [(4, 2, 16, 4), (3, 1, 16, 16)]


def _cache_then_attend(device, heads, kv_heads, dim, block_size, dtype, kv_cache_dtype) -> None:
    """Three rows' tokens written to the cache (keys and values of kv_heads heads), then their
    queries (heads heads) attending causally to them, against the references."""
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
    q = small_values(gen, tokens, heads, dim).to(dtype)
    k, v = (small_values(gen, tokens, kv_heads, dim).to(dtype) for _ in range(2))
    fp8 = kv_cache_dtype == "fp8"
    cache_dtype = FP8_KV_CACHE if fp8 else dtype
    k_cache = torch.full((num_blocks, block_size, kv_heads, dim), float("nan"), dtype=cache_dtype)
    v_cache = k_cache.clone()
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    ref_scales = reference_scales(kv_cache_dtype)
    reshape_and_cache_reference(k, v, k_ref, v_ref, slots, **ref_scales)
    dev = lambda t: t.to(device)
    k_dev, v_dev, scales = dev(k_cache), dev(v_cache), kv_scales(kv_cache_dtype, device)
    reshape_and_cache(dev(k), dev(v), k_dev, v_dev, dev(slots), **scales)
    for got, expected in ((k_dev, k_ref), (v_dev, v_ref)):  # NaN: slots never written
        assert torch.equal(got.cpu().double().nan_to_num(7.0), expected.double().nan_to_num(7.0))
    # a NaN row after the last token's: a store past a head's dim would reach it
    guarded = torch.full((tokens + 1, heads, dim), float("nan"), dtype=dtype, device=device)
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
        **scales,
    )
    expected = paged_attention_reference(
        q, k_ref, v_ref, table, token_rows, positions, dim**-0.5, **ref_scales
    )
    torch.testing.assert_close(out.cpu().double(), expected, **ATTENTION_TOLERANCE[dtype])
    assert guarded[tokens].isnan().all(), "paged attention wrote past the last head's dim"


@pytest.mark.parametrize(
    ("heads", "dim", "block_size", "dtype", "kv_cache_dtype"), cases(SHAPES, KV_DTYPES, cpu=[0, 3])
)
def test_cache_then_attend_matches_reference(
    device, heads, dim, block_size, dtype, kv_cache_dtype
) -> None:
    _cache_then_attend(device, heads, heads, dim, block_size, dtype, kv_cache_dtype)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "block_size", "dtype", "kv_cache_dtype"),
    cases(GROUPED, KV_DTYPES, cpu=[]),
)
def test_grouped_kv_heads_match_reference(
    device, heads, kv_heads, dim, block_size, dtype, kv_cache_dtype
) -> None:
    """A cache of fewer KV heads than query heads: query head h reads KV head
    h // (heads // kv_heads), as the reference does."""
    _cache_then_attend(device, heads, kv_heads, dim, block_size, dtype, kv_cache_dtype)


def test_heads_must_be_a_multiple_of_kv_heads(device) -> None:
    query = torch.zeros(1, 6, 16, device=device)
    cache = torch.zeros(1, 4, 4, 16, device=device)  # 4 KV heads: 6 query heads do not share them
    i32 = dict(dtype=torch.int32, device=device)
    table, rows = torch.zeros(1, 1, **i32), torch.zeros(1, **i32)
    positions = torch.zeros(1, dtype=torch.int64, device=device)
    with pytest.raises(ValueError, match="num_heads = 6 is not a multiple of num_kv_heads = 4"):
        paged_attention(query, cache, cache, table, rows, positions, query.clone(), 1.0, 4)


def test_padding_slots_write_nothing(device) -> None:
    k_cache = torch.zeros(2, 4, 2, 16, device=device)
    v_cache = torch.zeros_like(k_cache)
    key = torch.ones(3, 2, 16, device=device)
    reshape_and_cache(key, key, k_cache, v_cache, torch.tensor([5, -1, -1], device=device))
    written = (k_cache.reshape(8, -1) != 0).any(-1).nonzero().flatten().tolist()
    assert written == [5], f"slots written: {written}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fp8_cache_write_rounds_any_value(device, dtype) -> None:
    """Values e4m3 does not hold round in the cache write: dequantized, they are the inputs
    within upstream's tolerance (test_cache.py, kv_cache_dtype "fp8": atol 1e-3, rtol 0.1, with
    its scales amax / 64). A GPU only: Triton's interpreter (3.9) narrows float32 to e4m3 without
    carrying a rounded-up mantissa into the exponent (1.9375 -> 1.0, not 2.0) and rounds ties
    away from even (1.0625 -> 1.125), so the CPU cases above use values e4m3 holds exactly."""
    gen, heads, dim, num_blocks, block_size = torch.Generator().manual_seed(5), 8, 64, 8, 16
    key, value = (torch.randn(42, heads, dim, generator=gen).to(dtype) for _ in range(2))
    k_scale, v_scale = ((t.float().amax() / 64.0).reshape(1).to(device) for t in (key, value))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:42]
    shape = (num_blocks, block_size, heads, dim)
    k_cache, v_cache = (torch.zeros(shape, dtype=FP8_KV_CACHE, device=device) for _ in range(2))
    dev = lambda t: t.to(device)
    reshape_and_cache(
        dev(key), dev(value), k_cache, v_cache, dev(slots), k_scale=k_scale, v_scale=v_scale
    )
    for cache, x, s in ((k_cache, key, k_scale), (v_cache, value, v_scale)):
        got = cache.cpu().reshape(-1, heads, dim)[slots].double() * s.cpu().double()
        torch.testing.assert_close(got, x.double(), atol=1e-3, rtol=0.1)


def test_fp8_scales_are_read_when_the_kernels_run(device) -> None:
    """k_scale and v_scale are tensors the kernels load (upstream's convention): updated in
    place, as between two replays of a CUDA graph, the next write and the next read use them."""
    k_scale, v_scale = (torch.tensor([s], device=device) for s in (K_SCALE, V_SCALE))
    scales = dict(k_scale=k_scale, v_scale=v_scale)
    key = torch.full((1, 1, 16), 0.5, device=device)
    k_cache = torch.zeros(1, 4, 1, 16, dtype=FP8_KV_CACHE, device=device)
    v_cache = torch.zeros_like(k_cache)
    write = lambda slot: reshape_and_cache(
        key, key, k_cache, v_cache, torch.tensor([slot], device=device), **scales
    )
    out = torch.empty(1, 1, 16, device=device)
    i32 = dict(dtype=torch.int32, device=device)
    attend = lambda: paged_attention(
        key,
        k_cache,
        v_cache,
        torch.zeros(1, 1, **i32),
        torch.zeros(1, **i32),
        torch.zeros(1, dtype=torch.int64, device=device),
        out,
        1.0,
        max_model_len=4,
        **scales,
    )
    write(0)
    attend()  # one position: its value, 0.5 / 0.25 in the cache, times v_scale
    assert (out == 0.5).all(), out
    k_scale.mul_(2)
    v_scale.mul_(2)
    write(1)
    attend()
    assert k_cache[0, :2, 0, 0].double().tolist() == [1.0, 0.5], "the write kept the old k_scale"
    assert (out == 1.0).all(), f"the read kept the old v_scale: {out}"


def test_launchers_refuse_caches_they_cannot_serve(device) -> None:
    key = torch.zeros(1, 1, 16, dtype=torch.bfloat16, device=device)
    slots = torch.zeros(1, dtype=torch.int64, device=device)
    cache = lambda dtype: torch.zeros(1, 4, 1, 16, dtype=dtype, device=device)
    with pytest.raises(ValueError, match=r"k_cache: torch\.float16"):
        reshape_and_cache(key, key, cache(torch.float16), cache(torch.float16), slots)
    with pytest.raises(AssertionError, match="an fp8 KV cache needs k_scale"):
        reshape_and_cache(key, key, cache(FP8_KV_CACHE), cache(FP8_KV_CACHE), slots)
    scale = torch.ones(1, device=device)
    with pytest.raises(AssertionError, match="scales apply to an fp8 KV cache only"):
        reshape_and_cache(
            key, key, cache(key.dtype), cache(key.dtype), slots, k_scale=scale, v_scale=scale
        )


@pytest.mark.parametrize(
    ("capability", "refused"), [((8, 0), True), ((8, 9), False), ((9, 0), False)]
)
def test_an_fp8_cache_is_refused_before_sm_89(monkeypatch, capability, refused) -> None:
    """Triton has no fp8e4nv before sm_89: the launcher says so (no GPU needed: the capability is
    what the check reads)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    sm = "sm_{}{}".format(*capability)
    if refused:
        with pytest.raises(ValueError, match=f"needs sm_89 or later .*this GPU is {sm}"):
            require_fp8_support(torch.device("cuda"))
    else:
        require_fp8_support(torch.device("cuda"))
    require_fp8_support(torch.device("cpu"))  # the interpreter: never refused
