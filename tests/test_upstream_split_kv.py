"""Upstream's FlashMLA decode parametrization as a regression test of the split-KV launchers (the
sizes are vLLM's tests/kernels/attention/test_flashmla.py; the test is written here): batch 128;
1 or 2 query tokens per request, causal; mean cache length 4096, 8192 or 16384, fixed or varlen
(per request max(N(mean, mean / 2), s_q), truncated, seed 0); 16, 32, 64 or 128 query heads on
one KV head (multi-query); head dim 576, the value its first 512; cache blocks of 64, rows of a
multiple of 256 tokens, NaN past each length; bfloat16, float16, or an fp8 e4m3 query and cache
(unit descales, bfloat16 output): 144 cases. Upstream's assertion: the cosine gap
1 - 2<a, b> / (|a|^2 + |b|^2) of output and log-sum-exp against the reference below 1e-5 (the
fp8 output's: 1e-4).

How the launchers express a case: each query token is a request whose length is its causal
horizon (with s_q = 2 two requests share a block-table row); the cache is upstream's,
[blocks, 64, 1, 576], its one KV head read by every query head, passed as K and as V, and output
columns 512..575 are dropped (one head dim serves both); an fp8 query is held in bfloat16 (fp8
is a cache dtype only); the log-sum-exp, which they do not return, is merged here from the
split's partials over the parts the plan gives each request. The part count is FlashMLA's on a
132-SM H100, max(SMs // cdiv(s_q * h_q, 64), 1): 132, 66 or 33.

All 144 cases run on a GPU, against a float32 reference on the device, each within 12 GiB (a
quarter of an 80 GB H100 under -n 4). case_bytes bounds a case's memory: its cache as drawn (at
mean 16384 varlen, rows of 36608 tokens: 5.0 GiB in bfloat16 or float16; an fp8 cache is
rounded from a bfloat16 draw, 2.5 GiB more), the float32 partial workspaces
[parts, requests, h_q, 576] (2.3 GiB from 64 query rows a request up, the parts shrinking as the
rows grow; 0.6 GiB at 16 rows, 1.2 GiB at 32), and 0.5 GiB for the queries, outputs and the
reference's temporaries: from 1.6 GiB to 10.4 GiB (fp8 at mean 16384 varlen, 64 query rows or
more: 5 cases).

No upstream case fits the interpreter: it runs upstream's structure at batch 4, mean length 128,
2 heads on the one KV head, at 4 parts and at 3 and 5, against float64 (inputs rounded by torch,
read exactly; the interpreter truncates the bfloat16 output, a gap of 5.6e-6 of the 1e-5)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kernels.paged_attention import FP8_KV_CACHE
from kernels.split_kv_attention import combine_splits, plan_schedule, split_kv_attention
from tests.dtypes import collapse_gpu_cases

pytestmark = pytest.mark.lazy_attn_state  # the lazily planned kernels of vLLM #42444

BATCH, S_Q, MEAN_SK, H_Q, VARLEN = 128, (1, 2), (4096, 8192, 16384), (16, 32, 64, 128), (0, 1)
DTYPES = (torch.bfloat16, torch.float16, FP8_KV_CACHE)
D, DV, BLOCK_SIZE, ROW_PAD = 576, 512, 64, 256
H100_SMS, DEVICE_BUDGET, SMALL_TENSORS = 132, 12 * 2**30, 2**29
OUT_GAP = {torch.bfloat16: 1e-5, torch.float16: 1e-5, FP8_KV_CACHE: 1e-4}
LSE_GAP = 1e-5
NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", FP8_KV_CACHE: "fp8"}


def upstream_parts(s_q: int, h_q: int) -> int:
    """FlashMLA's part count on an H100: its SMs over the 64-row tiles of s_q * h_q query rows."""
    return max(H100_SMS // -(-(s_q * h_q) // 64), 1)


def cache_lengths(batch: int, s_q: int, mean: int, varlen: int) -> list[int]:
    """Upstream's lengths: `mean`, or (varlen) normal draws from seed 0, at least s_q."""
    draw = random.Random(0)
    return [
        int(max(draw.normalvariate(mean, mean / 2), s_q)) if varlen else mean for _ in range(batch)
    ]


def row_len(lengths: list[int]) -> int:
    return -(-max(lengths) // ROW_PAD) * ROW_PAD


def case_bytes(s_q: int, mean: int, h_q: int, varlen: int, dtype: torch.dtype) -> int:
    """An upper bound of a case's device memory: its cache as drawn (an fp8 one drawn in bfloat16
    and rounded, both held at once), the float32 partial workspaces (output and log-sum-exp) at
    upstream's part count, and SMALL_TENSORS for the rest."""
    entries = BATCH * row_len(cache_lengths(BATCH, s_q, mean, varlen)) * D
    cache = entries * (2 + 1 if dtype == FP8_KV_CACHE else 2)
    workspaces = upstream_parts(s_q, h_q) * BATCH * s_q * h_q * (D + 1) * 4
    return cache + workspaces + SMALL_TENSORS


UPSTREAM = list(itertools.product(S_Q, MEAN_SK, H_Q, VARLEN, DTYPES))
name = lambda s_q, mean, h_q, varlen, dtype: f"sq{s_q}-{mean}{'v' * varlen}-h{h_q}-{NAMES[dtype]}"


def cosine_gap(got: torch.Tensor, want: torch.Tensor) -> float:
    """Upstream's measure over every element, in float64: NaN anywhere gives NaN."""
    a, b = got.double().flatten(), want.double().flatten()
    return float(1 - 2 * a.dot(b) / (a.dot(a) + b.dot(b)).clamp_min(1e-12))


def _inputs(device, batch, s_q, mean, h_q, varlen, dtype):
    """(query [batch, s_q, h_q, D], cache [blocks, BLOCK_SIZE, 1, D], lengths), as upstream makes
    them: drawn in the model's dtype, the cache NaN past each length, an fp8 query's values in
    bfloat16."""
    lengths = cache_lengths(batch, s_q, mean, varlen)
    pad, model = row_len(lengths), torch.bfloat16 if dtype == FP8_KV_CACHE else dtype
    gen = torch.Generator(device).manual_seed(0)
    draw = lambda *shape: torch.randn(*shape, generator=gen, dtype=model, device=device)
    q, cache = draw(batch, s_q, h_q, D), draw(batch, pad, D)
    past = torch.arange(pad, device=device) >= torch.tensor(lengths, device=device)[:, None]
    cache.masked_fill_(past[:, :, None], float("nan"))
    if dtype == FP8_KV_CACHE:
        q, cache = q.to(FP8_KV_CACHE).to(model), cache.to(FP8_KV_CACHE)
    return q, cache.view(-1, BLOCK_SIZE, 1, D), lengths


def _split_kv(device, q, cache, lengths, parts, plan_lengths=None):
    """Plan, split and combine: (output [batch, s_q, h_q, DV], lse [batch, s_q, h_q])."""
    (batch, s_q, h_q, _), row_blocks = q.shape, cache.shape[0] // len(lengths)
    reqs = batch * s_q
    horizons = [n - s_q + 1 + j for n in lengths for j in range(s_q)]
    seq_lens = torch.tensor(horizons, dtype=torch.int32, device=device)
    table = torch.arange(cache.shape[0], dtype=torch.int32, device=device).view(batch, -1)
    meta = torch.empty(parts, 4, dtype=torch.int32, device=device)
    plan = seq_lens if plan_lengths is None else torch.tensor(plan_lengths, device=device).int()
    plan_schedule(plan, meta, torch.empty(reqs, dtype=torch.int32, device=device))
    partial_out = torch.full((parts, reqs, h_q, D), float("nan"), device=device)
    partial_lse = torch.full((parts, reqs, h_q), float("nan"), device=device)
    ones = lambda: torch.ones(1, device=device)
    scales = dict(k_scale=ones(), v_scale=ones()) if cache.dtype == FP8_KV_CACHE else {}
    rows = table.repeat_interleave(s_q, 0)
    args = (q.reshape(reqs, h_q, D), cache, cache, rows, seq_lens, meta, partial_out, partial_lse)
    split_kv_attention(*args, D**-0.5, row_blocks * BLOCK_SIZE, **scales)
    out = torch.full((reqs, h_q, D), float("nan"), dtype=q.dtype, device=device)
    combine_splits(partial_out, partial_lse, meta, out)
    assert not out.isnan().any(), "the combine left output unwritten"
    covered = torch.arange(reqs, device=device)
    first, last = meta[:, :1], meta[:, 2:3]
    covers = (first >= 0) & (first <= covered) & (covered <= last)
    lse = partial_lse.masked_fill(~covers[:, :, None], float("-inf")).logsumexp(0)
    return out[..., :DV].reshape(batch, s_q, h_q, DV), lse.view(batch, s_q, h_q)


def _reference(q, cache, lengths, dtype):
    """Upstream's attention per request and query token over its causal horizon, in `dtype`."""
    batch, s_q, h_q, _ = q.shape
    keys_of = cache.view(batch, -1, D)
    out = torch.empty(batch, s_q, h_q, DV, dtype=dtype, device=q.device)
    lse = torch.empty(batch, s_q, h_q, dtype=dtype, device=q.device)
    for i, n in enumerate(lengths):
        keys = keys_of[i, :n].to(dtype)
        scores = torch.einsum("thd,nd->thn", q[i].to(dtype), keys) * D**-0.5
        horizon = n - s_q + 1 + torch.arange(s_q, device=q.device)
        hidden = torch.arange(n, device=q.device) >= horizon[:, None]  # [s_q, n]
        scores.masked_fill_(hidden[:, None], float("-inf"))
        lse[i] = scores.logsumexp(-1)
        out[i] = scores.softmax(-1) @ keys[:, :DV]
    return out, lse


def _check(device, batch, s_q, mean, h_q, varlen, dtype, parts) -> None:
    q, cache, lengths = _inputs(device, batch, s_q, mean, h_q, varlen, dtype)
    out, lse = _split_kv(device, q, cache, lengths, parts)
    want_out, want_lse = _reference(
        q, cache, lengths, torch.float64 if device == "cpu" else torch.float32
    )
    assert cosine_gap(out, want_out) < OUT_GAP[dtype]
    assert cosine_gap(lse, want_lse) < LSE_GAP


@pytest.mark.parametrize(
    ("s_q", "mean", "h_q", "varlen", "dtype"),
    collapse_gpu_cases([pytest.param(*c, id=name(*c), marks=pytest.mark.gpu) for c in UPSTREAM]),
)
def test_upstream_cases(device, s_q, mean, h_q, varlen, dtype) -> None:
    _check(device, BATCH, s_q, mean, h_q, varlen, dtype, upstream_parts(s_q, h_q))
    torch.cuda.empty_cache()  # the caches differ in size from case to case: up to 10.4 GiB


MINIATURE = [(1, 0, torch.bfloat16), (2, 1, torch.float16), (2, 1, FP8_KV_CACHE)]


@pytest.mark.parametrize(
    ("s_q", "varlen", "dtype"), MINIATURE, ids=[f"sq{s}-{v}-{NAMES[d]}" for s, v, d in MINIATURE]
)
def test_upstream_structure_in_miniature(device, s_q, varlen, dtype) -> None:
    _check(device, 4, s_q, 128, 2, varlen, dtype, 4)


@pytest.mark.parametrize("parts", [3, 5])
def test_upstream_structure_at_part_counts_not_powers_of_two(device, parts) -> None:
    """FlashMLA's part counts (132, 66, 33) are not powers of two: the miniature at 3 and 5 parts
    passes upstream's assertion."""
    _check(device, 4, 2, 128, 2, 1, torch.bfloat16, parts)


def test_upstream_assertion_fails_on_a_plan_for_other_lengths(device) -> None:
    """A plan made for one key per request (a stale plan) fails upstream's assertion."""
    q, cache, lengths = _inputs(device, 4, 2, 128, 2, 1, torch.bfloat16)
    out, lse = _split_kv(device, q, cache, lengths, 4, plan_lengths=[1] * 8)
    want_out, want_lse = _reference(q, cache, lengths, torch.float64)
    assert not cosine_gap(out, want_out) < OUT_GAP[torch.bfloat16]  # measured: 0.96
    assert not cosine_gap(lse, want_lse) < LSE_GAP  # measured: 0.38


def test_upstream_product_accounting() -> None:
    assert len(UPSTREAM) == 144
    assert {upstream_parts(s, h) for s in S_Q for h in H_Q} == {132, 66, 33}
    sizes = {name(*case): case_bytes(*case) for case in UPSTREAM}
    assert max(sizes.values()) < DEVICE_BUDGET  # every case runs on a GPU
    assert f"{min(sizes.values()) / 2**30:.1f} {max(sizes.values()) / 2**30:.1f}" == "1.6 10.4"
    assert {case for case, size in sizes.items() if size > 10 * 2**30} == {
        *("sq1-16384v-h64-fp8", "sq1-16384v-h128-fp8"),
        *("sq2-16384v-h32-fp8", "sq2-16384v-h64-fp8", "sq2-16384v-h128-fp8"),
    }
