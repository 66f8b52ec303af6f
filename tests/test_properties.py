"""Property sweeps of the kernels against their references (hypothesis), bounded: a short,
derandomized profile on the CPU (the interpreter is slow), a longer one on a GPU
(conftest.py picks it). Each sweep carries the marker of the bug whose kernels it guards."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kernels.fused_moe_lora import fused_moe_lora_shrink, fused_moe_lora_shrink_reference
from kernels.lora_ops import lora_expand, lora_expand_reference, lora_shrink, lora_shrink_reference
from kernels.moe_lora_align import (
    align_sizes,
    canonical_sorted_ids,
    moe_lora_align_block_size,
    moe_lora_align_reference,
    processed_lora_ids,
)
from kernels.split_kv_attention import plan_reference, plan_schedule
from tests.test_lora_ops import make_meta


@st.composite
def align_problems(draw) -> dict:
    """An align call: experts past 64 (the large path), block sizes 16..128, small and large
    token counts; active ids of -1 and real slots with gaps, disabled adapters, forged ids at
    and past the limit."""
    max_loras = draw(st.integers(1, 8))
    num_experts = draw(st.sampled_from([1, 3, 8, 61, 64, 67, 130]))
    top_k = draw(st.integers(1, min(4, num_experts)))
    large = draw(st.booleans())
    num_tokens = draw(st.integers(1024 // top_k, 1400 // top_k) if large else st.integers(1, 60))
    real = draw(
        st.lists(st.integers(0, max_loras - 1), unique=True, min_size=0, max_size=max_loras)
    )
    forged = draw(st.lists(st.sampled_from([max_loras, max_loras + 3]), max_size=1))
    ids = [-1] * draw(st.integers(0, 1)) + real + forged
    ids = (ids + [-1] * (max_loras + 1))[: max_loras + 1]
    disabled = draw(st.lists(st.sampled_from(real or [0]), unique=True, max_size=2))
    return {
        "num_tokens": num_tokens,
        "top_k": top_k,
        "num_experts": num_experts,
        "block_size": draw(st.sampled_from([16, 32, 64, 128])),
        "max_loras": max_loras,
        "lora_ids": ids,
        "disabled": [d for d in disabled if d < max_loras],
        "seed": draw(st.integers(0, 2**16)),
    }


def _align_inputs(p: dict):
    gen = torch.Generator().manual_seed(p["seed"])
    e, k, n = p["num_experts"], p["top_k"], p["num_tokens"]
    topk = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).to(torch.int32)
    owners = torch.tensor(p["lora_ids"], dtype=torch.int32)
    mapping = owners[torch.randint(0, len(owners), (n,), generator=gen)]
    enabled = torch.ones(p["max_loras"] + 4, dtype=torch.int32)  # forged ids read a real flag
    enabled[p["disabled"]] = 0
    padded, m_blocks = align_sizes(topk.numel(), e, p["block_size"])
    rows = p["max_loras"]
    prefill = (
        torch.full((rows, padded), -2, dtype=torch.int32),
        torch.full((rows, m_blocks), -7, dtype=torch.int32),
        torch.full((rows,), -13, dtype=torch.int32),
    )
    return topk, mapping, owners, enabled, prefill


def _sizes(p: dict) -> dict:
    keys = ("num_experts", "block_size", "max_loras")
    return {key: p[key] for key in keys}


def _check_align(p: dict, device: str, backend: str) -> None:
    topk, mapping, owners, enabled, prefill = _align_inputs(p)
    outputs = tuple(t.clone().to(device) for t in prefill)
    dev = lambda t: t.to(device)
    moe_lora_align_block_size(
        dev(topk), dev(mapping), dev(owners), dev(enabled), *outputs, backend=backend, **_sizes(p)
    )
    expected = moe_lora_align_reference(topk, mapping, owners, enabled, prefill, **_sizes(p))
    rows = processed_lora_ids(owners, enabled, p["max_loras"])
    got = canonical_sorted_ids(outputs[0], outputs[1], rows, p["block_size"])
    assert torch.equal(got, expected[0]), f"sorted_token_ids differ for {p}"
    assert torch.equal(outputs[1].cpu(), expected[1]), f"expert_ids differ for {p}"
    assert torch.equal(outputs[2].cpu(), expected[2]), f"num_tokens_post_pad differ for {p}"


@pytest.mark.moe_align_grid
@given(align_problems())
def test_triton_align_matches_reference(device, p) -> None:
    _check_align(p, device, "triton")


def _small_path_edge(num_tokens: int, top_k: int, max_loras: int) -> dict:
    """The small path's upper edge with 64 experts (upstream's test: 100 tokens, top-k 6)."""
    return {
        "num_tokens": num_tokens,
        "top_k": top_k,
        "num_experts": 64,
        "block_size": 16,
        "max_loras": max_loras,
        "lora_ids": [-1, *range(max_loras)],
        "disabled": [],
        "seed": num_tokens,
    }


SMALL_PATH_EDGES = [(100, 6, 2), (100, 6, 32), (341, 3, 4)]  # 600, 600, 1023 pairs


@pytest.mark.moe_align_grid
@pytest.mark.parametrize(("num_tokens", "top_k", "max_loras"), SMALL_PATH_EDGES)
@pytest.mark.parametrize("backend", ["triton", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_align_small_path_upper_edge(device, backend, num_tokens, top_k, max_loras) -> None:
    """A [next_pow2(numel), 64] one-hot tile would not fit an H100's shared memory: the
    Triton small path tiles over pairs (it failed to compile here before)."""
    _check_align(_small_path_edge(num_tokens, top_k, max_loras), device, backend)


@pytest.mark.gpu
@pytest.mark.moe_align_grid
@given(align_problems())
def test_cuda_align_matches_reference(device, p) -> None:
    _check_align(p, device, "cuda")


@pytest.mark.moe_align_grid
@given(
    align_problems().filter(
        lambda p: p["num_tokens"] * p["top_k"] < 1024 and max(p["lora_ids"]) < p["max_loras"]
    )
)
def test_fused_shrink_matches_reference(device, p) -> None:
    """(Forged ids are the align kernels' business: the consumer trusts its inputs.)"""
    topk, mapping, owners, enabled, prefill = _align_inputs(p)
    aligned = moe_lora_align_reference(topk, mapping, owners, enabled, prefill, **_sizes(p))
    gen = torch.Generator().manual_seed(p["seed"] + 1)
    rank, hidden = 16, 40
    x = torch.randint(-2, 3, (p["num_tokens"], hidden), generator=gen).float()
    lora_a = torch.randint(-2, 3, (p["max_loras"], p["num_experts"], rank, hidden), generator=gen)
    out = torch.full((p["num_tokens"] * p["top_k"], rank), -7.0)
    expected = fused_moe_lora_shrink_reference(x, lora_a.float(), topk, mapping, enabled, out)
    out = out.to(device)
    fused_moe_lora_shrink(
        x.to(device),
        lora_a.float().to(device),
        *(t.to(device) for t in aligned),
        owners.to(device),
        enabled.to(device),
        out,
        top_k=p["top_k"],
        block_size=p["block_size"],
    )
    assert torch.equal(out.cpu().double(), expected), f"shrink differs for {p}"


@pytest.mark.lora_dummy_run
@pytest.mark.lora_graph_capture
@given(
    slots=st.lists(st.integers(-1, 3), min_size=1, max_size=40),
    num_slices=st.integers(1, 3),
    rank=st.sampled_from([16, 32]),
    hidden=st.integers(8, 70),
    width=st.integers(1, 40),
)
def test_lora_shrink_expand_match_reference(device, slots, num_slices, rank, hidden, width):
    max_loras, n = 4, len(slots)
    gen = torch.Generator().manual_seed(n * 7 + rank)
    x = torch.randint(-2, 3, (n, hidden), generator=gen).float()
    lora_a = torch.randint(-2, 3, (num_slices, max_loras, rank, hidden), generator=gen).float()
    lora_b = torch.randint(-2, 3, (num_slices, max_loras, width, rank), generator=gen).float()
    y = torch.randint(-2, 3, (n, num_slices * width), generator=gen).float()
    meta = make_meta(slots, max_loras, device)
    buffer = torch.zeros(num_slices, n, rank, device=device)
    lora_shrink(x.to(device), lora_a.to(device), buffer, meta, 0.5)
    y_dev = y.clone().to(device)
    lora_expand(buffer, lora_b.to(device), y_dev, meta)
    shrunk = lora_shrink_reference(x, lora_a, slots, 0.5)
    assert torch.equal(y_dev.cpu().double(), lora_expand_reference(y, shrunk, lora_b, slots))


@pytest.mark.lazy_attn_state
@given(st.lists(st.integers(1, 48), min_size=1, max_size=8), st.sampled_from([1, 2, 4, 8]))
def test_plan_matches_reference(device, lengths, num_parts) -> None:
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    meta = torch.empty(num_parts, 4, dtype=torch.int32, device=device)
    splits = torch.empty(len(lengths), dtype=torch.int32, device=device)
    plan_schedule(seq_lens, meta, splits)
    rows, expected_splits = plan_reference(lengths, num_parts)
    assert [tuple(r) for r in meta.tolist()] == rows and splits.tolist() == expected_splits
