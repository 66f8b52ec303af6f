"""vLLM's own parametrizations of its KV cache write and its Triton paged attention, run against
this project's `reshape_and_cache` and `paged_attention` (the tests are written here; upstream
read as stored at commits 00228592 and 003ee616).

(a) tests/kernels/attention/test_cache.py, test_reshape_and_cache_flash: 42 tokens and 1024 or
10000 blocks, each halved inside the test (21 tokens; 512 or 5000 blocks), 8 heads, head sizes
64, 80 and 256, block sizes 8, 16 and 32, bfloat16 and float32, caches "auto", "fp8" and
"nvfp4", layouts NHD and HND (NHC and HNC in one version), scales per tensor (amax / 64) or per
head, the CUDA and the Triton implementation, seed 0, one GPU: 864 cases. The launcher expresses
NHD, per-tensor scales and the auto and fp8 caches, under either implementation: 144 upstream
cases, 72 here (both implementations are the one launcher). Not expressible: the HND layout,
per-head scales, nvfp4 (720 cases; before Blackwell upstream itself runs 360 of the 864, 216 of
them not expressible here). One stored version adds test_reshape_and_cache_flash_unaligned_rows
(13 heads of 46, block size 16, 128 blocks halved, the same dtypes, auto and fp8, both layouts
and implementations: 16 cases, 8 expressible, 4 here). Checks: each written slot holds its
token (a copy: == where upstream uses assert_close's defaults); fp8 entries times their scale
within upstream's atol 1e-3, rtol 0.1 of the token; every other slot keeps its NaN sentinel.

(b) tests/kernels/attention/test_triton_unified_attention.py, the closest to `paged_attention`:
its cache is [num_blocks, block_size, kv_heads, head_size], as here; its queries are the last
query_len positions of paged sequences attending causally (decode, chunked prefill and prefill
in one batch), which positions and token_rows express; its fp8 cache has per-tensor scales 0.5
and 0.25 (a [num_seqs, kv_heads] tensor of one value) under a bfloat16 query. test_attention.py
is not: its test_paged_attention is a ROCm kernel's, one query per sequence, keys laid out
[blocks, heads, head_size / x, block_size, x]; none of its 96 cases is expressible.
test_triton_unified_attn: 2 batches of (query_len, kv_len), heads (4, 4), (8, 2) and (5, 1),
head sizes 128 and 256, block size 16, sliding window None, 64, 128 or 256, bfloat16, soft cap
None or 50, 32768 or 2048 blocks, a bfloat16 or fp8 query, seq_threshold_3D 0 or 8: 768 cases.
test_triton_unified_attn_bf16_query_fp8_kv: the same batches, heads, head sizes, block size and
block counts, an fp8 cache, seq_threshold_3D 0 or 8: 48 cases. Expressible: all three heads
(the launcher serves num_heads a multiple of num_kv_heads: grouped-query attention, and
multi-query with one KV head), no window, no soft cap, a bfloat16 query: 48 + 48 upstream cases,
24 + 24 here (seq_threshold_3D picks upstream's 2D or 3D decode kernel; the launcher has one).
Not expressible: sliding windows, soft caps, an fp8 query (720 cases of the first test; every
case of the second is expressible), and the file's nvfp4 tests. Upstream fills whole caches;
here only the slots the sequences read hold values, every other slot NaN (block tables drawn as
upstream's, repeats and all). The float64 reference reads the cache's entries times their
scales, within upstream's bfloat16 tolerance (atol 1.5e-2, rtol 1e-2) for both caches:
upstream's fp8 one (1.5e-1) covers quantization against an unquantized reference, which this is not.

A GPU runs every case. The interpreter runs 3 cache writes, values e4m3 holds exactly for an
fp8 cache (tests/dtypes.py: it rounds to e4m3 wrongly), and, for attention, a batch of its own
("short": upstream's kinds of sequence, shorter; upstream's smallest batch takes it 12 s) at
heads (4, 4) under both caches and (8, 2) under the auto one, over entries torch rounded to
e4m3, which it widens exactly."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.paged_attention import (
    FP8_KV_CACHE,
    paged_attention,
    reshape_and_cache,
)
from tests.dtypes import (
    ATTENTION_TOLERANCE,
    K_SCALE,
    NAMES,
    V_SCALE,
    kv_cache,
    kv_scales,
    reference_scales,
    small_values,
)

NAN = float("nan")
TOKENS = 42 // 2  # upstream halves its token and block counts inside the test
DTYPES = (torch.bfloat16, torch.float32)
CACHE_CASES = [
    *itertools.product(
        [8], (64, 80, 256), (8, 16, 32), (1024 // 2, 10000 // 2), DTYPES, ("auto", "fp8")
    ),
    *itertools.product([13], [46], [16], [128 // 2], DTYPES, ("auto", "fp8")),
]
CACHE_ON_CPU = [
    (8, 80, 16, 512, torch.bfloat16, "fp8"),
    (8, 80, 8, 512, torch.float32, "auto"),
    (13, 46, 16, 64, torch.bfloat16, "auto"),
]
BATCHES = {  # (query_len, kv_len) per sequence
    "mixed": ((1, 1328), (5, 18), (129, 463)),
    "decode": ((1, 523), (1, 37), (1, 2011)),
    # not upstream's: its kinds of sequence (decode, chunked prefill, prefill) at lengths the
    # interpreter runs in about a second (upstream's smallest batch takes it 12 s)
    "short": ((1, 40), (4, 18), (3, 3)),
}
HEADS = ((4, 4), (8, 2), (5, 1))  # upstream's (num_query_heads, num_kv_heads)
BLOCK_SIZE = 16
ATTENTION_ON_CPU = [
    ("short", 4, 4, 128, 2048, "auto"),
    ("short", 4, 4, 128, 2048, "fp8"),
    ("short", 8, 2, 128, 2048, "auto"),  # grouped: four query heads on each KV head
]
ATTENTION_CASES = [
    *(
        (batch, num_heads, num_kv_heads, head_size, num_blocks, cache)
        for batch, (num_heads, num_kv_heads), head_size, num_blocks, cache in itertools.product(
            ("mixed", "decode"), HEADS, (128, 256), (32768, 2048), ("auto", "fp8")
        )
    ),
    *ATTENTION_ON_CPU,
]


def _params(cases: list[tuple], on_cpu: list[tuple]) -> list:
    name = lambda case: "-".join(NAMES.get(v, str(v)) for v in case)
    mark = lambda case: () if case in on_cpu else pytest.mark.gpu
    return [pytest.param(*case, id=name(case), marks=mark(case)) for case in cases]


def _raw(cache: torch.Tensor) -> torch.Tensor:
    """The cache to index or scatter into: an fp8 cache as its bytes."""
    return cache.view(torch.uint8) if cache.dtype == FP8_KV_CACHE else cache


def _is_nan(cache: torch.Tensor) -> torch.Tensor:
    if cache.dtype == FP8_KV_CACHE:  # e4m3fn's NaN: S.1111.111
        return (cache.view(torch.uint8) & 0x7F) == 0x7F
    return cache.isnan()


@pytest.mark.parametrize(
    ("num_heads", "head_size", "block_size", "num_blocks", "dtype", "kv_cache_dtype"),
    _params(CACHE_CASES, CACHE_ON_CPU),
)
def test_reshape_and_cache_flash(
    device, num_heads, head_size, block_size, num_blocks, dtype, kv_cache_dtype
) -> None:
    gen, fp8 = torch.Generator().manual_seed(0), kv_cache_dtype == "fp8"
    exact = fp8 and device == "cpu"  # the interpreter's e4m3 rounding: values e4m3 holds
    draw = small_values if exact else lambda g, *shape: torch.randn(*shape, generator=g)
    key, value = (draw(gen, TOKENS, num_heads, head_size).to(dtype) for _ in range(2))
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:TOKENS]
    # upstream's scales: amax / 64 (with small_values 1/32: the entries stay exact)
    k_scale, v_scale = ((x.float().amax() / 64).reshape(1).to(device) for x in (key, value))
    scales = dict(k_scale=k_scale, v_scale=v_scale) if fp8 else {}
    shape = (num_blocks, block_size, num_heads, head_size)
    caches = [
        torch.full(shape, NAN, dtype=FP8_KV_CACHE if fp8 else dtype, device=device)
        for _ in range(2)
    ]
    dev_slots = slots.to(device)
    reshape_and_cache(key.to(device), value.to(device), *caches, dev_slots, **scales)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)
    written[dev_slots] = True
    for cache, x, scale in zip(caches, (key, value), (k_scale, v_scale), strict=True):
        rows = _raw(cache).view(-1, num_heads, head_size)[dev_slots].cpu().view(cache.dtype)
        if not fp8:
            assert torch.equal(rows, x), "a written slot differs from its token"
        else:
            got = rows.double() * scale.cpu().double()
            tolerance = dict(atol=0, rtol=0) if exact else dict(atol=1e-3, rtol=0.1)
            torch.testing.assert_close(got, x.double(), **tolerance)
        lost = ~(_is_nan(cache).view(len(written), -1).all(-1) | written)
        assert not lost.any(), f"{int(lost.sum())} slots never written lost their NaN"


def _reference(query, keys, values, scale: float, kv_cache_dtype: str) -> torch.Tensor:
    """float64: the last len(query) positions of one sequence attend causally to its keys (the
    cache's entries times their scales), query head h to KV head h // (num_heads // kv_heads)."""
    scales = reference_scales(kv_cache_dtype)
    group = query.shape[1] // keys.shape[1]
    keys = (keys.double() * scales.get("k_scale", 1.0)).repeat_interleave(group, 1)
    values = (values.double() * scales.get("v_scale", 1.0)).repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale
    q_pos = torch.arange(len(keys) - len(query), len(keys))
    scores.masked_fill_(torch.arange(len(keys)) > q_pos[:, None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)


@pytest.mark.parametrize(
    ("batch", "num_heads", "num_kv_heads", "head_size", "num_blocks", "kv_cache_dtype"),
    _params(ATTENTION_CASES, ATTENTION_ON_CPU),
)
def test_triton_unified_attention(
    device, batch, num_heads, num_kv_heads, head_size, num_blocks, kv_cache_dtype
) -> None:
    gen, dtype, seqs = torch.Generator().manual_seed(0), torch.bfloat16, BATCHES[batch]
    max_kv_len = max(kv_len for _, kv_len in seqs)
    table = torch.randint(
        0, num_blocks, (len(seqs), -(-max_kv_len // BLOCK_SIZE)), generator=gen
    ).int()
    token_rows = torch.tensor(
        [row for row, (q_len, _) in enumerate(seqs) for _ in range(q_len)], dtype=torch.int32
    )
    positions = torch.tensor([p for q_len, kv_len in seqs for p in range(kv_len - q_len, kv_len)])
    seq_slots = []  # each sequence's slots: a block may repeat, as upstream's table draws it
    for row, (_, kv_len) in enumerate(seqs):
        p = torch.arange(kv_len)
        seq_slots.append(table[row, p // BLOCK_SIZE].long() * BLOCK_SIZE + p % BLOCK_SIZE)
    read = torch.cat(seq_slots).unique()  # the only slots holding values
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_size)
    cache_dtype = FP8_KV_CACHE if kv_cache_dtype == "fp8" else dtype
    caches = []
    for scale in (K_SCALE, V_SCALE):
        cache = torch.full(shape, NAN, dtype=cache_dtype, device=device)
        values = torch.randn(len(read), num_kv_heads, head_size, generator=gen).to(dtype)
        entries = _raw(kv_cache(values, dtype, kv_cache_dtype, scale))
        _raw(cache).view(-1, num_kv_heads, head_size)[read.to(device)] = entries.to(device)
        caches.append(cache)
    query = torch.randn(len(positions), num_heads, head_size, generator=gen).to(dtype)
    # a NaN row after the last token's: a store past the output would reach it
    guarded = torch.full(
        (len(positions) + 1, num_heads, head_size), NAN, dtype=dtype, device=device
    )
    out = guarded[:-1]
    dev = lambda t: t.to(device)
    paged_attention(
        dev(query),
        *caches,
        dev(table),
        dev(token_rows),
        dev(positions),
        out,
        head_size**-0.5,
        max_model_len=max_kv_len,
        **kv_scales(kv_cache_dtype, device),
    )
    # the reference reads each sequence's entries as the kernel got them
    expected = []
    for slots, q in zip(seq_slots, query.split([q_len for q_len, _ in seqs]), strict=True):
        k, v = (
            _raw(c).view(-1, num_kv_heads, head_size)[dev(slots)].cpu().view(cache_dtype)
            for c in caches
        )
        expected.append(_reference(q, k, v, head_size**-0.5, kv_cache_dtype))
    expected = torch.cat(expected)
    torch.testing.assert_close(out.cpu().double(), expected, **ATTENTION_TOLERANCE[dtype])
    assert guarded[-1].isnan().all(), "paged attention wrote past the last token"
